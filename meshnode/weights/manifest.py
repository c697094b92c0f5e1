"""A model's content identity: every file and every tensor with its byte range and sha256, so a node
fetching only its layers verifies every tensor on its own. Cached beside the weights."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from google.protobuf import json_format

from meshnode.proto import mesh_pb2
from meshnode.weights.splits import config_value, text_config
from meshnode.weights.weightfiles import (
    DTYPE_BYTES,
    EMBED_KEY,
    HEAD_KEY,
    LAYER_KEY,
    SKIP_KEY,
    read_safetensors_header,
    weight_files,
)

__all__ = [
    "CACHE_NAME",
    "PARTIAL_MARKER",
    "INDEX_NAME",
    "build_manifest",
    "tensors_for_layers",
    "layers_held",
    "validate_manifest",
    "model_digest",
    "safe_relpath",
    "is_weight_file",
    "num_layers_of",
    "manifest_to_dict",
    "manifest_from_dict",
    "read_marker",
    "weights_identity",
]

CACHE_NAME = ".meshnode-manifest.json"
PARTIAL_MARKER = "meshnode-partial.json"
INDEX_NAME = "model.safetensors.index.json"
_CACHE_VERSION = 1
_READ = 1 << 20
_HEX = re.compile(r"^[0-9a-f]{64}$")
# Never copied as "small files": mlx-lm loads only model*.safetensors; the index is rewritten.
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
    ".npz",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".pkl",
    ".onnx",
    ".ot",
)
MAX_FILES = 100_000
MAX_TENSORS = 1_000_000
MAX_SIZE = 1 << 50


def is_weight_file(path: str) -> bool:
    """Weights (or the weights' index): everything else is a small file a stage copies whole."""
    name = PurePosixPath(path).name
    return name.endswith(_WEIGHT_SUFFIXES) or name == INDEX_NAME


def safe_relpath(path: str) -> str | None:
    """``path`` if it is a plain relative "/"-separated path inside a folder, else None."""
    if not isinstance(path, str) or not path or len(path) > 1024 or "\\" in path or "\x00" in path:
        return None
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        return None
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return None
    return path


def model_digest(files: list[tuple[str, str]]) -> str:
    """sha256 over the sorted (path, file sha256) pairs: the model's content identity."""
    h = hashlib.sha256()
    for path, sha in sorted(files):
        h.update(f"{len(path)}:{path}:{sha}\n".encode())
    return h.hexdigest()


def list_files(model_dir: Path) -> list[str]:
    out = []
    for root, dirs, files in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in files:
            if f.startswith(".") or f == PARTIAL_MARKER:
                continue
            p = Path(root) / f
            if p.is_file():  # follows symlinks (huggingface snapshots link to blobs)
                out.append(p.relative_to(model_dir).as_posix())
    return sorted(out)


def hash_file(path: Path, rel: str) -> mesh_pb2.FileEntry:
    """One pass over the file: the file's sha256 and, for safetensors, each tensor's."""
    size = path.stat().st_size
    entry = mesh_pb2.FileEntry(path=rel, size=size)
    spans: list[tuple[int, int, Any, mesh_pb2.TensorEntry]] = []
    if rel.endswith(".safetensors"):
        header = read_safetensors_header(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
        entry.header_length = 8 + n
        for name, info in header.items():
            s, e = (int(x) for x in info["data_offsets"])
            t = mesh_pb2.TensorEntry(
                name=name,
                dtype=str(info["dtype"]),
                shape=[int(d) for d in info["shape"]],
                offset=entry.header_length + s,
                length=e - s,
            )
            if e < s or t.offset + t.length > size:
                raise ValueError(f"{path}: tensor {name} lies outside the file")
            spans.append((t.offset, t.offset + t.length, hashlib.sha256(), t))
        spans.sort(key=lambda x: x[0])
        for a, b in zip(spans, spans[1:]):
            if b[0] < a[1]:
                raise ValueError(f"{path}: tensors {a[3].name} and {b[3].name} overlap")
    whole = hashlib.sha256()
    pos = 0
    k = 0
    with open(path, "rb") as f:
        while True:
            data = f.read(_READ)
            if not data:
                break
            whole.update(data)
            end = pos + len(data)
            while k < len(spans) and spans[k][1] <= pos:
                k += 1
            j = k
            while j < len(spans) and spans[j][0] < end:
                s, e, h, _ = spans[j]
                h.update(data[max(s, pos) - pos : min(e, end) - pos])
                j += 1
            pos = end
    if pos != size:
        raise ValueError(f"{path}: changed while it was read")
    entry.sha256 = whole.hexdigest()
    for _, _, h, t in spans:
        t.sha256 = h.hexdigest()
        entry.tensors.append(t)
    return entry


def manifest_to_dict(m: mesh_pb2.ModelManifest) -> dict[str, Any]:
    d: dict[str, Any] = json_format.MessageToDict(m, preserving_proto_field_name=True)
    return d


def manifest_from_dict(d: dict[str, Any]) -> mesh_pb2.ModelManifest:
    m = mesh_pb2.ModelManifest()
    json_format.ParseDict(d, m)  # fills m in place
    return m


def _cache_key(model_dir: Path, rels: list[str]) -> list[list[str | int]]:
    key: list[list[str | int]] = []
    for rel in rels:
        st = (model_dir / rel).stat()
        key.append([rel, st.st_size, st.st_mtime_ns])
    return key


def build_manifest(model_dir: Path | str, model_id: str) -> mesh_pb2.ModelManifest:
    """A complete model folder's files and tensors with digests, and the model digest; cached."""
    model_dir = Path(model_dir)
    rels = list_files(model_dir)
    key = _cache_key(model_dir, rels)
    cache = model_dir / CACHE_NAME
    try:
        cached = json.loads(cache.read_text())
        if cached.get("version") == _CACHE_VERSION and cached.get("key") == key:
            m = manifest_from_dict(cached["manifest"])
            m.model_id = model_id
            return m
    except (OSError, ValueError, KeyError, json_format.ParseError):
        pass
    m = mesh_pb2.ModelManifest(model_id=model_id)
    for rel in rels:
        m.files.append(hash_file(model_dir / rel, rel))
    m.digest = model_digest([(f.path, f.sha256) for f in m.files])
    if _cache_key(model_dir, rels) == key:  # unchanged while hashing
        tmp = cache.with_name(f"{CACHE_NAME}.{os.getpid()}.tmp")
        try:
            body = {"version": _CACHE_VERSION, "key": key, "manifest": manifest_to_dict(m)}
            tmp.write_text(json.dumps(body))
            os.replace(tmp, cache)
        except OSError:  # a read-only model folder: recompute next time
            tmp.unlink(missing_ok=True)
    return m


def loaded_weights(path: str) -> bool:
    """Top-level ``model*.safetensors``, as mlx-lm loads."""
    return "/" not in path and path.startswith("model") and path.endswith(".safetensors")


def _kind(name: str, num_layers: int) -> tuple[str, int]:
    """("layer", i) | ("embed", -1) | ("head", -1) | ("other", -1) | ("skip", -1), as profile.py counts."""
    if SKIP_KEY.search(name):
        return "skip", -1
    m = LAYER_KEY.search(name)
    if m:
        i = int(m.group(1))
        return ("layer", i) if i < num_layers else ("skip", -1)
    if EMBED_KEY.search(name):
        return "embed", -1
    if HEAD_KEY.search(name):
        return "head", -1
    return "other", -1


def tensors_for_layers(
    manifest: mesh_pb2.ModelManifest, start: int, end: int, num_layers: int, tied: bool | None = None
) -> list[tuple[str, mesh_pb2.TensorEntry]]:
    """(file path, tensor) of exactly what a stage of layers [start, end) needs (``tied=None``:
    tied when there is no head tensor)."""
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"bad layer range [{start}, {end}) for {num_layers} layers")
    weights = [(f.path, t) for f in manifest.files if loaded_weights(f.path) for t in f.tensors]
    kinds = [(_kind(t.name, num_layers), p, t) for p, t in weights]
    if tied is None:
        tied = not any(k == "head" for (k, _), _, _ in kinds)
    first, last = start == 0, end == num_layers
    out = []
    for (kind, i), path, t in kinds:
        if (
            (kind == "layer" and start <= i < end)
            or (kind == "embed" and (first or (last and tied)))
            or (kind in ("head", "other") and last)
        ):
            out.append((path, t))
    return out


def num_layers_of(config: dict[str, Any]) -> int:
    """The number of transformer blocks a config.json declares."""
    n = config_value(text_config(config), "num_hidden_layers", "n_layer", "num_layers")
    if not isinstance(n, int) or not 0 < n < 100_000:
        raise ValueError(f"config.json declares no plausible layer count ({n!r})")
    return n


def read_marker(model_dir: Path | str) -> dict[str, Any] | None:
    """The ``meshnode-partial.json`` a transfer leaves in a folder holding some layers, or None."""
    p = Path(model_dir) / PARTIAL_MARKER
    if not p.is_file():
        return None
    d = json.loads(p.read_text())
    if not isinstance(d, dict) or not isinstance(d.get("start"), int) or not isinstance(d.get("end"), int):
        raise ValueError(f"{p}: malformed partial-model marker")
    return d


def weights_identity(model_dir: Path | str) -> str:
    """A cheap name for a folder's weights: a partial folder's model digest, else a hash of config
    and weight file names, sizes and times."""
    marker = read_marker(model_dir)
    digest = marker.get("digest") if marker is not None else None
    if isinstance(digest, str) and digest:
        return digest
    h = hashlib.sha256()
    config = Path(model_dir) / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for path in weight_files(Path(model_dir)):
        st = path.stat()
        h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def folder_name(model_id: str, start: int, end: int) -> str:
    """The cache folder's name for layers [start, end) of ``model_id``."""
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '_', model_id)[:120]}-{start}-{end}"


