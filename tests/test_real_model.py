"""A real trained model through the paths that matter: SmolLM2-135M-Instruct, from the Q4_1 GGUF
file users hold (tests/realmodel.py), converted as a node converts it.

* the conversion keeps MLX's own reading of the file bit for bit, and the model answers real
  questions;
* one node and 2 stages on namespace hosts, each node converting the file itself, answer token for
  token as mlx_lm.generate does on the converted folder, through either node;
* the same weights as bf16 and as 8-bit (re-quantized from them) split identically. The 8-bit
  copy keeps float32 scales: bf16 is the bf16 case's to cover, and MLX's CPU kernels run a bf16
  quantized matmul about 8x slower than a float32 one.

tests/test_real_model_mesh.py takes the same model through faults and multi-turn chats.
"""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest

from harness.cluster import Cluster, mlx_reference
from harness.netns import netns_mesh
from meshnode.weights.profile import profile_model
from tests.realmodel import converted, serve, stop_all, variant

CTX = 1024
QUESTIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "system", "content": "You answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
]
TEA = [{"role": "user", "content": "How do I make a good cup of tea?"}]


def test_conversion_keeps_mlxs_own_reading_of_the_file_bit_for_bit(smollm2_gguf, smollm2):
    theirs, _ = mx.load(str(smollm2_gguf), return_metadata=True)
    _, folder = smollm2
    ours = {}
    for f in folder.glob("*.safetensors"):
        ours.update(mx.load(str(f)))
    pairs = {
        "token_embd": "model.embed_tokens",
        "blk.0.attn_v": "model.layers.0.self_attn.v_proj",
        "blk.29.ffn_down": "model.layers.29.mlp.down_proj",
        "blk.7.ffn_gate": "model.layers.7.mlp.gate_proj",
    }
    for g, m in pairs.items():
        for part in ("weight", "scales", "biases"):
            assert mx.array_equal(theirs[f"{g}.{part}"], ours[f"{m}.{part}"]), (g, part)
    assert mx.array_equal(theirs["output_norm.weight"], ours["model.norm.weight"])
    config = json.loads((folder / "config.json").read_text())
    assert config["gguf"]["weights"] == "GGUF weights: Q4_1/Q8_0 kept bit for bit"
    assert config["quantization"]["bits"] == 4 and config["quantization"]["model.embed_tokens"]["bits"] == 8
    assert config["gguf"]["type"] == "Q4_1" and profile_model(folder).quantization == "Q4_1"  # Ollama's level


@pytest.mark.slow
def test_the_converted_model_answers_real_questions(smollm2):
    _, folder = smollm2
    assert "Paris" in mlx_reference(folder, QUESTIONS[0], 20)
    assert "def " in mlx_reference(folder, QUESTIONS[1], 40)


@pytest.mark.slow
def test_the_same_file_gives_the_same_id_and_folder(smollm2_gguf, smollm2, tmp_path):
    model_id, folder = smollm2
    again_id, again = converted(smollm2_gguf, tmp_path)
    assert again_id == model_id and again.resolve().name == folder.resolve().name
    assert re.fullmatch(r"smollm2-135m-q4-1-[0-9a-f]{12}", model_id)


@pytest.fixture(scope="module")
def mesh():
    with netns_mesh(3) as m:
        yield m


@pytest.fixture(scope="module")
def cluster(mesh, smollm2, tmp_path_factory):
    return Cluster(mesh, smollm2[1], tmp_path_factory.mktemp("cluster"), max_context=CTX)


@pytest.mark.netns
@pytest.mark.timeout(900)
def test_one_node_and_two_stages_answer_as_mlx_lm(cluster, smollm2_gguf, smollm2, tmp_path):
    _, folder = smollm2
    want = [mlx_reference(folder, q, 32) for q in QUESTIONS]
    view = serve(cluster, smollm2_gguf, folder, tmp_path / "one", (1.5,), convert=True)
    try:
        assert view["plan"]["strategy"] == "single", view["plan"]
        assert [cluster.chat(cluster.hosts[0], q, 32) for q in QUESTIONS] == want
    finally:
        stop_all(cluster)
    view = serve(cluster, smollm2_gguf, folder, tmp_path / "two", (0.75, 0.75), convert=True)
    try:
        assert view["plan"]["strategy"] == "pipeline" and len(view["plan"]["stages"]) == 2, view["plan"]
        assert "GGUF weights: Q4_1/Q8_0 kept bit for bit" in view["plan"]["reason"]
        for h in cluster.hosts[:2]:
            assert [cluster.chat(h, q, 32) for q in QUESTIONS] == want, (h.name, cluster.logs())
            assert "Traceback" not in cluster.log(h)
    finally:
        stop_all(cluster)


@pytest.mark.netns
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("bits,dtype", [(None, "bfloat16"), (8, "float32")], ids=["bf16", "8bit"])
def test_the_same_weights_in_bf16_and_8bit_split_as_mlx_lm(cluster, smollm2, tmp_path, bits, dtype):
    _, folder = smollm2
    out = variant(folder, tmp_path / f"smollm2-{bits or dtype}", bits=bits, dtype=dtype)
    want = mlx_reference(out, TEA, 16)
    assert "tea" in want, want  # bf16 rounds this small model off "Paris" on the capital question
    try:
        view = serve(cluster, out, out, tmp_path / "run", (0.75, 0.75))
        assert len(view["plan"]["stages"]) == 2, view["plan"]
        for h in cluster.hosts[:2]:
            assert cluster.chat(h, TEA, 16, timeout=300) == want, cluster.logs()
    finally:
        stop_all(cluster)
