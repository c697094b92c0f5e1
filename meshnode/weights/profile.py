"""A model's memory profile (per-layer weights and KV, embedding, head), read from config.json and
the safetensors headers only."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from meshnode.weights import mtp_layout
from meshnode.weights.kvquant import kv_quant_problem, quantized_kv_bytes
from meshnode.weights.manifest import loaded_weights, manifest_from_dict, read_marker
from meshnode.weights.splits import config_value, split_boundaries, split_support, text_config
from meshnode.weights.weightfiles import (
    DTYPE_BYTES,
    DTYPE_CODES,
    EMBED_KEY,
    HEAD_KEY,
    ITEMSIZE,
    LAYER_KEY,
    SKIP_KEY,
    read_safetensors_header,
    weight_files,
)

__all__ = ["ModelProfile", "activation_dtype", "hidden_size", "profile_model", "tensor_bytes"]

# Safetensors codes -> names of the float dtypes an activation can take.
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items() if "float" in name}


@dataclass(frozen=True)
class ModelProfile:
    """A model's shape and byte sizes: what the planner places."""

    name: str
    model_type: str
    num_layers: int
    layer_bytes: tuple[int, ...]  # weight bytes of each transformer block
    embed_bytes: int  # on the first stage
    head_bytes: int  # 0 when tied: the last stage then holds the embedding too
    norm_bytes: int  # final norm and other tensors outside the blocks: on the last stage
    tied_embeddings: bool
    kv_bytes_per_token: tuple[int, ...]  # per layer, keys and values together
    sliding_window: tuple[int | None, ...]  # per layer; None: the KV grows with the context
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int  # 0 for a dense model
    vocab_size: int
    dtype: str  # activation (and KV cache) dtype, e.g. "bfloat16"
    # Requests at once that every KV figure counts.
    kv_requests: int = 1
    # Why this model cannot be split into pipeline stages ("" when it can).
    split_problem: str = ""
    moe_intermediate_size: int = 0  # each expert's MLP width; 0 for a dense model
    quant_group_size: int = 0  # 0 when not quantized
    trained_context: int = 0  # the trained context (rope scaling included); 0: unknown
    # Bits every KV figure counts (0: unquantized), and why the KV cannot be quantized.
    kv_bits: int = 0
    kv_quant_problem: str = ""
    # What a conversion did to the weights (GGUF), "" when nothing.
    weights_note: str = ""
    # The weights' quantization as Ollama names it (Q4_1, Q4_K_M, Q4), "" when they are floats.
    quantization: str = ""
    # The MTP head's own tensors at their stored precision, on the last stage (0: no head, or
    # speculation will not draft with it), and the embedding copy it needs where the last stage
    # holds no embedding (an untied model split over stages).
    mtp_bytes: int = 0
    mtp_embed_bytes: int = 0

    def __post_init__(self) -> None:
        n = self.num_layers
        if not (len(self.layer_bytes) == len(self.kv_bytes_per_token) == len(self.sliding_window) == n):
            raise ValueError(f"profile of {self.name!r}: per-layer tuples must have {n} entries")

    def for_requests(self, requests: int) -> ModelProfile:
        """This profile with every KV figure counting ``requests`` requests at once."""
        if requests < 1:
            raise ValueError(f"requests must be at least 1, not {requests}")
        return replace(self, kv_requests=int(requests))

    def for_kv_bits(self, bits: int) -> ModelProfile:
        """This profile with plain growing KV caches counted quantized to ``bits`` (0: unquantized)."""
        if bits and self.kv_quant_problem:
            bits = 0
        return replace(self, kv_bits=int(bits))

    def without_mtp(self) -> ModelProfile:
        """This profile with no MTP head counted (speculation will not draft with it)."""
        return replace(self, mtp_bytes=0, mtp_embed_bytes=0)

    def kv_token_bytes(self, layer: int) -> int:
        """KV bytes per token of one layer as its cache stores them (0 for a recurrent layer)."""
        plain = self.kv_bytes_per_token[layer]
        if self.kv_bits and self.sliding_window[layer] is None:
            return quantized_kv_bytes(plain, ITEMSIZE.get(self.dtype, 2), self.kv_bits)
        return plain

    def kv_bytes(self, layer: int, context: int, requests: int | None = None) -> int:
        """KV bytes of one layer holding ``context`` tokens for each of ``requests`` requests."""
        window = self.sliding_window[layer]
        tokens = min(context, window) if window else context
        return self.kv_token_bytes(layer) * max(tokens, 0) * (self.kv_requests if requests is None else requests)

    def layers_bytes(self, start: int, end: int, max_context: int, requests: int | None = None) -> int:
        """Weights plus KV of layers [start, end), without embedding, norm or head."""
        return sum(self.layer_bytes[start:end]) + sum(
            self.kv_bytes(i, max_context, requests) for i in range(start, end)
        )

    def stage_bytes(self, start: int, end: int, max_context: int, requests: int | None = None) -> int:
        """Weights and KV of layers [start, end), plus embedding on the first stage and head on the last."""
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(f"bad layer range [{start}, {end}) for {self.num_layers} layers")
        total = self.layers_bytes(start, end, max_context, requests)
        if start == 0:
            total += self.embed_bytes
        if end == self.num_layers:
            total += self.norm_bytes + self.head_bytes + self.mtp_bytes
            if start != 0:
                total += self.embed_bytes if self.tied_embeddings else self.mtp_embed_bytes
        return total

    def total_bytes(self, max_context: int, requests: int | None = None) -> int:
        """Memory the whole model needs on one machine."""
        return self.stage_bytes(0, self.num_layers, max_context, requests)

    def weight_bytes(self) -> int:
        """Bytes of all tensors counted."""
        return sum(self.layer_bytes) + self.embed_bytes + self.head_bytes + self.norm_bytes + self.mtp_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("layer_bytes", "kv_bytes_per_token", "sliding_window"):
            d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelProfile:
        """Inverse of :meth:`to_dict`; unknown keys (a newer peer's) are ignored."""
        known = {f.name for f in fields(cls)}
        optional = {
            "kv_requests",
            "split_problem",
            "moe_intermediate_size",
            "quant_group_size",
            "trained_context",
            "kv_bits",
            "kv_quant_problem",
            "weights_note",
            "quantization",
            "mtp_bytes",
            "mtp_embed_bytes",
        }  # newer fields
        missing = known - set(d) - optional
        if missing:
            raise ValueError(f"model profile lacks {', '.join(sorted(missing))}")
        kw: dict[str, Any] = {k: d[k] for k in known if k in d}
        for key in ("layer_bytes", "kv_bytes_per_token"):
            kw[key] = tuple(int(x) for x in kw[key])
        kw["sliding_window"] = tuple(None if w is None else int(w) for w in kw["sliding_window"])
        for key in ("split_problem", "kv_quant_problem", "weights_note", "quantization"):
            if key in kw:
                kw[key] = str(kw[key] or "")
        for key in (
            "num_layers",
            "embed_bytes",
            "head_bytes",
            "norm_bytes",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "num_experts",
            "vocab_size",
            "kv_requests",
            "moe_intermediate_size",
            "quant_group_size",
            "trained_context",
            "kv_bits",
            "mtp_bytes",
            "mtp_embed_bytes",
        ):
            if key in kw:
                kw[key] = int(kw[key])
        for key in ("name", "model_type", "dtype"):
            kw[key] = str(kw[key])
        kw["tied_embeddings"] = bool(kw["tied_embeddings"])
        return cls(**kw)


