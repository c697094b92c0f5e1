"""A real trained model through the paths that matter: SmolLM2-135M-Instruct, from the Q4_1 GGUF
file users hold (tests/realmodel.py), converted as a node converts it.

* the conversion keeps MLX's own reading of the file bit for bit, and the model answers real
  questions;
* one node and 2 stages on namespace hosts answer token for token as mlx_lm.generate does on the
  converted folder, through either node;
* a stage killed mid-answer replays to the uninterrupted answer; a 4-turn chat resumes kept
  prefixes and answers as the uncached conversation does;
* the same weights as bf16 and 8-bit (re-quantized from it) split identically;
* Open WebUI's answer-plus-title pattern gets a title of real words.
"""

from __future__ import annotations

import json
import re
import time

import mlx.core as mx
import pytest

from harness.cluster import HTTP, Cluster, in_ns, mlx_reference, read_stream, stage_nodes
from harness.netns import netns_mesh
from meshnode.weights.profile import profile_model
from tests.helpers import node_metrics, prompt_cache_reuse
from tests.realmodel import converted, smollm2, variant

CTX = 1024
QUESTIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "system", "content": "You answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
]
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]
TEA = [{"role": "user", "content": "How do I make a good cup of tea?"}]


@pytest.fixture(scope="module")
def gguf():
    return smollm2()


@pytest.fixture(scope="module")
def model(gguf, tmp_path_factory):
    """(model id, the converted folder linked under that id)."""
    return converted(gguf, tmp_path_factory.mktemp("real"))


def test_conversion_keeps_mlxs_own_reading_of_the_file_bit_for_bit(gguf, model):
    theirs, _ = mx.load(str(gguf), return_metadata=True)
    _, folder = model
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
def test_the_converted_model_answers_real_questions(model):
    _, folder = model
    assert "Paris" in mlx_reference(folder, QUESTIONS[0], 20)
    assert "def " in mlx_reference(folder, QUESTIONS[1], 40)


@pytest.mark.slow
def test_the_same_file_gives_the_same_id_and_folder(gguf, model, tmp_path):
    model_id, folder = model
    again_id, again = converted(gguf, tmp_path)
    assert again_id == model_id and again.resolve().name == folder.resolve().name
    assert re.fullmatch(r"smollm2-135m-q4-1-[0-9a-f]{12}", model_id)


@pytest.fixture(scope="module")
def mesh():
    with netns_mesh(3) as m:
        yield m


@pytest.fixture(scope="module")
def cluster(mesh, model, tmp_path_factory):
    return Cluster(mesh, model[1], tmp_path_factory.mktemp("cluster"), max_context=CTX)


def _serve(cluster, spec, folder, tmp, fractions):
    """One node per fraction on ``spec`` (the GGUF file itself: each node converts it into its own
    cache; or a model folder), a pipeline; the first view of the converged mesh."""
    tmp.mkdir(parents=True, exist_ok=True)
    cluster.model, cluster.tmp = folder, tmp
    total = profile_model(folder).total_bytes(CTX)
    hosts = cluster.hosts[: len(fractions)]
    for h, f in zip(hosts, fractions):
        cluster.start(h, int(total * f), env={"MESHNODE_STRATEGY": "pipeline"}, model=spec)
    return cluster.wait(lambda: cluster.converged(hosts, len(hosts)), 180, "convergence")[0]


def _stop(cluster):
    for proc in cluster.procs.values():
        cluster.mesh.stop(proc)
    cluster.procs.clear()


@pytest.mark.netns
@pytest.mark.timeout(900)
def test_one_node_and_two_stages_answer_as_mlx_lm(cluster, gguf, model, tmp_path):
    _, folder = model
    want = [mlx_reference(folder, q, 32) for q in QUESTIONS]
    view = _serve(cluster, gguf, folder, tmp_path / "one", (1.5,))
    try:
        assert view["plan"]["strategy"] == "single", view["plan"]
        assert [cluster.chat(cluster.hosts[0], q, 32) for q in QUESTIONS] == want
    finally:
        _stop(cluster)
    view = _serve(cluster, gguf, folder, tmp_path / "two", (0.75, 0.75))
    try:
        assert view["plan"]["strategy"] == "pipeline" and len(view["plan"]["stages"]) == 2, view["plan"]
        assert "GGUF weights: Q4_1/Q8_0 kept bit for bit" in view["plan"]["reason"]
        for h in cluster.hosts[:2]:
            assert [cluster.chat(h, q, 32) for q in QUESTIONS] == want, (h.name, cluster.logs())
            assert "Traceback" not in cluster.log(h)
    finally:
        _stop(cluster)


