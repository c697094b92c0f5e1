"""A model's memory profile, read from config.json and the safetensors headers only.

The planner needs to know what each layer costs: its weight bytes (summed from the tensor
entries of the safetensors headers, so quantized models count exactly), the embedding, final
norm and head, and the KV cache per token per layer (capped by a sliding window where a layer
has one). No tensor data is read.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class ModelProfile:
    name: str
    model_type: str
    num_layers: int
    layer_bytes: tuple[int, ...]
    embed_bytes: int
    head_bytes: int  # 0 when tied: the last stage then holds the embedding too
    norm_bytes: int  # final norm and any other tensor outside the layers
    tied_embeddings: bool
    kv_bytes_per_token: tuple[int, ...]  # per layer
    sliding_window: tuple[int | None, ...]  # per layer; None = full attention
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    vocab_size: int
    dtype: str

    def kv_bytes(self, layer: int, context: int) -> int:
        window = self.sliding_window[layer]
        return self.kv_bytes_per_token[layer] * (min(context, window) if window else context)

    def stage_bytes(self, start: int, end: int, max_context: int) -> int:
        """Memory a stage holding layers [start, end) needs: weights + KV for max_context."""
        total = sum(self.layer_bytes[start:end]) + sum(self.kv_bytes(i, max_context) for i in range(start, end))
        if start == 0:
            total += self.embed_bytes
        if end == self.num_layers:
            total += self.norm_bytes + self.head_bytes
            if self.tied_embeddings and start != 0:
                total += self.embed_bytes
        return total

    def total_bytes(self, max_context: int) -> int:
        return self.stage_bytes(0, self.num_layers, max_context)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelProfile":
        d = dict(d)
        for key in ("layer_bytes", "kv_bytes_per_token", "sliding_window"):
            d[key] = tuple(d[key])
        return cls(**d)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise ValueError(f"{path}: header of {n} bytes is implausible")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def tensor_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes of every tensor in the model's safetensors files, by name."""
    out: dict[str, int] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, info in read_safetensors_header(file).items():
            start, end = info["data_offsets"]
            out[name] = int(end) - int(start)
    return out


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, **config.get("text_config", {})}


def _sliding(cfg: dict[str, Any], n: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if not window:
        return (None,) * n
    if cfg.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern")
    if pattern:  # gemma3: every pattern-th layer is global
        return tuple(None if i % pattern == pattern - 1 else window for i in range(n))
    return (None,) * n  # a window the model does not use per layer (e.g. mistral's): full KV


def profile_model(model_dir: Path, name: str | None = None) -> ModelProfile:
    model_dir = Path(model_dir)
    cfg = _text_config(json.loads((model_dir / "config.json").read_text()))
    n = int(cfg["num_hidden_layers"])
    sizes = tensor_bytes(model_dir)
    if not sizes:
        raise ValueError(f"{model_dir}: no safetensors weights")
    layer_bytes = [0] * n
    embed = head = other = 0
    for key, size in sizes.items():
        m = _LAYER.search(key)
        if m and int(m.group(1)) < n:
            layer_bytes[int(m.group(1))] += size
        elif "embed_tokens" in key or key.endswith("wte.weight"):
            embed += size
        elif key.startswith("lm_head") or ".lm_head." in key:
            head += size
        else:
            other += size
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
    # KV cache entries are kept in the activation dtype (float16/bfloat16 for quantized models).
    kv_item = 4 if dtype == "float32" else 2
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    return ModelProfile(
        name=name or model_dir.name,
        model_type=str(cfg.get("model_type", "")),
        num_layers=n,
        layer_bytes=tuple(layer_bytes),
        embed_bytes=embed,
        head_bytes=head,
        norm_bytes=other,
        tied_embeddings=head == 0,
        kv_bytes_per_token=(2 * kv_heads * head_dim * kv_item,) * n,
        sliding_window=_sliding(cfg, n),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        num_experts=experts,
        vocab_size=int(cfg["vocab_size"]),
        dtype=dtype,
    )
