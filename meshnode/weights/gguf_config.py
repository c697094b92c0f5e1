"""A GGUF file's metadata as an mlx-lm config.json and tokenizer files (built by transformers' own
GGUF converter, with the file's chat template)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType

from meshnode.weights.gguf_tensors import UnsupportedGGUF

# GGUF architecture -> mlx-lm model_type (llama files with experts are mixtral: see family()).
FAMILIES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
}
# Families whose norms llama.cpp stores as 1 + weight (the model adds the 1 itself).
NORM_PLUS_ONE = {"gemma2", "gemma3"}


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata field as a Python value (strings, numbers, lists)."""
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        kind = field.types[0] if field.types else None
        if kind == GGUFValueType.ARRAY:
            inner = field.types[-1]
            if inner == GGUFValueType.STRING:
                out[name] = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
            else:
                out[name] = [field.parts[i].tolist()[0] for i in field.data]
        elif kind == GGUFValueType.STRING:
            out[name] = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
        else:
            out[name] = field.parts[field.data[0]].tolist()[0]
    return out


def family(meta: dict[str, Any]) -> tuple[str, str]:
    """(GGUF architecture, mlx-lm model_type), or UnsupportedGGUF naming the architecture."""
    arch = str(meta.get("general.architecture", ""))
    if arch not in FAMILIES:
        raise UnsupportedGGUF(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    if arch == "llama" and int(meta.get("llama.expert_count", 0) or 0) > 0:
        return arch, "mixtral"
    return arch, FAMILIES[arch]


def model_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """config.json for the mlx-lm family of this file."""
    arch, model_type = family(meta)

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedGGUF(f"{arch}: a KV head count that varies by layer is not supported")
    hidden = int(get("embedding_length"))
    vocab = len(meta.get("tokenizer.ggml.tokens") or []) or int(get("vocab_size"))
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        # llama.cpp counts the MTP (nextn) layers as blocks; the backbone ends before them
        "num_hidden_layers": int(get("block_count")) - int(get("nextn_predict_layers", 0) or 0),
        "intermediate_size": int(get("feed_forward_length", 0) or 0),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": _float32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": vocab,
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    theta = get("rope.freq_base")
    if theta is not None:
        cfg["rope_theta"] = float(theta)
    scaling = _rope_scaling(get)
    if scaling:
        cfg["rope_scaling"] = scaling
    if model_type in ("qwen3_moe", "mixtral"):
        experts, used = int(get("expert_count")), int(get("expert_used_count"))
        if model_type == "mixtral":
            cfg.update(num_local_experts=experts, num_experts_per_tok=used)
        else:
            cfg.update(
                num_experts=experts,
                num_experts_per_tok=used,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                moe_intermediate_size=int(get("expert_feed_forward_length")),
                norm_topk_prob=True,
            )
    if model_type == "gemma2":
        # Gemma 2 27B (46 layers) scales its queries by hidden / heads, the others by the head's width
        scalar = hidden // heads if cfg["num_hidden_layers"] == 46 else cfg["head_dim"]
        cfg.update(
            attn_logit_softcapping=float(get("attn_logit_softcapping", 50.0)),
            final_logit_softcapping=float(get("final_logit_softcapping", 30.0)),
            query_pre_attn_scalar=float(scalar),
        )
        window = get("attention.sliding_window")
        if window:
            cfg["sliding_window"] = int(window)
    if model_type == "gemma3_text":
        cfg.update(
            query_pre_attn_scalar=float(cfg["head_dim"]),
            rope_local_base_freq=float(get("rope.freq_base_swa", 10000.0)),
            sliding_window=int(get("attention.sliding_window", 512)),
            sliding_window_pattern=6,
        )
    if model_type == "phi3":
        rot = get("rope.dimension_count")
        if rot:
            cfg["partial_rotary_factor"] = int(rot) / cfg["head_dim"]
        cfg["original_max_position_embeddings"] = int(
            get("rope.scaling.original_context_length", cfg["max_position_embeddings"])
        )
    return cfg


def _float32(value: float) -> float:
    """A float32 from the file as the shortest decimal that is that float32 (1e-05, not 9.99...e-06)."""
    return float(f"{float(value):.7g}")


def _rope_scaling(get: Callable[[str], Any]) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        return {
            "type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        }
    raise UnsupportedGGUF(f"rope scaling {kind!r} is not supported")


def eos_ids(meta: dict[str, Any]) -> list[int]:
    ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    return sorted({int(i) for i in ids if i is not None})


def save_tokenizer(meta: dict[str, Any], out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and friends into ``out``."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        add_gguf_special_tokens,
        select_tokenizer_builder,
        set_split_regex,
    )

    arch = str(meta.get("general.architecture"))
    wanted = GGUF_TOKENIZER_MAPPING["tokenizer"]
    spec = {name: meta[f"tokenizer.{key}"] for key, name in wanted.items() if f"tokenizer.{key}" in meta}
    if "tokens" not in spec:
        raise UnsupportedGGUF("the GGUF file carries no tokenizer vocabulary")
    try:
        tokenizer = select_tokenizer_builder(arch, spec.get("tokenizer_type"))(spec)
    except ValueError as exc:
        raise UnsupportedGGUF(str(exc)) from exc
    tokenizer = add_gguf_special_tokens(tokenizer, spec)
    tokenizer = set_split_regex(tokenizer, spec)
    if spec.get("pre_tokenizer_type") == "smollm":  # digits one by one, then GPT-2's byte-level split
        from tokenizers import pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    tokens = spec["tokens"]
    for attr, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        index = meta.get(f"tokenizer.ggml.{key}")
        if index is not None and 0 <= int(index) < len(tokens):
            setattr(tokenizer, attr, tokens[int(index)])
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    if "tokenizer.ggml.add_bos_token" in meta:
        tokenizer.add_bos_token = bool(meta["tokenizer.ggml.add_bos_token"])
    tokenizer.save_pretrained(str(out))