@pytest.mark.netns
@pytest.mark.timeout(900)
def test_a_stage_killed_mid_answer_replays_to_the_same_answer(cluster, mesh, gguf, model, tmp_path):
    _, folder = model
    want = mlx_reference(folder, STORY, 160)
    assert len(want) > 300, want
    view = _serve(cluster, gguf, folder, tmp_path, (0.75, 0.75, 0.75))
    try:
        first, head = stage_nodes(view)
        proc = cluster.procs[first]
        text, faulted = read_stream(
            cluster.stream(cluster.host(head), STORY, 160), fault=lambda: mesh.kill(proc), after_chunks=20, timeout=240
        )
        assert faulted and text == want
        after = cluster.mesh_view(cluster.host(head))
        assert after["epoch"] > view["epoch"] and first not in stage_nodes(after)
    finally:
        _stop(cluster)


@pytest.mark.netns
@pytest.mark.timeout(900)
def test_a_four_turn_chat_resumes_its_prefix_and_answers_as_uncached(cluster, gguf, model, tmp_path):
    _, folder = model
    view = _serve(cluster, gguf, folder, tmp_path, (0.75, 0.75))
    try:
        head = cluster.host(stage_nodes(view)[-1])
        messages = [{"role": "system", "content": "You are a helpful assistant who knows geography."}]
        for question in (
            "What is the capital of France?",
            "And of Italy?",
            "Which of the two is bigger?",
            "Name a river in each.",
        ):
            messages.append({"role": "user", "content": question})
            answer = cluster.chat(head, messages, 24)
            assert answer == mlx_reference(folder, messages, 24), (question, messages)
            messages.append({"role": "assistant", "content": answer})
        hits = sum(prompt_cache_reuse(node_metrics(cluster, h))[0] for h in cluster.hosts[:2])
        assert hits >= 3, hits
    finally:
        _stop(cluster)


@pytest.mark.netns
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("bits,dtype", [(None, "bfloat16"), (8, "bfloat16")], ids=["bf16", "8bit"])
def test_the_same_weights_in_bf16_and_8bit_split_as_mlx_lm(cluster, model, tmp_path, bits, dtype):
    _, folder = model
    out = variant(folder, tmp_path / f"smollm2-{bits or dtype}", bits=bits, dtype=dtype)
    want = mlx_reference(out, TEA, 16)
    assert "tea" in want, want  # bf16 rounds this small model off "Paris" on the capital question
    try:
        view = _serve(cluster, out, out, tmp_path / "run", (0.75, 0.75))
        assert len(view["plan"]["stages"]) == 2, view["plan"]
        for h in cluster.hosts[:2]:
            assert cluster.chat(h, TEA, 16, timeout=300) == want, cluster.logs()
    finally:
        _stop(cluster)


ANSWER_AND_TITLE = r"""
import json, sys, threading
from openai import OpenAI
base, model, chat, title = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=240)
out, t = {}, None
text = ""
for chunk in c.chat.completions.create(model=model, messages=chat, max_tokens=48, temperature=0, stream=True):
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
        if t is None:  # the answer is streaming: Open WebUI asks for the chat's title now
            t = threading.Thread(target=lambda: out.update(title=c.chat.completions.create(
                model=model, messages=title, max_tokens=24, temperature=0).choices[0].message.content))
            t.start()
t.join(240)
out.update(answer=text)
print(json.dumps(out))
"""
TITLE = [
    {
        "role": "user",
        "content": "Create a concise title of 3 to 5 words for this chat. Reply with the title "
        "only.\n\nUSER: How do I make a good cup of tea?",
    }
]


@pytest.mark.netns
@pytest.mark.timeout(900)
def test_open_webuis_answer_and_title_at_once_give_real_words(cluster, gguf, model, tmp_path):
    model_id, folder = model
    view = _serve(cluster, gguf, folder, tmp_path, (0.75, 0.75))
    try:
        head = cluster.host(stage_nodes(view)[-1])
        t0 = time.monotonic()
        out = in_ns(
            cluster.client,
            ANSWER_AND_TITLE,
            f"http://{head.ip}:{HTTP}",
            model_id,
            json.dumps(TEA),
            json.dumps(TITLE),
            timeout=300,
        )
        assert out["answer"] == mlx_reference(folder, TEA, 48)
        title = out["title"]
        assert title == mlx_reference(folder, TITLE, 24)
        words = re.findall(r"[A-Za-z]{2,}", title)
        assert "\n" not in title.strip() and 2 <= len(words) <= 12 and len(title) < 120, title
        print(f"answer and title in {time.monotonic() - t0:.1f} s; title: {title!r}")
    finally:
        _stop(cluster)
