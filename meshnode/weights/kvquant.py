"""A quantized KV cache (``kv_bits``): mlx-lm's ``QuantizedKVCache``, its cost and the models that can
use it. Only plain ``KVCache`` layers are quantized. Pure."""

from __future__ import annotations

from typing import Any

from meshnode.weights.splits import config_value, text_config

KV_GROUP_SIZE = 64  # mlx-lm's default kv_group_size
KV_BITS = (4, 8)  # besides 0 (off)

# Families that cannot use QuantizedKVCache: attention sinks (no quantized kernel), or attention of
# their own that reads the cache as plain arrays.
_SINKS = frozenset({"gpt_oss", "mimo_v2_flash"})
_OWN_ATTENTION = frozenset({"gemma2", "olmo", "plamo2"})


def kv_quant_problem(config: dict[str, Any], bits: int = KV_BITS[0]) -> str:
    """Why this model's KV cache cannot be quantized to ``bits`` ("" when it can, or bits is 0)."""
    if not bits:
        return ""
    if bits not in KV_BITS:
        return f"kv_bits must be 0, {' or '.join(map(str, KV_BITS))}, not {bits}"
    cfg = text_config(config)
    family = str(config.get("model_type") or cfg.get("model_type") or "")
    if family in _SINKS:
        return f"{family}: its attention sinks have no quantized attention kernel in mlx-lm"
    if family in _OWN_ATTENTION:
        return f"{family}: its attention does not run on mlx-lm's quantized KV cache"
    if cfg.get("kv_lora_rank"):
        return f"{family}: its compressed (MLA) KV cache is not a plain KVCache"
    heads = config_value(cfg, "num_attention_heads", "n_head")
    hidden = config_value(cfg, "hidden_size", "n_embd", "d_model", "dim")
    head_dim = config_value(cfg, "head_dim", default=int(hidden) // int(heads) if heads and hidden else 0)
    dims = {int(head_dim or 0), int(cfg.get("v_head_dim") or head_dim or 0)}
    if any(d <= 0 or d % KV_GROUP_SIZE for d in dims):
        return (
            f"{family}: its head dimension ({', '.join(map(str, sorted(dims)))}) is not a multiple of the "
            f"KV quantization group size {KV_GROUP_SIZE}"
        )
    return ""


def quantized_kv_bytes(plain: int, item: int, bits: int) -> int:
    """Bytes per token of a layer's KV at ``bits`` (``plain``: unquantized bytes)."""
    if not bits or plain <= 0:
        return plain
    elements = plain // item
    groups = -(-elements // KV_GROUP_SIZE)
    return elements * bits // 8 + groups * 2 * item


def describe_kv_bits(bits: int) -> str:
    return f"a {bits}-bit KV cache (groups of {KV_GROUP_SIZE})" if bits else ""
