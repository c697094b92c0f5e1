"""A GGUF file's tensors as mlx-lm weights, one at a time. Q4_0, Q4_1 and Q8_0 are MLX's affine
groups of 32 already, repacked unchanged; other quantized types are requantized by MLX."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor, get_tensor_name_map, quants
from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES

from meshnode.errors import MeshnodeError

GROUP_SIZE = 32
Q = GGMLQuantizationType
# Kept bit for bit: (bits, bytes per 32-value block).
KEPT = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q8_0: 8}
# Dequantized and quantized again with MLX at this many bits.
REQUANTIZED = {
    Q.Q2_K: 3,
    Q.Q3_K: 3,
    Q.Q4_K: 4,
    Q.Q5_K: 5,
    Q.Q6_K: 6,
    Q.Q8_K: 8,
    Q.Q5_0: 5,
    Q.Q5_1: 5,
    Q.Q8_1: 8,
    Q.IQ1_S: 2,
    Q.IQ1_M: 2,
    Q.IQ2_XXS: 2,
    Q.IQ2_XS: 2,
    Q.IQ2_S: 2,
    Q.IQ3_XXS: 3,
    Q.IQ3_S: 3,
    Q.IQ4_NL: 4,
    Q.IQ4_XS: 4,
    Q.TQ1_0: 2,
    Q.TQ2_0: 2,
}
FLOATS = {Q.F32: mx.float32, Q.F16: mx.float16, Q.BF16: mx.bfloat16}
# Tensors llama.cpp writes that mlx-lm computes itself.
DERIVED = re.compile(r"^rope_freqs\.weight$|\.attn_rot_embd$")
_SAFE_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32"}


class UnsupportedGGUF(MeshnodeError, ValueError):
    """A GGUF this node cannot serve; the message names the architecture, tensor or type."""


@dataclass(frozen=True)
class Planned:
    """One output tensor: its mlx-lm name, dtype, shape, and how to compute it."""

    name: str
    dtype: mx.Dtype
    shape: tuple[int, ...]
    make: Callable[[], mx.array]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.size


def arch_of(name: str) -> MODEL_ARCH:
    for arch, arch_name in MODEL_ARCH_NAMES.items():
        if arch_name == name:
            return arch
    raise UnsupportedGGUF(f"GGUF architecture {name!r} is unknown to the gguf package")


def gguf_names(param_names: list[str], arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> mlx-lm parameter name, for every parameter the map knows."""
    table = get_tensor_name_map(arch_of(arch), num_layers)
    out: dict[str, str] = {}
    for name in param_names:
        module, _, suffix = name.rpartition(".")
        for candidate in hf_spellings(module):
            found = table.get_name(candidate)
            if found is not None:
                out[f"{found}.{suffix}"] = name
                break
    return out


