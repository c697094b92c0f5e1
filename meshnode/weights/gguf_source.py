"""GGUF files (a path, or a model Ollama pulled) as mlx-lm folders, converted once by content hash,
so the same file gives the same model id on every node. Renamed into place only when whole."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import LlamaFileType, ReaderTensor

from meshnode.weights import mtp_layout
from meshnode.weights.gguf_config import NORM_PLUS_ONE, eos_ids, family, metadata, model_config, save_tokenizer
from meshnode.weights.gguf_tensors import (
    DERIVED,
    GROUP_SIZE,
    KEPT,
    REQUANTIZED,
    Planned,
    UnsupportedGGUF,
    gguf_names,
    open_gguf,
    plan_tensor,
    quantized_bits,
    write_safetensors,
)

log = logging.getLogger(__name__)

OLLAMA_PREFIX = "ollama:"
OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"
SHARD_BYTES = 2 * 2**30  # safetensors files of about this size, whole layers each
_CHUNK = 8 * 2**20
GUESSED = LlamaFileType.GUESSED.value  # a flag on general.file_type: llama.cpp guessed it
FILE_TYPES = {t.value: t.name.removeprefix("MOSTLY_").removeprefix("ALL_") for t in LlamaFileType if t.value < GUESSED}
Progress = Callable[[str, int, int], None]


def is_gguf_spec(spec: str) -> bool:
    return spec.startswith(OLLAMA_PREFIX) or spec.lower().endswith(".gguf")


def ollama_models_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def ollama_blob(spec: str, root: Path | None = None) -> Path:
    """The GGUF blob of ``ollama:<name>[:<tag>]`` in Ollama's model store."""
    name = spec[len(OLLAMA_PREFIX) :]
    name, _, tag = name.partition(":")
    if not name or not re.fullmatch(r"[\w.\-/]+", name) or (tag and not re.fullmatch(r"[\w.\-]+", tag)):
        raise FileNotFoundError(f"{spec!r} is not an Ollama model name (ollama:<name>[:<tag>])")
    root = root or ollama_models_dir()
    parts = name.split("/")
    if len(parts) == 1:
        parts = ["registry.ollama.ai", "library", *parts]
    elif len(parts) == 2:
        parts = ["registry.ollama.ai", *parts]
    manifest = root / "manifests" / Path(*parts) / (tag or "latest")
    if not manifest.is_file():
        raise FileNotFoundError(f"Ollama has no model {name}:{tag or 'latest'} (no manifest at {manifest})")
    layers = json.loads(manifest.read_text()).get("layers") or []
    digest: str | None = next(
        (layer.get("digest") for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_MEDIA), None
    )
    if not digest or not re.fullmatch(r"sha256[:-][0-9a-f]{64}", digest):
        raise FileNotFoundError(f"Ollama's manifest {manifest} names no model layer")
    blob = root / "blobs" / digest.replace(":", "-")
    if not blob.is_file():
        raise FileNotFoundError(f"Ollama's blob {blob} is missing")
    return blob


def content_hash(path: Path, cache_dir: Path, progress: Progress | None = None) -> str:
    """The file's sha256: an Ollama blob's name, else computed once and cached by path, size, mtime."""
    m = re.fullmatch(r"sha256-([0-9a-f]{64})", path.name)
    if m:
        return m.group(1)
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = cache_dir / "gguf" / "hashes.json"
    known: dict[str, str] = _read_json(memo)
    if key in known:
        return known[key]
    digest, done = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(f"hashing {path.name}", done, stat.st_size)
    known = _read_json(memo)
    known[key] = digest.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, memo)
    return known[key]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return {}


def model_id(meta: dict[str, Any], sha: str) -> str:
    """A readable id that only this file's content gives: base name, size, type, hash."""
    words = [str(meta.get(k) or "") for k in ("general.basename", "general.size_label")]
    if not any(words):
        words = [str(meta.get("general.name") or meta.get("general.architecture") or "gguf")]
    kinds = Counter(t for t in meta.get("_tensor_types", []))
    if kinds:
        words.append(kinds.most_common(1)[0][0])
    slug = re.sub(r"[^a-z0-9.]+", "-", " ".join(words).lower()).strip("-")[:48] or "gguf"
    return f"{slug}-{sha[:12]}"


