"""Where a model's multi-token-prediction (MTP) head lives in its files, and what it costs to hold.

Three layouts name the same head: Qwen3-Next / Qwen3.5 safetensors (``mtp.*``), DeepSeek-V3 / GLM-4.5
extra layers (``model.layers.{N}.*`` past ``num_hidden_layers``), and GGUF (``blk.{N}.nextn.*`` beside
the block's usual tensors). Each is read here as the names of ``meshnode.model.mtp.MTPHead``:
``enorm``, ``hnorm``, ``eh_proj``, ``block.*`` (the family's decoder block), ``norm``, and the head's
own ``embed`` and ``head`` where the file carries copies. Pure: the planner may call it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

QWEN, DEEPSEEK, GGUF = "qwen", "deepseek", "gguf"

# Qwen3.5 ``mtp.`` names -> the head's; the decoder block is ``mtp.layers.0``.
_QWEN = {
    "pre_fc_norm_embedding": "enorm",
    "pre_fc_norm_hidden": "hnorm",
    "fc": "eh_proj",
    "norm": "norm",
    "embed_tokens": "embed",
    "lm_head": "head",
}
# DeepSeek-V3 per-layer names -> the head's; everything else in the layer is the decoder block.
_DEEPSEEK = {
    "enorm": "enorm",
    "hnorm": "hnorm",
    "eh_proj": "eh_proj",
    "shared_head.norm": "norm",
    "shared_head.head": "head",
    "embed_tokens": "embed",
}
# GGUF ``blk.N.nextn.`` names -> the head's.
NEXTN = {
    "eh_proj": "eh_proj",
    "enorm": "enorm",
    "hnorm": "hnorm",
    "shared_head_norm": "norm",
    "shared_head_head": "head",
    "embed_tokens": "embed",
}
# GGUF block tensors of llama-like families -> mlx-lm decoder block names.
GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Families whose checkpoints store RMSNorm weights as w - 1 (the model computes x * (1 + w)).
ZERO_CENTERED_NORMS = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}
# The parts of a quantized weight beside it (mlx-lm's affine quantization).
_PARTS = ("weight", "scales", "biases", "bias")


def qwen_name(name: str, layer: int = 0) -> str | None:
    """The head's name for a Qwen3.5 checkpoint tensor (None: not the MTP layer ``layer``)."""
    rest = name.removeprefix("model.")
    if not rest.startswith("mtp."):
        return None
    rest = rest[len("mtp.") :]
    prefix = f"layers.{layer}."
    if rest.startswith(prefix):
        return "block." + rest[len(prefix) :]
    if rest.startswith("layers."):
        return None
    module, _, part = rest.rpartition(".")
    return f"{_QWEN[module]}.{part}" if module in _QWEN and part in _PARTS else None


def deepseek_name(name: str, num_hidden_layers: int, layer: int = 0) -> str | None:
    """The head's name for a DeepSeek-V3 checkpoint tensor (None: not MTP layer ``layer``)."""
    index = num_hidden_layers + layer
    # multimodal checkpoints keep the text model under model.language_model
    prefix = next(
        (p for p in (f"model.layers.{index}.", f"model.language_model.layers.{index}.") if name.startswith(p)), None
    )
    if prefix is None:
        return None
    rest = name[len(prefix) :]
    module, _, part = rest.rpartition(".")
    if module in _DEEPSEEK:
        return f"{_DEEPSEEK[module]}.{part}"
    return "block." + rest


def gguf_name(name: str, block: int) -> str | None:
    """The head's name for a GGUF tensor of block ``block`` (None: another block's, or unknown)."""
    m = re.fullmatch(rf"blk\.{block}\.(nextn\.)?(\w+)\.(weight|bias)", name)
    if m is None:
        return None
    nextn, module, part = m.groups()
    if nextn:
        return f"{NEXTN[module]}.{part}" if module in NEXTN else None
    return f"block.{GGUF_BLOCK[module]}.{part}" if module in GGUF_BLOCK else None


def gguf_mtp_block(block_count: int, nextn_layers: int, layer: int = 0) -> int:
    """The GGUF block index of MTP layer ``layer``: llama.cpp counts MTP layers in block_count."""
    if not 0 <= layer < nextn_layers:
        raise ValueError(f"MTP layer {layer}: the file has {nextn_layers}")
    return block_count - nextn_layers + layer


def detect(names: Iterable[str], config: Mapping[str, object]) -> str | None:
    """The layout a checkpoint's tensor names and config.json hold an MTP head in (None: none)."""
    names = list(names)
    if any(n.removeprefix("model.").startswith("mtp.") for n in names):
        return QWEN
    if any(".nextn." in n for n in names):
        return GGUF
    config = text_config(config)
    extra = int(str(config.get("num_nextn_predict_layers") or 0))
    if extra and any(deepseek_name(n, int(str(config.get("num_hidden_layers") or 0))) for n in names):
        return DEEPSEEK
    return None


def is_qwen_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a Qwen3.5-style ``mtp.*`` head (no backbone layer)."""
    return name.removeprefix("model.").startswith("mtp.")


def head_tensor_bytes(tensor_bytes: Mapping[str, int], config: Mapping[str, object]) -> dict[str, int]:
    """MTP layer 0's tensors (the head's names -> bytes, at their stored precision) in a checkpoint's
    tensors (names -> bytes) and config.json, or what a GGUF conversion recorded of the file's
    nextn block; {} where the model has no head."""
    gguf = config.get("gguf")
    recorded = gguf.get("mtp") if isinstance(gguf, Mapping) else None
    if isinstance(recorded, Mapping):
        sizes = recorded.get("bytes")
        return {str(k): int(str(v)) for k, v in sizes.items()} if isinstance(sizes, Mapping) else {}
    kind = detect(tensor_bytes, config)
    if kind == QWEN:
        named = ((qwen_name(k), b) for k, b in tensor_bytes.items())
    elif kind == DEEPSEEK:
        n = int(str(text_config(config).get("num_hidden_layers") or 0))
        named = ((deepseek_name(k, n), b) for k, b in tensor_bytes.items())
    else:
        return {}
    return {name: b for name, b in named if name is not None}


def text_config(config: Mapping[str, object]) -> Mapping[str, object]:
    """The text model's part of a config.json (multimodal checkpoints nest it as ``text_config``)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


@dataclass(frozen=True)
class MTPFootprint:
    """The memory an MTP head needs on the node that drafts: its own tensors, and a copy of the
    token embedding and the LM head where it cannot share the backbone's (another node holds them)."""

    head_bytes: int
    embedding_bytes: int = 0
    lm_head_bytes: int = 0

    @property
    def total(self) -> int:
        return self.head_bytes + self.embedding_bytes + self.lm_head_bytes


def mtp_footprint(
    tensor_bytes: Mapping[str, int],
    *,
    embedding_bytes: int,
    lm_head_bytes: int = 0,
    shares_embedding: bool,
    shares_lm_head: bool,
) -> MTPFootprint:
    """The memory of a head whose tensors (the head's names -> bytes) are ``tensor_bytes``; the
    backbone's embedding (``embedding_bytes``) and LM head (``lm_head_bytes``: 0 when tied to the
    embedding) are counted once more each unless shared, or unless the head carries its own."""
    own = sum(tensor_bytes.values())
    has_embed = any(n.startswith("embed.") for n in tensor_bytes)
    has_head = any(n.startswith("head.") for n in tensor_bytes)
    embed = 0 if shares_embedding or has_embed else embedding_bytes
    head = 0 if shares_lm_head or has_head else lm_head_bytes
    return MTPFootprint(own, embed, head)