def _entry_bytes(path: Path, name: str, info: dict[str, Any]) -> int:
    start, end = (int(x) for x in info["data_offsets"])
    size = end - start
    if size < 0:
        raise ValueError(f"{path}: tensor {name} has negative size")
    item = DTYPE_BYTES.get(str(info.get("dtype")))
    if item is not None and "shape" in info:
        expected = item
        for dim in info["shape"]:
            expected *= int(dim)
        if expected != size:
            raise ValueError(f"{path}: tensor {name} spans {size} bytes, its dtype and shape say {expected}")
    return size


@dataclass(frozen=True)
class _Tensor:
    bytes: int
    dtype: str
    shape: tuple[int, ...]


def _tensors(model_dir: Path) -> dict[str, _Tensor]:
    out: dict[str, _Tensor] = {}
    marker = read_marker(model_dir)
    # A partial folder: the whole model's manifest; without one, this folder's own headers.
    if marker is not None and marker.get("manifest"):
        manifest = manifest_from_dict(marker["manifest"])
        for f in manifest.files:
            if loaded_weights(f.path):
                for t in f.tensors:
                    out[t.name] = _Tensor(int(t.length), t.dtype, tuple(int(d) for d in t.shape))
        return out
    for file in weight_files(model_dir):
        for name, info in read_safetensors_header(file).items():
            out[name] = _Tensor(
                _entry_bytes(file, name, info), str(info.get("dtype", "")), tuple(int(d) for d in info.get("shape", ()))
            )
    return out


def tensor_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes of every tensor in the model's weight files, by name (headers only)."""
    return {name: t.bytes for name, t in _tensors(Path(model_dir)).items()}