def file_type(meta: dict[str, Any]) -> str:
    """The file's type as llama.cpp names it (Q4_1, Q4_K_M, F16): general.file_type, else the
    commonest type of the blocks' weights."""
    value = meta.get("general.file_type")
    if isinstance(value, int) and (value & ~GUESSED) in FILE_TYPES:
        return FILE_TYPES[value & ~GUESSED]
    kinds: Counter[str] = Counter(meta.get("_tensor_types", []))
    return kinds.most_common(1)[0][0] if kinds else ""


def resolve_gguf(spec: str, cache_dir: Path, progress: Progress | None = None) -> tuple[str, Path]:
    """(model id, mlx-lm folder) for a GGUF path or ``ollama:<name>[:<tag>]``, converting it once."""
    path = ollama_blob(spec) if spec.startswith(OLLAMA_PREFIX) else Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    sha = content_hash(path, cache_dir, progress)
    root = cache_dir / "gguf"
    out = root / sha
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f"{sha}.lock"):
        if not (out / "config.json").is_file():
            _discard_partials(root, sha)
            partial = root / f"{sha}.partial-{os.getpid()}"
            partial.mkdir()
            try:
                convert(path, partial, sha, progress)
                os.replace(partial, out)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
    return converted_id(out) or out.name, out


def converted_id(folder: Path) -> str | None:
    """The model id of a folder converted from a GGUF file, so it keeps its file's id; else None."""
    try:
        info = json.loads((folder / "config.json").read_text()).get("gguf") or {}
    except (OSError, ValueError):
        return None
    return str(info["model_id"]) if info.get("model_id") else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _discard_partials(root: Path, sha: str) -> None:
    for old in root.glob(f"{sha}.partial-*"):
        log.info("removing an interrupted conversion: %s", old)
        shutil.rmtree(old, ignore_errors=True)


def convert(path: Path, out: Path, sha: str, progress: Progress | None = None) -> None:
    """Write the mlx-lm folder of GGUF ``path`` into ``out``: config, tokenizer, weights."""
    reader = open_gguf(path)
    meta = metadata(reader)
    arch, model_type = family(meta)
    tensors = {t.name: t for t in reader.tensors}
    cfg = model_config(meta, set(tensors))
    meta["_tensor_types"] = [
        t.tensor_type.name for t in reader.tensors if t.name.endswith(".weight") and t.name.startswith("blk.")
    ]
    ident = model_id(meta, sha)
    names = gguf_names(_parameter_names(cfg), arch, cfg["num_hidden_layers"])
    _check_rope_factors(tensors, cfg)
    planned: list[tuple[int, Planned]] = []
    bits_of: dict[str, int] = {}
    backbone = cfg["num_hidden_layers"]
    mtp_bytes: dict[str, int] = {}  # MTP layer 0's tensors by the head's names, as its loader makes them
    for t in reader.tensors:
        if DERIVED.search(t.name):
            continue
        layer = re.match(r"blk\.(\d+)\.", t.name)
        if layer and int(layer.group(1)) >= backbone:  # an MTP layer: the MTP loader reads it from the file
            head_name = mtp_layout.gguf_name(t.name, backbone)
            if head_name is not None:
                mtp_bytes.update((p.name, p.nbytes) for p in plan_tensor(t, head_name))
            continue
        name = names.get(t.name)
        if name is None:
            raise UnsupportedGGUF(f"{path.name}: tensor {t.name} has no place in mlx-lm's {model_type} model")
        heads = 0
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads"] if "attn_q" in t.name else cfg["num_key_value_heads"]
        parts = plan_tensor(t, name, heads)
        if arch in NORM_PLUS_ONE and name.endswith("norm.weight"):
            parts = [_minus_one(p) for p in parts]
        bits = quantized_bits(t)
        if bits is not None and len(parts) == 3:
            bits_of[name.rsplit(".", 1)[0]] = bits
        planned.extend((int(layer.group(1)) if layer else -1, p) for p in parts)
    cfg["quantization"] = _quantization(bits_of)
    if not cfg["quantization"]:
        del cfg["quantization"]
    cfg["eos_token_id"] = eos_ids(meta) or None
    cfg["gguf"] = {
        "model_id": ident,
        "sha256": sha,
        "file": path.name,
        "type": file_type(meta),
        "weights": weights_note(reader.tensors),
    }
    nextn = int(meta.get(f"{arch}.nextn_predict_layers") or 0)
    if nextn:
        cfg["gguf"]["mtp"] = {"layers": nextn, "bytes": mtp_bytes}
    total = sum(p.nbytes for _, p in planned)
    done = told = 0

    def advance(n: int) -> None:
        nonlocal done, told
        done += n
        if progress is not None:
            progress(f"converting {path.name}", done, total)
        if done * 10 // total > told:  # the log says it too, for a service with no terminal
            told = done * 10 // total
            log.info("converting %s: %d%%", path.name, 10 * told)

    log.info(
        "converting %s (%s, %d tensors) into %s: %s", path.name, model_type, len(planned), out, cfg["gguf"]["weights"]
    )
    save_tokenizer(meta, out)
    _write_shards(out, planned, advance)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def _parameter_names(cfg: dict[str, Any]) -> list[str]:
    """The parameter names of the mlx-lm model ``cfg`` describes (built lazily: nothing allocated)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    return [pair[0] for pair in tree_flatten(model.parameters())]


def _minus_one(p: Planned) -> Planned:
    return Planned(p.name, p.dtype, p.shape, lambda: p.make() - 1)


def _quantization(bits_of: dict[str, int]) -> dict[str, Any]:
    """mlx-lm's quantization config: the commonest width for all, each other module by its path."""
    if not bits_of:
        return {}
    common = Counter(bits_of.values()).most_common(1)[0][0]
    q: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
    for module, bits in bits_of.items():
        if bits != common:
            q[module] = {"group_size": GROUP_SIZE, "bits": bits}
    return q


