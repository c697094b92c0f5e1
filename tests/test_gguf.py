"""GGUF files as served models: every architecture the converter names, each tensor type's path
(kept bit for bit, or dequantized and quantized again with MLX), Ollama's model store, the
conversion's cache, and the clear error a file that cannot be served gets at start.

Architectures other than llama have no real file the tests can download: each is written here
from a random-weight mlx-lm model the way llama.cpp's converter writes it (tests/ggufwrite.py),
converted back, and must compute exactly what the model it came from computes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from meshnode.model.build import build_model
from meshnode.weights.gguf_source import content_hash, ollama_blob, resolve_gguf
from meshnode.weights.gguf_tensors import GROUP_SIZE, UnsupportedGGUF, open_gguf, plan_tensor
from meshnode.weights.modelsource import ModelNotFound, resolve_model
from tests.ggufwrite import write_gguf

Q = gguf.GGMLQuantizationType
PROMPT = [[3, 17, 42, 99, 7, 250, 31, 64, 128, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
# Families as llama.cpp names them in GGUF; gemma3 with Gemma 3's own window pattern (6), which
# GGUF files do not store.
FAMILIES = {
    "llama": {},
    "mixtral": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {},
    "gemma2": {},
    "gemma3": {"num_layers": 6, "sliding_window_pattern": 6},
    "phi3": {},
}


def _family(tmp_path, family, dtype="float32"):
    extra = dict(FAMILIES[family])
    layers = extra.pop("num_layers", 4)
    return build_model(
        tmp_path / family, family, num_layers=layers, hidden_size=64, intermediate_size=128, dtype=dtype, **extra
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_architecture_converts_to_the_model_it_came_from(family, tmp_path):
    source = _family(tmp_path, family)
    _, folder = resolve_gguf(str(write_gguf(source, tmp_path / f"{family}.gguf")), tmp_path / "cache")
    want, _ = load_model(source)
    got, config = load_model(folder)
    x = mx.array(PROMPT)
    a, b = want(x), got(x)
    # Exact but for Gemma's norms, stored as 1 + w (float32 rounds (1 + w) - 1).
    assert mx.allclose(a, b, atol=1e-4).item(), float(mx.abs(a - b).max())
    assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item()


def test_q4_0_and_q8_0_are_kept_as_mlx_reads_them(tmp_path):
    source = _family(tmp_path, "llama")
    for kind in (Q.Q4_0, Q.Q8_0):
        path = write_gguf(source, tmp_path / f"llama-{kind.name}.gguf", kind)
        _, folder = resolve_gguf(str(path), tmp_path / "cache")
        theirs, _ = mx.load(str(path), return_metadata=True)
        ours = mx.load(str(folder / "model.safetensors"))
        pairs = (
            ("blk.1.ffn_down", "model.layers.1.mlp.down_proj"),
            ("blk.0.attn_v", "model.layers.0.self_attn.v_proj"),
        )
        for g, m in pairs:
            for part in ("weight", "scales", "biases"):
                assert mx.array_equal(theirs[f"{g}.{part}"], ours[f"{m}.{part}"]), (kind.name, g, part)
        config = json.loads((folder / "config.json").read_text())
        assert config["quantization"]["bits"] == (4 if kind == Q.Q4_0 else 8)
        assert config["gguf"]["weights"] == f"GGUF weights: {kind.name} kept bit for bit"
        model, _ = load_model(folder)
        assert model(mx.array(PROMPT)).shape == (1, len(PROMPT[0]), config["vocab_size"])


def _raw_tensor(tmp_path, kind, rows=8, cols=512):
    """A GGUF tensor of ``kind`` with random blocks whose scales are sane float16s."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.01], np.float16).view(np.uint8)
    where = {
        Q.Q4_K: (0, 2),
        Q.Q5_K: (0, 2),
        Q.Q6_K: (size - 2,),
        Q.Q5_0: (0,),
        Q.Q3_K: (size - 2,),
        Q.Q2_K: (size - 4, size - 2),
    }[kind]
    for offset in where:
        raw[:, :, offset : offset + 2] = scale
    w = gguf.GGUFWriter(str(tmp_path / f"{kind.name}.gguf"), "llama")
    w.add_tensor("blk.0.ffn_down.weight", raw.reshape(rows, -1), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_gguf(tmp_path / f"{kind.name}.gguf").tensors[0]


@pytest.mark.parametrize("kind,bits", [(Q.Q4_K, 4), (Q.Q5_K, 5), (Q.Q6_K, 6), (Q.Q5_0, 5), (Q.Q3_K, 3), (Q.Q2_K, 3)])
def test_other_types_are_dequantized_and_quantized_again_at_the_nearest_width(tmp_path, kind, bits):
    t = _raw_tensor(tmp_path, kind)
    parts = plan_tensor(t, "model.layers.0.mlp.down_proj.weight")
    weight, scales, biases = (p.make() for p in parts)
    assert [p.name.rsplit(".", 1)[1] for p in parts] == ["weight", "scales", "biases"]
    assert weight.shape == (8, 512 * bits // 32) and scales.dtype == mx.float16
    want = gguf.quants.dequantize(np.asarray(t.data), kind).astype(np.float32)
    got = np.array(
        mx.dequantize(weight, scales.astype(mx.float32), biases.astype(mx.float32), group_size=GROUP_SIZE, bits=bits)
    )
    # Within one of MLX's steps of each group (its grid holds zero exactly, so a value can lie a
    # step from the nearest level), and float16's rounding of the scale and offset.
    step = np.repeat(np.abs(np.array(scales.astype(mx.float32))), GROUP_SIZE, axis=1)
    assert np.all(np.abs(got - want) <= 1.01 * step + 2e-3 * np.abs(want).max())


@pytest.mark.parametrize("kind", [Q.F32, Q.Q8_0])
def test_an_mtp_layer_counted_in_block_count_stays_out_of_the_backbone(tmp_path, kind):
    from mlx_lm.generate import generate_step

    from meshnode.model.mtp import MTPHead, shared_from
    from meshnode.model.mtp_load import load_mtp
    from meshnode.weights.profile import profile_model

    source = _family(tmp_path, "llama")
    want, _ = load_model(source)
    head = MTPHead(want.args, shared_from(want))
    path = write_gguf(source, tmp_path / "mtp.gguf", kind, mtp=head)
    meta = gguf.GGUFReader(str(path)).fields
    assert meta["llama.block_count"].contents() == 5 and meta["llama.nextn_predict_layers"].contents() == 1
    _, folder = resolve_gguf(str(path), tmp_path / "cache")
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["gguf"]["mtp"]["layers"] == 1
    assert not [k for k in mx.load(str(folder / "model.safetensors")) if k.startswith("model.layers.4.")]
    got, _ = load_model(folder)  # strict: every tensor has its place, none is missing
    if kind == Q.F32:  # the backbone answers as mlx-lm does on the model it came from
        prompt = mx.array(PROMPT[0])
        ours = [int(t) for t, _ in generate_step(prompt, got, max_tokens=12)]
        assert ours == [int(t) for t, _ in generate_step(prompt, want, max_tokens=12)]
    # the head stays in the file for its loader; the profile counts it at its stored precision
    loaded = load_mtp(path, got)
    assert loaded.quantized_bits() == (8 if kind == Q.Q8_0 else None)
    profile = profile_model(folder)
    assert profile.num_layers == 4 and profile.mtp_bytes == sum(loaded.own_bytes().values()) > 0


def test_a_file_that_cannot_be_served_says_what_it_is(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelNotFound, match="GGUF architecture 'mamba' is not supported"):
        resolve_model(str(tmp_path / "mamba.gguf"), tmp_path / "cache")
    source = _family(tmp_path, "llama")
    path = write_gguf(source, tmp_path / "llama.gguf")
    reader = gguf.GGUFReader(str(path))
    extra = gguf.GGUFWriter(str(tmp_path / "extra.gguf"), "llama")
    for name, field in reader.fields.items():  # the same file plus one tensor no llama has
        if not name.startswith("GGUF.") and name != "general.architecture":
            extra.add_key_value(
                name, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None
            )
    for t in reader.tensors:
        extra.add_tensor(t.name, np.asarray(t.data))
    extra.add_tensor("blk.0.mystery.weight", np.zeros((4, 32), np.float32))
    extra.write_header_to_file()
    extra.write_kv_data_to_file()
    extra.write_tensors_to_file()
    extra.close()
    with pytest.raises(UnsupportedGGUF, match="tensor blk.0.mystery.weight has no place in mlx-lm's llama"):
        resolve_gguf(str(tmp_path / "extra.gguf"), tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").glob("*.partial-*")), "a failed conversion left a partial folder"


@pytest.mark.slow
def test_a_node_whose_gguf_cannot_be_served_stays_up_and_says_why(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from harness.cluster import node_argv

    port = _free_port()
    proc = subprocess.Popen(
        node_argv(
            tmp_path / "mamba.gguf",
            host="127.0.0.1",
            http_port=port,
            grpc_port=_free_port(),
            mdns=False,
            state_dir=tmp_path / "state",
            cache_dir=tmp_path / "cache",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline, answer = time.monotonic() + 120, None
        while answer is None and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/mesh", timeout=2)
            except urllib.error.HTTPError as exc:
                answer = (exc.code, json.loads(exc.read()))
            except OSError:
                time.sleep(0.3)
        assert answer is not None and answer[0] == 503, answer
        assert "GGUF architecture 'mamba' is not supported" in answer[1]["error"]["message"]
        time.sleep(1)
        assert proc.poll() is None, "the node exited (a service manager would restart it in a loop)"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "Traceback" not in out, out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_ollama_model_is_its_blob_and_gets_the_id_its_content_gives(tmp_path, monkeypatch):
    path = write_gguf(_family(tmp_path, "qwen3"), tmp_path / "qwen3.gguf")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    store = tmp_path / "ollama"
    (store / "blobs").mkdir(parents=True)
    shutil.copy(path, store / "blobs" / f"sha256-{sha}")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q8"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(
        json.dumps(
            {
                "layers": [
                    {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
                    {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{sha}"},
                ]
            }
        )
    )
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    assert ollama_blob("ollama:tiny:q8") == store / "blobs" / f"sha256-{sha}"
    with pytest.raises(FileNotFoundError, match="Ollama has no model tiny:latest"):
        ollama_blob("ollama:tiny")
    from_ollama = resolve_model("ollama:tiny:q8", tmp_path / "cache")
    from_path = resolve_model(str(path), tmp_path / "cache")
    assert from_ollama == from_path and from_ollama[0].endswith(sha[:12])
    assert content_hash(path, tmp_path / "cache") == sha  # remembered once computed
    with pytest.raises(ModelNotFound, match="Ollama has no model nothing:latest"):
        resolve_model("ollama:nothing", tmp_path / "cache")


def test_an_interrupted_conversion_is_redone_never_used(tmp_path):
    path = write_gguf(_family(tmp_path, "llama"), tmp_path / "llama.gguf")
    sha = content_hash(path, tmp_path / "cache")
    partial = tmp_path / "cache" / "gguf" / f"{sha}.partial-99999"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"half a file")
    seen: list[tuple[str, int, int]] = []
    model_id, folder = resolve_gguf(str(path), tmp_path / "cache", lambda *a: seen.append(a))
    assert not partial.exists() and folder.name == sha
    task, done, total = seen[-1]  # what /v1/mesh's progress shows while it converts
    assert task == "converting llama.gguf" and done == total > 0
    load_model(folder)
    mtime = os.stat(folder / "config.json").st_mtime_ns
    assert resolve_gguf(str(path), tmp_path / "cache") == (model_id, folder)
    assert os.stat(folder / "config.json").st_mtime_ns == mtime  # converted once
    assert resolve_model(str(folder), tmp_path / "cache") == (model_id, folder)  # the folder keeps the file's id


def test_the_cli_takes_gguf_and_ollama_models():
    out = subprocess.run(
        [sys.executable, "-m", "meshnode.cli", "run", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "GGUF file" in out and "ollama:NAME[:TAG]" in out