def _sliding(cfg: dict[str, Any], n: int) -> tuple[int | None, ...]:
    """Per layer: the sliding window mlx-lm caps its KV cache at (RotatingKVCache), or None."""
    model_type = str(cfg.get("model_type", ""))
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:  # qwen2 configs carry a window they do not use
        return (None,) * n
    if model_type in ("gemma3", "gemma3_text") and window is None:
        window = 512  # mlx-lm's default
    if not window:
        return (None,) * n
    window = int(window)
    types = cfg.get("layer_types")
    if types:
        types = list(types)[:n] + ["full_attention"] * max(0, n - len(types))
        return tuple(window if t == "sliding_attention" else None for t in types)
    pattern = cfg.get("sliding_window_pattern")
    if pattern is None:
        pattern = {"gemma3": 6, "gemma3_text": 6, "cohere2": 4}.get(model_type)
    if model_type == "gpt_oss":  # alternating, starting with a sliding layer
        return tuple(window if i % 2 == 0 else None for i in range(n))
    if pattern:  # every pattern-th layer is global, the others slide
        pattern = int(pattern)
        return tuple(None if i % pattern == pattern - 1 else window for i in range(n))
    # A window the mlx-lm model does not apply per layer (mistral's, gemma2's): the KV is full.
    return (None,) * n


def _activation_dtype(tensors: dict[str, _Tensor], cfg: dict[str, Any]) -> str:
    """The dtype of activations and KV: the embedding's, promoted by the first block's norms."""
    embeds = sorted(k for k in tensors if EMBED_KEY.search(k) and not SKIP_KEY.search(k))
    dtype = next(
        (
            _DTYPE_NAMES[tensors[k].dtype]
            for suffix in (".scales", ".weight")
            for k in embeds
            if k.endswith(suffix) and tensors[k].dtype in _DTYPE_NAMES
        ),
        None,
    )
    if dtype is None:
        dtype = str(config_value(cfg, "torch_dtype", "dtype", default="float16"))
        dtype = dtype if dtype in _DTYPE_NAMES.values() else "float16"
    for key, t in tensors.items():
        m = LAYER_KEY.search(key)
        if m and m.group(1) == "0" and _NORM_KEY.search(key) and t.dtype in _DTYPE_NAMES:
            dtype = _promote(dtype, _DTYPE_NAMES[t.dtype])
    return dtype


_NORM_KEY = re.compile(r"(?:^|\.)\w*(?:layernorm|_norm|norm)\.weight$")


def _promote(a: str, b: str) -> str:
    """MLX's promotion of two float dtypes (float16 with bfloat16 gives float32)."""
    if a == b:
        return a
    if "float64" in (a, b):
        return "float64"
    return "float32"


def activation_dtype(model_dir: Path) -> str:
    """The activation dtype, right also on a stage without the embedding."""
    model_dir = Path(model_dir)
    return _activation_dtype(_tensors(model_dir), text_config(json.loads((model_dir / "config.json").read_text())))


def hidden_size(config: dict[str, Any]) -> int:
    """The residual stream's width from config.json (a quantized weight's shape is packed)."""
    value = config_value(text_config(config), "hidden_size", "n_embd", "d_model", "dim")
    if value is None:
        raise ValueError(f"{config.get('model_type')}: config.json names no hidden size")
    return int(value)


_FUSED_QKV = re.compile(r"\.(?:qkv_proj|c_attn|query_key_value|Wqkv|qkv)\.weight$")


def _kv_per_token(
    layer_keys: list[list[str]], tensors: dict[str, _Tensor], cfg: dict[str, Any], item: int, default: int
) -> tuple[int, ...]:
    """KV bytes per token of each layer, from k_proj/v_proj or the config; 0 without attention."""
    if cfg.get("kv_lora_rank"):  # multi-head latent attention: one compressed latent per token
        return ((int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)) * item,) * len(layer_keys)
    any_kv = any(k.endswith(("k_proj.weight", "v_proj.weight")) for keys in layer_keys for k in keys)
    out = []
    for keys in layer_keys:
        k = [tensors[x].shape[0] for x in keys if x.endswith(".k_proj.weight") and tensors[x].shape]
        v = [tensors[x].shape[0] for x in keys if x.endswith(".v_proj.weight") and tensors[x].shape]
        if k and v:
            out.append((k[0] + v[0]) * item)
        elif not any_kv or any(_FUSED_QKV.search(x) for x in keys):
            out.append(default)
        else:
            out.append(0)
    return tuple(out)


def trained_context(config: dict[str, Any]) -> int:
    """The context a model's config says it was trained for, rope scaling included (0: unknown)."""
    scaling = config.get("rope_scaling") or {}
    original = scaling.get("original_max_position_embeddings") if isinstance(scaling, dict) else None
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if (
        original
        and factor
        and scaling.get("rope_type", scaling.get("type")) in ("yarn", "dynamic", "longrope", "linear", "llama3")
    ):
        scaled = int(float(original) * float(factor))
    else:
        scaled = 0
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "n_ctx"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return max(value, scaled)
    return scaled