def weights_note(tensors: Sequence[ReaderTensor]) -> str:
    """What the conversion does to the file's weights, for ``meshnode status`` and the plan."""
    kept = Counter(t.tensor_type.name for t in tensors if t.tensor_type in KEPT)
    redone = Counter(
        f"{t.tensor_type.name} as {REQUANTIZED[t.tensor_type]}-bit" for t in tensors if t.tensor_type in REQUANTIZED
    )
    parts = []
    if kept:
        parts.append(f"{'/'.join(sorted(kept))} kept bit for bit")
    if redone:
        parts.append("requantized with MLX (groups of 32): " + ", ".join(sorted(redone)))
    return "GGUF weights: " + ("; ".join(parts) or "floats kept as stored")


def _write_shards(out: Path, planned: list[tuple[int, Planned]], advance: Callable[[int], None]) -> None:
    """Safetensors files of whole layers (about SHARD_BYTES each) and mlx-lm's index of them."""
    groups: list[list[Planned]] = [[]]
    size, last_layer = 0, None
    for layer, p in sorted(planned, key=lambda lp: lp[0] if lp[0] >= 0 else math.inf):
        if size >= SHARD_BYTES and layer != last_layer and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.nbytes
        last_layer = layer
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
        write_safetensors(out / name, group, {"format": "mlx"}, advance)
        weight_map.update({p.name: name for p in group})
    total = sum(p.nbytes for _, p in planned)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )


def _check_rope_factors(tensors: dict[str, ReaderTensor], cfg: dict[str, Any]) -> None:
    """The four llama 3 rope numbers mlx-lm needs that give exactly the file's factor tensor, or refuse."""
    t = tensors.get("rope_freqs.weight")
    if t is None:
        return
    factors = np.asarray(t.data, dtype=np.float64).reshape(-1)
    dims, base = cfg["head_dim"], cfg.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, dims, 2) / dims))
    wavelen = 2 * math.pi / freqs
    factor = float(factors.max())
    for low, high, original in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 16384)):
        smooth = (original / wavelen - low) / (high - low)
        want = np.where(
            wavelen < original / high,
            1.0,
            np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if np.allclose(want, factors, rtol=1e-3):
            cfg["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
            return
    raise UnsupportedGGUF("rope_freqs.weight: rope frequency factors that are not llama 3's are not supported")