def hf_spellings(module: str) -> Iterator[str]:
    """The Hugging Face spellings of an mlx-lm module: mlx-lm stacks experts as ``switch_mlp``."""
    yield module
    if ".switch_mlp." in module:
        stacked = module.replace(".switch_mlp.", ".experts.")
        yield stacked
        for mine, theirs in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")):
            if stacked.endswith(mine):
                yield stacked[: -len(mine)] + theirs


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row reordering (for its interleaved rope), so mlx-lm's rope applies;
    works on packed rows, scales and offsets alike."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """``bits``-bit values packed as MLX does: 32 // bits to a uint32, lowest first."""
    per = 32 // bits
    v = values.astype(np.uint32).reshape(values.shape[0], -1, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    packed: np.ndarray = np.bitwise_or.reduce(v << shifts, axis=2)
    return packed


def repack(raw: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed, scales, offsets) of Q4_0, Q4_1 or Q8_0 block rows, exactly."""
    rows = raw.shape[0]
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(rows, -1, size)
    scale = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    if qtype == Q.Q8_0:  # w = d * q, q int8
        q = blocks[:, :, 2:34].view(np.int8).astype(np.int16) + 128
        offset = (scale.astype(np.float32) * -128).astype(np.float16)
        return _pack(q.reshape(rows, -1), 8), scale, offset
    # w = d * q + m (Q4_1), or d * (q - 8) (Q4_0); q in 16 bytes, low nibbles first
    start = 4 if qtype == Q.Q4_1 else 2
    offset = (
        blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
        if qtype == Q.Q4_1
        else (scale.astype(np.float32) * -8).astype(np.float16)
    )
    qs = blocks[:, :, start : start + 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
    return _pack(q.reshape(rows, -1), 4), scale, offset


def requantize(raw: np.ndarray, qtype: GGMLQuantizationType, bits: int) -> tuple[np.ndarray, ...]:
    """(packed, scales, offsets) of any type the gguf package reads, requantized by MLX at ``bits``."""
    w = mx.array(quants.dequantize(raw, qtype).astype(np.float32))
    q, scales, biases = mx.quantize(w, group_size=GROUP_SIZE, bits=bits)
    return np.array(q), np.array(scales.astype(mx.float16)), np.array(biases.astype(mx.float16))


ROWS_AT_ONCE = 1024  # bounds what the conversion holds beyond its output tensor


def by_rows(
    t: ReaderTensor, convert: Callable[[np.ndarray], tuple[np.ndarray, ...]], fix: Callable[[np.ndarray], np.ndarray]
) -> tuple[np.ndarray, ...]:
    """``convert`` applied to ``t``'s rows a block at a time, then ``fix``ed: memory holds the output
    and one block."""
    raw = np.asarray(t.data)
    lead = raw.shape[:-1]
    rows = raw.reshape(-1, raw.shape[-1])
    out: list[np.ndarray] = []
    for start in range(0, rows.shape[0], ROWS_AT_ONCE):
        parts = convert(rows[start : start + ROWS_AT_ONCE])
        if not out:
            out = [np.empty((rows.shape[0], *p.shape[1:]), p.dtype) for p in parts]
        for whole, part in zip(out, parts):
            whole[start : start + part.shape[0]] = part
    return tuple(fix(a.reshape(*lead, -1)) for a in out)


def plan_tensor(t: ReaderTensor, name: str, unpermute: int = 0) -> list[Planned]:
    """The mlx-lm tensors for GGUF tensor ``t``; a quantized weight gives ``.weight``, ``.scales`` and
    ``.biases``. ``unpermute``: heads to un-permute rows by."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    fix = (lambda a: unpermute_rows(a, unpermute)) if unpermute else (lambda a: a)
    qtype = t.tensor_type
    base = name[: -len(".weight")] if name.endswith(".weight") else None
    if qtype in FLOATS:
        dtype = FLOATS[qtype]

        def make_float() -> mx.array:
            data = np.asarray(t.data)
            if qtype == Q.BF16:
                return mx.array(fix(data.view(np.uint16).reshape(shape))).view(mx.bfloat16)
            return mx.array(fix(data.reshape(shape)))

        return [Planned(name, dtype, shape, make_float)]
    if base is None or shape[-1] % GROUP_SIZE:
        if qtype not in REQUANTIZED and qtype not in KEPT:
            raise UnsupportedGGUF(f"tensor {t.name}: GGUF type {qtype.name} is not supported")
        return [
            Planned(
                name,
                mx.float16,
                shape,
                lambda: mx.array(fix(quants.dequantize(np.asarray(t.data), qtype)).astype(np.float16)),
            )
        ]
    if qtype in KEPT:
        bits = KEPT[qtype]

        def convert(raw: np.ndarray) -> tuple[np.ndarray, ...]:
            return repack(raw, qtype)
    elif qtype in REQUANTIZED:
        bits = REQUANTIZED[qtype]

        def convert(raw: np.ndarray) -> tuple[np.ndarray, ...]:
            return requantize(raw, qtype, bits)
    else:
        raise UnsupportedGGUF(f"tensor {t.name}: GGUF type {qtype.name} is not supported")
    parts: dict[str, tuple[np.ndarray, ...]] = {}

    def part(i: int) -> Callable[[], mx.array]:
        def make() -> mx.array:  # the three are computed together, then handed out and let go
            if "v" not in parts:
                parts["v"] = by_rows(t, convert, fix)
            return mx.array(parts["v"][i] if i < 2 else parts.pop("v")[i])

        return make

    lead, cols = shape[:-1], shape[-1]
    packed = (*lead, cols * bits // 32)
    grouped = (*lead, cols // GROUP_SIZE)
    return [
        Planned(f"{base}.weight", mx.uint32, packed, part(0)),
        Planned(f"{base}.scales", mx.float16, grouped, part(1)),
        Planned(f"{base}.biases", mx.float16, grouped, part(2)),
    ]


def quantized_bits(t: ReaderTensor) -> int | None:
    """The bits a quantized weight gets in MLX (None: stored as floats)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if t.tensor_type in FLOATS or shape[-1] % GROUP_SIZE or len(shape) < 2:
        return None
    return KEPT.get(t.tensor_type) or REQUANTIZED.get(t.tensor_type)


def write_safetensors(
    path: Path, tensors: list[Planned], metadata: dict[str, str], done: Callable[[int], None] | None = None
) -> None:
    """Write ``tensors`` one at a time (header first), so memory holds one tensor."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for p in tensors:
        header[p.name] = {
            "dtype": _SAFE_DTYPES[p.dtype],
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.nbytes],
        }
        offset += p.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for p in tensors:
            array = p.make()
            if array.dtype != p.dtype or tuple(array.shape) != p.shape:
                raise UnsupportedGGUF(
                    f"{p.name}: computed {array.dtype} {tuple(array.shape)}, planned {p.dtype} {p.shape}"
                )
            view = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
            f.write(np.ascontiguousarray(np.asarray(view)).data)
            if done is not None:
                done(p.nbytes)


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError, struct.error) as exc:
        raise UnsupportedGGUF(f"{path} is not a readable GGUF file: {exc}") from exc