def cached_folders(cache_root: Path | str) -> Iterator[tuple[Path, dict[str, Any] | None]]:
    """Every finished folder under ``cache_root`` with its marker (None for a plain model folder)."""
    root = Path(cache_root)
    if not root.is_dir():
        return
    for d in sorted(root.iterdir()):
        if d.name.startswith(".") or d.name.endswith(".partial") or not d.is_dir():
            continue
        try:
            marker = read_marker(d)
        except (OSError, ValueError):
            continue
        yield d, marker


def _ranges(indices: set[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i in sorted(indices):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def layers_held(model_dir: Path | str) -> list[tuple[int, int]]:
    """The [start, end) layer ranges whose tensors a local folder holds."""
    model_dir = Path(model_dir)
    marker = read_marker(model_dir)
    if marker is not None:
        return [(marker["start"], marker["end"])]
    n = num_layers_of(json.loads((model_dir / "config.json").read_text()))
    found = set()
    for f in weight_files(model_dir):
        for name in read_safetensors_header(f):
            kind, i = _kind(name, n)
            if kind == "layer":
                found.add(i)
    return _ranges(found)


def validate_manifest(m: mesh_pb2.ModelManifest, model_id: str) -> None:
    """Check a peer's manifest before fetching by it (paths, sizes, byte ranges, digests). Raises ValueError."""
    if m.model_id != model_id:
        raise ValueError(f"manifest names model {m.model_id!r}, asked for {model_id!r}")
    if not _HEX.match(m.digest):
        raise ValueError("manifest digest is not a sha256 hex digest")
    if not 0 < len(m.files) <= MAX_FILES:
        raise ValueError(f"manifest lists {len(m.files)} files")
    paths, names, count = set(), set(), 0
    for f in m.files:
        if safe_relpath(f.path) is None or f.path in paths:
            raise ValueError(f"manifest path {f.path!r} is unsafe or repeated")
        paths.add(f.path)
        if f.size > MAX_SIZE or not _HEX.match(f.sha256):
            raise ValueError(f"{f.path}: bad size or digest")
        if f.tensors and not 8 < f.header_length <= f.size:
            raise ValueError(f"{f.path}: bad header length {f.header_length}")
        spans = []
        for t in f.tensors:
            count += 1
            if count > MAX_TENSORS:
                raise ValueError("manifest lists too many tensors")
            if not t.name or len(t.name) > 1024 or t.name in names or t.name.startswith("__"):
                raise ValueError(f"{f.path}: tensor name {t.name[:80]!r} is empty, too long or repeated")
            names.add(t.name)
            item = DTYPE_BYTES.get(t.dtype)
            if item is None or len(t.shape) > 16 or not _HEX.match(t.sha256):
                raise ValueError(f"{f.path}: tensor {t.name}: bad dtype, shape or digest")
            n = item
            for d in t.shape:
                n *= d
            if n != t.length or t.offset < f.header_length or t.offset + t.length > f.size:
                raise ValueError(f"{f.path}: tensor {t.name}: byte range disagrees with dtype, shape or file")
            spans.append((t.offset, t.offset + t.length))
        spans.sort()
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
            raise ValueError(f"{f.path}: tensors overlap")
    if model_digest([(f.path, f.sha256) for f in m.files]) != m.digest:
        raise ValueError("manifest digest does not match its files")
