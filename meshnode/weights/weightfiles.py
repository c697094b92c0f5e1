"""A model's weight files, read without loading: which files mlx-lm loads, safetensors headers (never
the data), and which part of the model a tensor name belongs to."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "U64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}
# Array dtype names (MLX's, numpy's) -> safetensors codes, and bytes per element by name: activations,
# KV caches and the wire count in these.
DTYPE_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int32": "I32"}
ITEMSIZE = {name: DTYPE_BYTES[code] for name, code in DTYPE_CODES.items()}
MAX_HEADER = 100 * 2**20

# A transformer block: "model.layers.3.", gpt2's "model.h.3.", olmo's "model.transformer.blocks.3.".
LAYER_KEY = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
EMBED_KEY = re.compile(r"(?:^|\.)(?:embed_tokens|wte|embed_in|tok_embeddings|word_embeddings|wpe)\.")
HEAD_KEY = re.compile(r"(?:^|\.)(?:lm_head|embed_out)\.|^output\.")
# Multimodal towers mlx-lm's text models drop: in no stage.
SKIP_KEY = re.compile(
    r"^(?:[\w]*\.)?(?:vision_tower|vision_model|visual|vision|audio_tower|audio_model|"
    r"multi_modal_projector|mm_projector|embed_vision|embed_audio)\."
)


def decode_safetensors_header(head: bytes, more: Callable[[int, int], bytes], where: str) -> tuple[int, dict[str, Any]]:
    """(bytes before the tensor data, header without ``__metadata__``) of a file starting with
    ``head``; ``more(first, last)`` reads an inclusive byte range of a longer header."""
    if len(head) < 8:
        raise ValueError(f"{where}: not a safetensors file")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER:
        raise ValueError(f"{where}: header of {n} bytes is implausible")
    raw = head[8 : 8 + n] if len(head) >= 8 + n else head[8:] + more(len(head), 8 + n - 1)
    if len(raw) != n:
        raise ValueError(f"{where}: truncated safetensors header")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError(f"{where}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return 8 + n, header


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (without ``__metadata__``)."""
    with open(path, "rb") as f:

        def more(first: int, last: int) -> bytes:
            f.seek(first)
            return f.read(last - first + 1)

        return decode_safetensors_header(f.read(8), more, str(path))[1]


def weight_files(model_dir: Path) -> list[Path]:
    """``model*.safetensors``, as mlx-lm loads (not a ``consolidated`` copy)."""
    return sorted(Path(model_dir).glob("model*.safetensors"))
