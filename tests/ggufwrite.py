"""GGUF files written from mlx-lm model folders the way llama.cpp's converter writes them, for the
architectures whose real files the tests cannot download: the gguf package's tensor-name map,
llama's q/k rows reordered for its interleaved rope, Gemma's norms stored as 1 + weight, experts
stacked, the tokenizer as gpt2-style vocabulary and merges, and the hyperparameters under each
architecture's keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np

from meshnode.weights.gguf_tensors import hf_spellings

# mlx-lm model_type -> GGUF architecture
ARCHS = {
    "llama": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of a q/k projection's rows for its interleaved rope."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(
    folder: Path,
    out: Path,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    kinds: dict[str, gguf.GGMLQuantizationType] | None = None,
    file_type: gguf.LlamaFileType | None = None,
    mtp: Any = None,
) -> Path:
    """``folder`` (an unquantized float32 mlx-lm model) as a GGUF file at ``out``; 2-D weights whose
    width allows it stored as ``qtype``, or as ``kinds`` names them by GGUF tensor (``token_embd``);
    ``file_type``: the general.file_type llama.cpp writes; ``mtp``: an MTP head (llama only) written
    as llama.cpp writes one, an extra block counted in block_count with its ``nextn.*`` tensors."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    cfg = json.loads((folder / "config.json").read_text())
    arch = ARCHS[cfg["model_type"]]
    layers = cfg["num_hidden_layers"]
    weights = {}
    for f in folder.glob("*.safetensors"):
        weights.update(mx.load(str(f)))
    model_class, args_class = _get_classes(cfg)
    names = [k for k, _ in tree_flatten(model_class(args_class.from_dict(cfg)).parameters())]
    table = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    w = gguf.GGUFWriter(str(out), arch)
    _metadata(w, cfg | {"num_hidden_layers": layers + (1 if mtp is not None else 0)}, arch)
    if mtp is not None:
        w.add_nextn_predict_layers(1)
    if file_type is not None:
        w.add_file_type(file_type.value)
    _tokenizer(w, folder, cfg)
    for name in names:
        if name not in weights:
            continue
        module, _, suffix = name.rpartition(".")
        target = next(filter(None, map(table.get_name, hf_spellings(module))), None)
        assert target is not None, f"{arch}: no GGUF name for {name}"
        data = np.array(weights[name].astype(mx.float32))
        if arch == "llama" and target.endswith(("attn_q", "attn_k")):
            heads = cfg["num_attention_heads"] if target.endswith("attn_q") else cfg["num_key_value_heads"]
            data = permute(data, heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1
        kind = (
            (kinds or {}).get(target, qtype)
            if data.ndim >= 2 and data.shape[-1] % 32 == 0 and suffix == "weight"
            else gguf.GGMLQuantizationType.F32
        )
        if kind != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, kind)
        w.add_tensor(f"{target}.{suffix}", data, raw_dtype=kind)
    if mtp is not None:
        add_nextn(w, mtp, layers, cfg, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def add_nextn(w: gguf.GGUFWriter, head: Any, block: int, cfg: dict, qtype: gguf.GGMLQuantizationType) -> None:
    """A llama MTP head's tensors as block ``block``'s usual ones and its ``nextn.*``."""
    from mlx.utils import tree_flatten

    from meshnode.weights.mtp_layout import GGUF_BLOCK, NEXTN

    names = {f"block.{v}": f"blk.{block}.{k}" for k, v in GGUF_BLOCK.items()}
    names |= {v: f"blk.{block}.nextn.{k}" for k, v in NEXTN.items()}
    for name, a in tree_flatten(head.parameters()):
        module, _, part = name.rpartition(".")
        target = names[module]
        data = np.array(a.astype(mx.float32))
        if target.endswith(("attn_q", "attn_k")):
            data = permute(data, cfg["num_attention_heads" if target.endswith("q") else "num_key_value_heads"])
        kind = qtype if data.ndim == 2 and data.shape[-1] % 32 == 0 else gguf.GGMLQuantizationType.F32
        if kind != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, kind)
        w.add_tensor(f"{target}.{part}", data, raw_dtype=kind)


def _metadata(w: gguf.GGUFWriter, cfg: dict, arch: str) -> None:
    heads = cfg["num_attention_heads"]
    w.add_name(f"tiny {arch}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings") or 2048)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    if cfg["model_type"] == "mixtral":
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg["model_type"] == "qwen3_moe":
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))


def _tokenizer(w: gguf.GGUFWriter, folder: Path, cfg: dict) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    by_id = {**{i: t for t, i in vocab.items()}, **{i: t for t, i in added.items()}}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(cfg["vocab_size"])]
    kinds = [gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(merges)
    for key, setter in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        value = cfg.get(key)
        if isinstance(value, list):
            value = value[0]
        if value is not None:
            setter(int(value))
    config = (
        json.loads((folder / "tokenizer_config.json").read_text())
        if (folder / "tokenizer_config.json").exists()
        else {}
    )
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)
