"""Model profiles come from safetensors headers and config.json only.

The models here are real mlx-lm models (its own classes, random weights) written the way mlx-lm
writes them, so the profile is checked against the true size of every parameter.
"""

from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from meshnode.weights.profile import ModelProfile, profile_model, tensor_bytes
from meshnode.weights.weightfiles import read_safetensors_header

BASE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=100,
)


def build(
    path: Path, config: dict, *, files: int = 1, dtype=None, quantize: bool = False, extra: dict | None = None
) -> dict[str, mx.array]:
    """Write an mlx-lm model directory; returns its weights by name (the ground truth)."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    if dtype is not None:
        model.set_dtype(dtype)
    config = dict(config)
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
        config["quantization"] = {"group_size": 32, "bits": 4}
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    path.mkdir(parents=True)
    names = sorted(weights)
    for i in range(files):
        part = {k: weights[k] for k in names[i::files]}
        fname = "model.safetensors" if files == 1 else f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        mx.save_safetensors(str(path / fname), part, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config))
    if extra:
        mx.save_safetensors(str(path / "model-extra.safetensors"), extra, metadata={"format": "mlx"})
    return weights


def layer_nbytes(weights, i, prefix="model.layers."):
    return sum(v.nbytes for k, v in weights.items() if k.startswith(f"{prefix}{i}."))


@pytest.mark.parametrize("files", [1, 3])
def test_llama_untied_layer_bytes_are_the_true_parameter_bytes(tmp_path, files):
    cfg = {**BASE, "model_type": "llama", "tie_word_embeddings": False}
    weights = build(tmp_path / "m", cfg, files=files)
    # a copy of the weights mlx-lm would not load is not counted
    mx.save_safetensors(str(tmp_path / "m" / "consolidated.safetensors"), weights)
    p = profile_model(tmp_path / "m")
    assert p.name == "m" and p.model_type == "llama" and p.num_layers == 4
    assert p.layer_bytes == tuple(layer_nbytes(weights, i) for i in range(4))
    assert len(set(p.layer_bytes)) == 1 and p.layer_bytes[0] > 0
    assert p.embed_bytes == weights["model.embed_tokens.weight"].nbytes == 100 * 64 * 4
    assert p.head_bytes == weights["lm_head.weight"].nbytes and not p.tied_embeddings
    assert p.norm_bytes == weights["model.norm.weight"].nbytes
    total = sum(v.nbytes for v in weights.values())
    assert p.weight_bytes() == total == sum(tensor_bytes(tmp_path / "m").values())
    # keys and values: 2 kv heads of head_dim 16, float32
    assert p.kv_bytes_per_token == (2 * 2 * 16 * 4,) * 4 and p.sliding_window == (None,) * 4
    assert (p.hidden_size, p.num_heads, p.num_kv_heads, p.head_dim, p.intermediate_size) == (64, 4, 2, 16, 128)
    assert (p.num_experts, p.vocab_size, p.dtype) == (0, 100, "float32")
    assert p.total_bytes(10) == p.stage_bytes(0, 4, 10) == total + 4 * 10 * 256
    assert p.stage_bytes(0, 2, 10) == p.embed_bytes + sum(p.layer_bytes[:2]) + 2 * 10 * 256
    assert p.stage_bytes(2, 4, 10) == p.norm_bytes + p.head_bytes + sum(p.layer_bytes[2:]) + 2 * 10 * 256
    assert p.stage_bytes(1, 3, 10) == sum(p.layer_bytes[1:3]) + 2 * 10 * 256
    assert profile_model(tmp_path / "m", name="llama-tiny").name == "llama-tiny"
    load_model(tmp_path / "m")  # a real mlx-lm model directory


def test_tied_embedding_goes_on_the_last_stage_too(tmp_path):
    cfg = {**BASE, "model_type": "qwen2", "tie_word_embeddings": True}
    weights = build(tmp_path / "q", cfg, dtype=mx.bfloat16)
    p = profile_model(tmp_path / "q")
    assert p.tied_embeddings and p.head_bytes == 0 and "lm_head.weight" not in weights
    assert p.dtype == "bfloat16" and p.kv_bytes_per_token[0] == 2 * 2 * 16 * 2
    assert p.layer_bytes == tuple(layer_nbytes(weights, i) for i in range(4))
    assert p.weight_bytes() == sum(v.nbytes for v in weights.values())
    # the last stage holds the embedding as its head, unless it is also the first
    assert (
        p.stage_bytes(2, 4, 8)
        == sum(p.layer_bytes[2:]) + 2 * 8 * p.kv_bytes_per_token[0] + p.norm_bytes + p.embed_bytes
    )
    assert p.total_bytes(8) == p.weight_bytes() + 4 * 8 * p.kv_bytes_per_token[0]
    assert p.stage_bytes(0, 2, 8) + p.stage_bytes(2, 4, 8) == p.total_bytes(8) + p.embed_bytes


def test_quantized_weights_count_scales_and_biases(tmp_path):
    cfg = {**BASE, "model_type": "llama", "tie_word_embeddings": False}
    weights = build(tmp_path / "q4", cfg, dtype=mx.float16, quantize=True)
    assert any(k.endswith(".scales") for k in weights) and any(k.endswith(".biases") for k in weights)
    p = profile_model(tmp_path / "q4")
    assert p.layer_bytes == tuple(layer_nbytes(weights, i) for i in range(4))
    embed = [k for k in weights if k.startswith("model.embed_tokens.")]
    assert len(embed) == 3 and p.embed_bytes == sum(weights[k].nbytes for k in embed)
    assert p.head_bytes == sum(v.nbytes for k, v in weights.items() if k.startswith("lm_head."))
    assert p.weight_bytes() == sum(v.nbytes for v in weights.values())
    # the KV cache is in the activation dtype (the scales'), not in the packed uint32 of the weights
    assert p.dtype == "float16" and p.kv_bytes_per_token[0] == 2 * 2 * 16 * 2
    load_model(tmp_path / "q4")


def test_sliding_window_layers_cap_their_kv(tmp_path):
    cfg = {
        **BASE,
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "head_dim": 16,
        "sliding_window": 16,
        "sliding_window_pattern": 3,
    }
    weights = build(tmp_path / "g", cfg)
    p = profile_model(tmp_path / "g")
    assert p.sliding_window == (16, 16, None, 16, 16, None)
    assert p.layer_bytes == tuple(layer_nbytes(weights, i) for i in range(6))
    assert p.head_bytes == weights["lm_head.weight"].nbytes  # mlx-lm's gemma3_text writes its head
    per = p.kv_bytes_per_token[0]
    assert p.kv_bytes(0, 100) == 16 * per and p.kv_bytes(2, 100) == 100 * per and p.kv_bytes(0, 4) == 4 * per
    assert p.total_bytes(100) == p.weight_bytes() + (4 * 16 + 2 * 100) * per
    # mlx-lm's defaults apply when the config leaves the pattern out; layer_types win where given
    (tmp_path / "g" / "config.json").write_text(json.dumps({**cfg, "sliding_window_pattern": None}))
    assert profile_model(tmp_path / "g").sliding_window == (16,) * 5 + (None,)
    types = ["sliding_attention", "full_attention"] * 3
    (tmp_path / "g" / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "layer_types": types}))
    assert profile_model(tmp_path / "g").sliding_window == (16, None) * 3


def test_windows_the_model_does_not_apply_are_ignored(tmp_path):
    cfg = {**BASE, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": False}
    build(tmp_path / "q", cfg)
    assert profile_model(tmp_path / "q").sliding_window == (None,) * 4
    mistral = {**cfg, "model_type": "mistral", "use_sliding_window": None}
    (tmp_path / "q" / "config.json").write_text(json.dumps(mistral))
    assert profile_model(tmp_path / "q").sliding_window == (None,) * 4  # mlx-lm's llama keeps full KV


def test_multimodal_checkpoint_counts_only_the_language_model(tmp_path):
    text = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
    }
    vision = {
        "vision_tower.encoder.layers.0.mlp.fc1.weight": mx.zeros((64, 64)),
        "multi_modal_projector.mm_input_projection_weight": mx.zeros((64, 64)),
    }
    weights = build(tmp_path / "mm", {"model_type": "gemma3", "vocab_size": 100, "text_config": text}, extra=vision)
    p = profile_model(tmp_path / "mm")
    assert p.model_type == "gemma3" and p.num_layers == 2 and p.vocab_size == 100
    assert p.layer_bytes == tuple(layer_nbytes(weights, i, "language_model.model.layers.") for i in range(2))
    assert p.weight_bytes() == sum(v.nbytes for v in weights.values())  # the towers are left out
    assert p.sliding_window == (8, 8) and p.kv_bytes_per_token == (2 * 2 * 16 * 4,) * 2


def test_mixture_of_experts(tmp_path):
    cfg = {**BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    weights = build(tmp_path / "moe", cfg)
    p = profile_model(tmp_path / "moe")
    assert p.num_experts == 4 and p.layer_bytes == tuple(layer_nbytes(weights, i) for i in range(4))
    assert p.weight_bytes() == sum(v.nbytes for v in weights.values())


def test_reads_headers_only(tmp_path):
    cfg = {**BASE, "model_type": "llama", "tie_word_embeddings": False}
    build(tmp_path / "m", cfg, files=2)
    before = profile_model(tmp_path / "m")
    for f in (tmp_path / "m").glob("*.safetensors"):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        f.write_bytes(raw[: 8 + n] + b"\xff" * 16)  # tensor data gone (and garbage): only headers remain
    assert profile_model(tmp_path / "m") == before
    with pytest.raises(RuntimeError):
        load_model(tmp_path / "m")  # the files really are unloadable now


def test_bad_headers_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "llama"}))
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="not a safetensors file"):
        profile_model(tmp_path)
    bad.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(ValueError, match="implausible"):
        profile_model(tmp_path)
    header = json.dumps({"model.layers.0.w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="dtype and shape say 64"):
        profile_model(tmp_path)
    bad.unlink()
    with pytest.raises(ValueError, match="no model"):
        profile_model(tmp_path)


def test_header_reader_skips_metadata(tmp_path):
    mx.save_safetensors(
        str(tmp_path / "x.safetensors"), {"a": mx.zeros((2, 3), dtype=mx.float16)}, metadata={"format": "mlx"}
    )
    assert read_safetensors_header(tmp_path / "x.safetensors") == {
        "a": {"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 12]}
    }


def test_profile_round_trips_through_json(tmp_path):
    build(
        tmp_path / "g",
        {**BASE, "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2},
    )
    p = profile_model(tmp_path / "g")
    again = ModelProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p and isinstance(again.layer_bytes, tuple) and again.sliding_window == (8, None, 8, None)
    assert ModelProfile.from_dict({**p.to_dict(), "from_a_newer_peer": 1}) == p
    with pytest.raises(ValueError, match="lacks layer_bytes"):
        ModelProfile.from_dict({k: v for k, v in p.to_dict().items() if k != "layer_bytes"})
    with pytest.raises(ValueError, match="4 entries"):
        ModelProfile.from_dict({**p.to_dict(), "layer_bytes": [1, 2]})


LFM2 = {
    "model_type": "lfm2",
    "vocab_size": 100,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "norm_eps": 1e-5,
    "conv_bias": False,
    "conv_L_cache": 3,
    "block_dim": 64,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False,
    "intermediate_size": 128,
    "layer_types": ["conv", "full_attention", "conv", "full_attention"],
}


@pytest.mark.parametrize(
    "config",
    [
        {**BASE, "model_type": "qwen2", "num_key_value_heads": 1},
        {
            **BASE,
            "model_type": "llama",
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        {
            **BASE,
            "model_type": "gemma3_text",
            "head_dim": 8,
            "sliding_window": 8,
            "sliding_window_pattern": 3,
            "num_hidden_layers": 6,
        },
        LFM2,  # hybrid: its convolution layers keep a fixed-size state, no KV
    ],
    ids=["qwen2", "llama-swa", "gemma3", "lfm2"],
)
def test_kv_bytes_match_mlx_lm_caches(tmp_path, config):
    """After decoding T tokens one by one, each layer's mlx-lm cache holds what the profile says."""
    build(tmp_path / "m", config)
    p = profile_model(tmp_path / "m")
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    cache = make_prompt_cache(model)  # the model's own make_cache(), else a KVCache per layer
    steps = 20
    model(mx.array([[1, 2, 3]]), cache=cache)
    for t in range(3, steps):
        model(mx.array([[t]]), cache=cache)
    held = []
    for c in cache:
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if not isinstance(keys, mx.array):
            held.append(0)  # not a KV cache (e.g. a convolution state)
            continue
        n = min(c.offset, keys.shape[2])
        held.append(keys[..., :n, :].nbytes + values[..., :n, :].nbytes)
    assert held == [p.kv_bytes(i, steps) for i in range(p.num_layers)]
    assert any(held)


