"""Model profiles come from safetensors headers and config.json only."""

import json

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from meshnode.data.profile import profile_model
from meshnode.modelbuild import build_model


def test_layer_bytes_match_the_real_parameters(tmp_path):
    path = build_model(tmp_path / "m", "llama", num_layers=5, max_file_size_mb=1)
    p = profile_model(path)
    model, _ = load_model(path)
    params = dict(tree_flatten(model.parameters()))
    for i in range(5):
        assert p.layer_bytes[i] == sum(v.nbytes for k, v in params.items() if f"layers.{i}." in k)
    assert p.embed_bytes == params["model.embed_tokens.weight"].nbytes
    assert p.head_bytes == params["lm_head.weight"].nbytes and not p.tied_embeddings
    total = sum(v.nbytes for v in params.values())
    assert sum(p.layer_bytes) + p.embed_bytes + p.head_bytes + p.norm_bytes == total
    assert p.kv_bytes_per_token[0] == 2 * 2 * 16 * 4  # k and v, 2 kv heads, head_dim 16, float32
    assert p.stage_bytes(0, 5, 10) == total + 5 * 10 * p.kv_bytes_per_token[0]


def test_tied_and_sliding_windows(tmp_path):
    assert profile_model(build_model(tmp_path / "g", "gemma3", num_layers=6)).sliding_window == \
        (16, 16, None, 16, 16, None)
    p = profile_model(build_model(tmp_path / "q", "qwen2", num_layers=6))
    assert p.tied_embeddings and p.head_bytes == 0
    # the last stage holds the tied embedding for the head
    assert p.stage_bytes(3, 6, 4) - p.stage_bytes(3, 5, 4) > p.embed_bytes


def test_reads_headers_only(tmp_path):
    path = build_model(tmp_path / "m", "qwen2", num_layers=3)
    before = profile_model(path)
    for f in path.glob("*.safetensors"):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        f.write_bytes(raw[: 8 + n] + b"\0" * 16)  # tensor data gone: only headers remain
    assert profile_model(path) == before