def _side_bytes(model_dir: Path) -> dict[str, int]:
    """The tensors of safetensors files beside mlx-lm's (an MTP head kept where mlx-lm does not load it)."""
    if read_marker(model_dir) is not None:
        return {}
    loaded = set(weight_files(model_dir))
    return {
        name: _entry_bytes(file, name, info)
        for file in sorted(model_dir.glob("*.safetensors"))
        if file not in loaded
        for name, info in read_safetensors_header(file).items()
    }


def profile_model(model_dir: Path, name: str | None = None) -> ModelProfile:
    """Profile an mlx-lm model directory, reading headers only."""
    model_dir = Path(model_dir)
    raw_cfg = json.loads((model_dir / "config.json").read_text())
    cfg = text_config(raw_cfg)
    n = int(config_value(cfg, "num_hidden_layers", "n_layer", "num_layers"))
    tensors = _tensors(model_dir)
    if not tensors:
        raise ValueError(f"{model_dir}: no model*.safetensors weights")
    layer_bytes = [0] * n
    layer_keys: list[list[str]] = [[] for _ in range(n)]
    embed = head = other = 0
    for key in sorted(tensors):
        size = tensors[key].bytes
        if SKIP_KEY.search(key) or mtp_layout.is_qwen_tensor(key):
            continue
        m = LAYER_KEY.search(key)
        if m:
            i = int(m.group(1))
            if i < n:
                layer_bytes[i] += size
                layer_keys[i].append(key)
            # else: an extra block mlx-lm drops on load (e.g. deepseek's multi-token-prediction layer)
        elif EMBED_KEY.search(key):
            embed += size
        elif HEAD_KEY.search(key):
            head += size
        else:
            other += size
    heads = int(config_value(cfg, "num_attention_heads", "n_head"))
    kv_heads = int(config_value(cfg, "num_key_value_heads", "num_kv_heads", default=heads))
    hidden = hidden_size(raw_cfg)
    head_dim = int(config_value(cfg, "head_dim", default=hidden // heads))
    dtype = _activation_dtype(tensors, cfg)
    item = ITEMSIZE[dtype]
    kv = _kv_per_token(layer_keys, tensors, cfg, item, 2 * kv_heads * head_dim * item)
    experts = int(config_value(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
    problem = split_support(raw_cfg) or ""
    if not problem and split_boundaries(raw_cfg) != list(range(1, n)):
        # Layers sharing caches in groups (hunyuan's cross-layer attention) cannot split anywhere.
        problem = (
            f"{raw_cfg.get('model_type')}: its layers share keys and values in groups, and stages "
            f"may start only at layers {split_boundaries(raw_cfg)}, which the planner does not place yet"
        )
    mtp = mtp_layout.mtp_footprint(
        mtp_layout.head_tensor_bytes({k: t.bytes for k, t in tensors.items()} | _side_bytes(model_dir), raw_cfg),
        embedding_bytes=embed,
        shares_embedding=False,
        shares_lm_head=True,
    )
    return ModelProfile(
        name=name or model_dir.name,
        model_type=str(raw_cfg.get("model_type") or cfg.get("model_type", "")),
        num_layers=n,
        layer_bytes=tuple(layer_bytes),
        embed_bytes=embed,
        head_bytes=head,
        norm_bytes=other,
        tied_embeddings=head == 0,
        kv_bytes_per_token=kv,
        sliding_window=_sliding(cfg, n),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(config_value(cfg, "intermediate_size", "n_inner", "ffn_dim", default=0) or 0),
        num_experts=experts,
        vocab_size=int(config_value(cfg, "vocab_size", default=0)),
        dtype=dtype,
        split_problem=problem,
        moe_intermediate_size=int(config_value(cfg, "moe_intermediate_size", default=0) or 0),
        quant_group_size=int(((raw_cfg.get("quantization") or {}).get("group_size")) or 0),
        trained_context=trained_context(cfg),
        kv_quant_problem=kv_quant_problem(raw_cfg),
        weights_note=str((raw_cfg.get("gguf") or {}).get("weights") or ""),
        quantization=quantization_level(raw_cfg),
        mtp_bytes=mtp.head_bytes,
        mtp_embed_bytes=mtp.embedding_bytes if mtp.head_bytes else 0,
    )


def quantization_level(raw_cfg: dict[str, Any]) -> str:
    """A GGUF file's type (what Ollama shows), else Q<bits> of the MLX quantization every module has
    but those named apart; "" for float weights. A mean over all weights would count an embedding
    kept at 8 bits (as GGUF files keep it) into a 4-bit model's width."""
    kind = (raw_cfg.get("gguf") or {}).get("type")
    if kind:
        return str(kind)
    bits = (raw_cfg.get("quantization") or {}).get("bits")
    return f"Q{bits}" if bits else ""