def _mtp_head(model_dir: Path, *, bits: int = 0, own_embed: bool = False):
    """A random MTP head for the model in ``model_dir``, quantized to ``bits`` (0: as built)."""
    from meshnode.model.mtp import MTPHead, shared_from

    model, _ = load_model(model_dir)
    head = MTPHead(model.args, shared_from(model), own_embed=own_embed)
    if bits:
        nn.quantize(head, group_size=32, bits=bits)
    mx.eval(head.parameters())
    return head


def test_a_qwen_style_mtp_head_is_counted_on_the_last_stage_at_its_stored_precision(tmp_path):
    from meshnode.model.mtp_load import save_qwen

    cfg = {**BASE, "model_type": "llama", "tie_word_embeddings": False}
    build(tmp_path / "m", cfg)
    plain = profile_model(tmp_path / "m")
    head = _mtp_head(tmp_path / "m", bits=4)
    own = sum(head.own_bytes().values())
    assert own < sum(_mtp_head(tmp_path / "m").own_bytes().values())  # 4-bit, counted as stored
    save_qwen(head, tmp_path / "m" / "model-mtp.safetensors")
    p = profile_model(tmp_path / "m")
    # mtp.layers.0.* is no backbone layer, mtp.norm no backbone norm
    assert (p.layer_bytes, p.norm_bytes, p.embed_bytes) == (plain.layer_bytes, plain.norm_bytes, plain.embed_bytes)
    assert p.mtp_bytes == own and p.mtp_embed_bytes == p.embed_bytes == 100 * 64 * 4
    # the head and, where the last stage lacks the embedding, its copy go on the last stage only
    assert p.stage_bytes(2, 4, 10) == plain.stage_bytes(2, 4, 10) + own + p.embed_bytes
    assert p.stage_bytes(0, 4, 10) == plain.total_bytes(10) + own
    assert p.stage_bytes(0, 2, 10) == plain.stage_bytes(0, 2, 10)
    assert p.without_mtp() == plain and plain.without_mtp() == plain
    assert ModelProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


@pytest.mark.parametrize("tied,own_embed", [(False, True), (True, False)])
def test_a_deepseek_style_mtp_layer_is_counted_on_the_last_stage(tmp_path, tied, own_embed):
    cfg = {**BASE, "model_type": "llama", "tie_word_embeddings": tied, "num_nextn_predict_layers": 1}
    build(tmp_path / "d", cfg)
    plain = profile_model(tmp_path / "d")
    head = _mtp_head(tmp_path / "d", own_embed=own_embed)
    names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
    names["embed"] = "embed_tokens"
    extra = {}
    for name, a in tree_flatten(head.parameters()):
        module, _, rest = name.partition(".")
        extra["model.layers.4." + (rest if module == "block" else f"{names[module]}.{rest}")] = a
    mx.save_safetensors(str(tmp_path / "d" / "model-mtp.safetensors"), extra)
    p = profile_model(tmp_path / "d")
    own = sum(head.own_bytes().values())
    assert p.num_layers == 4 and p.layer_bytes == plain.layer_bytes and p.mtp_bytes == own
    # a head with its own embedding needs no copy; a tied model's last stage holds the embedding already
    assert p.mtp_embed_bytes == (0 if own_embed else p.embed_bytes)
    assert p.stage_bytes(2, 4, 10) == plain.stage_bytes(2, 4, 10) + own
