"""Models from peers, the fetching side: exactly the tensors of some layers, from every peer whose
manifest agrees, at once; resumable, and published by one rename once complete."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from meshnode.durable import fsync_dir
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.weights.download import (
    JOURNAL,
    DiskSpaceError,
    Download,
    DownloadItem,
    FetchError,
    Metadata,
    hash_range,
)
from meshnode.weights.manifest import (
    INDEX_NAME,
    PARTIAL_MARKER,
    is_weight_file,
    manifest_to_dict,
    num_layers_of,
    read_marker,
    tensors_for_layers,
    validate_manifest,
)

__all__ = ["fetch_layers", "fetch_metadata", "FetchResult", "FetchError", "DiskSpaceError", "tty_progress"]

log = logging.getLogger(__name__)

_PLAN = ".meshnode-plan.json"
_MAX_SMALL = 256 << 20  # a "small file" bigger than this is not a config or tokenizer
_OUT_FILE_BYTES = 4 << 30


# ----------------------------------------------------------------------------------------------
# Client side


@dataclass
class FetchResult:
    path: Path  # the finished model folder
    total_bytes: int  # bytes of the stage's tensors and small files
    fetched_bytes: int  # bytes received from peers by this call (discarded ones included)
    reused_bytes: int  # verified bytes an earlier, interrupted call had already written
    by_peer: dict[str, int] = field(default_factory=dict)  # verified bytes per peer
    refetched: int = 0  # items fetched again after a bad or failed stream


def tty_progress(label: str = "fetch") -> Callable[[int, int], None] | None:
    """A progress callback drawing a bar on stderr when it is a terminal (else None)."""
    if not sys.stderr.isatty():
        return None
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < 0.2:
            return
        last[0] = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{label} [{bar:<30}] {frac:6.1%} {done / 2**20:,.1f}/{total / 2**20:,.1f} MiB")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


async def _manifests(
    peers: Sequence[tuple[str, grpc.aio.Channel]], model_id: str, timeout: float, metadata: Metadata | None
) -> list[tuple[str, mesh_pb2.ModelManifest]]:
    async def one(name: str, channel: grpc.aio.Channel) -> tuple[str, mesh_pb2.ModelManifest] | None:
        try:
            m = await mesh_pb2_grpc.MeshStub(channel).Manifest(
                mesh_pb2.ManifestRequest(model_id=model_id), timeout=timeout, metadata=metadata
            )
            validate_manifest(m, model_id)
            return name, m
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("peer %s: no manifest of %s: %s %s", name, model_id, e.code().name, e.details())
        except ValueError as e:
            log.warning("peer %s: invalid manifest of %s: %s", name, model_id, e)
        return None

    got = await asyncio.gather(*(one(n, c) for n, c in peers))
    return [g for g in got if g is not None]


def _choose(manifests: list[tuple[str, mesh_pb2.ModelManifest]], model_id: str) -> mesh_pb2.ModelManifest:
    """The digest held in full by the most peers (else by the most peers)."""
    if not manifests:
        raise FetchError(f"no peer holds model {model_id!r}")
    score: dict[str, tuple[int, int]] = {}
    for _, m in manifests:
        c, n = score.get(m.digest, (0, 0))
        score[m.digest] = (c + int(m.complete), n + 1)
    digest = max(score, key=lambda d: score[d])
    if len(score) > 1:
        log.warning("peers disagree on the content of %s; using digest %s…", model_id, digest[:12])
    full = [m for _, m in manifests if m.digest == digest and m.complete]
    if full:
        return full[0]
    # Only partial holders: the union of the tensors they list.
    merged = mesh_pb2.ModelManifest()
    merged.CopyFrom(next(m for _, m in manifests if m.digest == digest))
    seen = {t.name for f in merged.files for t in f.tensors}
    files = {f.path: f for f in merged.files}
    for _, m in manifests:
        if m.digest != digest:
            continue
        for f in m.files:
            for t in f.tensors:
                if t.name not in seen and f.path in files:
                    seen.add(t.name)
                    files[f.path].tensors.append(t)
    validate_manifest(merged, model_id)
    return merged


def _tensor_key(path: str, t: mesh_pb2.TensorEntry) -> str:
    """Peers hold "the same tensor" only if every field of its entry (range, digest, ...) agrees."""
    return f"{path}\0{t.SerializeToString(deterministic=True).hex()}"


def _held_layers(m: mesh_pb2.ModelManifest) -> set[int]:
    """The layer indices a manifest's ``layers_held`` names; malformed entries count for nothing."""
    out: set[int] = set()
    for r in m.layers_held[:10_000]:
        a, _, b = r.partition("-")
        if a.isdigit() and b.isdigit() and int(a) < int(b) <= 1_000_000:
            out.update(range(int(a), int(b)))
    return out


def _layout(tensors: list[tuple[str, mesh_pb2.TensorEntry]], max_bytes: int) -> dict[str, dict[str, Any]]:
    """Output safetensors files: name -> {"header": bytes-as-str, "tensors": [(tensor, out offset)]}."""
    groups: list[list[mesh_pb2.TensorEntry]] = []
    size = 0
    for _, t in tensors:
        if not groups or (size + t.length > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.length
    out = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
        pos = 0
        for t in group:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.length]}
            pos += t.length
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        base = 8 + len(raw)
        out[name] = {
            "header": raw.decode(),
            "size": base + pos,
            "tensors": [(t.name, base + header[t.name]["data_offsets"][0]) for t in group],
        }
    return out


def free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


async def _small_file(
    ref: mesh_pb2.ModelManifest,
    path: str,
    peers: dict[str, grpc.aio.Channel],
    holders: list[str],
    metadata: Metadata | None,
    timeout: float,
) -> bytes:
    """One small (non-weight) file of the model, fetched into memory and verified."""
    entry = next((f for f in ref.files if f.path == path), None)
    if entry is None or entry.size > _MAX_SMALL:
        raise FetchError(f"model {ref.model_id} has no usable {path}")
    for name in holders:
        try:
            data = bytearray()
            call = mesh_pb2_grpc.MeshStub(peers[name]).Fetch(
                mesh_pb2.FetchRequest(model_id=ref.model_id, path=path, offset=0, length=entry.size),
                metadata=metadata,
                timeout=timeout,
            )
            async for chunk in call:
                if chunk.offset != len(data) or len(data) + len(chunk.data) > entry.size:
                    raise ValueError("chunk out of place")
                data += chunk.data
            if hashlib.sha256(data).hexdigest() != entry.sha256:
                raise ValueError("sha256 mismatch")
            return bytes(data)
        except (grpc.aio.AioRpcError, ValueError) as e:
            log.warning("peer %s: %s of %s: %s", name, path, ref.model_id, e)
    raise FetchError(f"no peer supplied a valid {path} of {ref.model_id}")


async def _config_of(
    ref: mesh_pb2.ModelManifest,
    peers: dict[str, grpc.aio.Channel],
    holders: list[str],
    partial: Path,
    metadata: Metadata | None,
    timeout: float,
) -> dict[str, Any]:
    """config.json, read from an earlier partial folder or fetched into memory (verified)."""
    entry = next((f for f in ref.files if f.path == "config.json"), None)
    local = partial / "config.json"
    if entry is not None and local.is_file() and hashlib.sha256(local.read_bytes()).hexdigest() == entry.sha256:
        config: dict[str, Any] = json.loads(local.read_bytes())
        return config
    config = json.loads(await _small_file(ref, "config.json", peers, holders, metadata, timeout))
    return config


async def fetch_metadata(
    peers: Sequence[tuple[str, grpc.aio.Channel]],
    model_id: str,
    dest_dir: Path | str,
    *,
    timeout: float = 30.0,
    metadata: Metadata | None = None,
) -> Path:
    """Only the small files, with the whole manifest in the marker, so the model can be profiled
    before any weight arrives."""
    dest = Path(dest_dir)
    manifests = await _manifests(peers, model_id, timeout, metadata)
    ref = _choose(manifests, model_id)
    holders = [n for n, m in manifests if m.digest == ref.digest]
    small = [f for f in ref.files if not is_weight_file(f.path)]
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    n_layers = 0
    for f in small:
        data = await _small_file(ref, f.path, dict(peers), holders, metadata, timeout)
        if f.path == "config.json":
            n_layers = num_layers_of(json.loads(data))
        (partial / f.path).parent.mkdir(parents=True, exist_ok=True)
        (partial / f.path).write_bytes(data)
    _finish(partial, dest, {}, ref, model_id, 0, 0, n_layers)
    return dest


async def fetch_layers(
    peers: Sequence[tuple[str, grpc.aio.Channel]],
    model_id: str,
    start: int,
    end: int,
    dest_dir: Path | str,
    *,
    num_layers: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    streams_per_peer: int = 2,
    chunk_timeout: float = 30.0,
    max_peer_failures: int = 3,
    reserve_bytes: int = 64 << 20,
    max_file_bytes: int = _OUT_FILE_BYTES,
    metadata: Metadata | None = None,
) -> FetchResult:
    """Fetch layers [start, end) of ``model_id`` and its small files from ``peers`` ((name, channel)
    pairs) into ``dest_dir``. Raises :class:`DiskSpaceError` before downloading, :class:`FetchError`
    when no peer can supply something; cancelling leaves ``<dest>.partial`` to resume from."""
    dest = Path(dest_dir)
    partial = dest.with_name(dest.name + ".partial")
    if dest.exists() and not (dest / PARTIAL_MARKER).is_file():
        raise FetchError(f"{dest} exists and was not written by a transfer; not replacing it")
    channels = dict(peers)
    manifests = await _manifests(peers, model_id, chunk_timeout, metadata)
    ref = _choose(manifests, model_id)
    agree = [(n, m) for n, m in manifests if m.digest == ref.digest]
    full_peers = [n for n, m in agree if m.complete]
    n_layers = (
        num_layers
        if num_layers is not None
        else num_layers_of(await _config_of(ref, channels, [n for n, _ in agree], partial, metadata, chunk_timeout))
    )
    needed = tensors_for_layers(ref, start, end, n_layers)
    if not full_peers:  # partial holders only: their tensor lists say nothing about layers none holds
        covered = set().union(*(_held_layers(m) for _, m in agree))
        lacking_layers = [i for i in range(start, end) if i not in covered]
        if lacking_layers:
            raise FetchError(f"no peer holds layer(s) {lacking_layers} of {model_id}")
    small = [f for f in ref.files if not is_weight_file(f.path)]
    for f in small:
        if f.size > _MAX_SMALL:
            raise FetchError(f"{model_id}: {f.path} ({f.size} bytes) is too big for a config or tokenizer file")
    layout = _layout(needed, max_file_bytes)
    plan = {
        "model_id": model_id,
        "digest": ref.digest,
        "start": start,
        "end": end,
        "num_layers": n_layers,
        "files": {k: {"header": v["header"], "size": v["size"]} for k, v in layout.items()},
        "small": sorted(f.path for f in small),
    }

    marker = None
    try:
        marker = read_marker(dest)
    except (OSError, ValueError):
        pass
    total = sum(t.length for _, t in needed) + sum(f.size for f in small)
    if marker and marker.get("digest") == ref.digest and marker.get("start") == start and marker.get("end") == end:
        log.info("%s layers [%d, %d) already in %s", model_id, start, end, dest)
        return FetchResult(dest, total, 0, total)

    # Complete peers hold everything; a partial one the tensors it lists and every small file.
    tensor_holders: dict[str, list[str]] = {}
    for name, m in agree:
        for f in m.files:
            for t in f.tensors:
                tensor_holders.setdefault(_tensor_key(f.path, t), []).append(name)
    items: list[DownloadItem] = []
    by_name = {t.name: (p, t) for p, t in needed}
    for out, spec in layout.items():
        for tname, out_off in spec["tensors"]:
            p, t = by_name[tname]
            holders = tensor_holders.get(_tensor_key(p, t), [])
            items.append(DownloadItem(tname, p, t.offset, t.length, t.sha256, out, out_off, holders))
    for f in small:
        items.append(DownloadItem(f"file:{f.path}", f.path, 0, f.size, f.sha256, f.path, 0, [n for n, _ in agree]))
    lacking = [it.key for it in items if not it.peers]
    if lacking:
        raise FetchError(
            f"no peer holds {len(lacking)} tensor(s) of {model_id} layers [{start}, {end}): {', '.join(lacking[:5])}"
        )

    # Resume: the same plan keeps what an earlier call verified (checked again on disk).
    reused = 0
    old_plan = None
    try:
        old_plan = json.loads((partial / _PLAN).read_text())
    except (OSError, ValueError):
        pass
    if old_plan != plan and partial.exists():
        shutil.rmtree(partial)
    done_keys: set[str] = set()
    if old_plan == plan:
        try:
            lines = (partial / JOURNAL).read_text().splitlines()
        except OSError:
            lines = []
        journaled = {}
        for line in lines:
            try:
                rec = json.loads(line)
                journaled[rec["key"]] = rec["sha256"]
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line from a crash
        for it in items:
            if (
                journaled.get(it.key) == it.sha256
                and await asyncio.to_thread(hash_range, partial / it.out, it.out_offset, it.length) == it.sha256
            ):
                done_keys.add(it.key)
                reused += it.length
    todo = [it for it in items if it.key not in done_keys]

    headers = 0 if old_plan == plan else sum(len(v["header"]) + 8 for v in layout.values())
    need = sum(it.length for it in todo) + headers
    free = free_bytes(dest.parent)
    if need + reserve_bytes > free:
        raise DiskSpaceError(
            f"fetching layers [{start}, {end}) of {model_id} needs {need / 2**20:,.1f} MiB "
            f"(+{reserve_bytes / 2**20:,.0f} MiB reserve) in {dest.parent}, only "
            f"{free / 2**20:,.1f} MiB free"
        )

    partial.mkdir(parents=True, exist_ok=True)
    if old_plan != plan:
        for out, spec in layout.items():
            raw = spec["header"].encode()
            with open(partial / out, "wb") as f:
                f.write(len(raw).to_bytes(8, "little") + raw)
                f.truncate(spec["size"])
        (partial / JOURNAL).unlink(missing_ok=True)
        (partial / _PLAN).write_text(json.dumps(plan))
        fsync_dir(partial)

    log.info(
        "fetching %s layers [%d, %d): %.1f MiB to fetch, %.1f MiB already here, from %d peer(s) (%d complete)",
        model_id,
        start,
        end,
        sum(it.length for it in todo) / 2**20,
        reused / 2**20,
        len(agree),
        len(full_peers),
    )
    active = {n: channels[n] for n, _ in agree}
    transfer = Download(
        active,
        model_id,
        partial,
        todo,
        total,
        reused,
        on_progress,
        streams_per_peer,
        chunk_timeout,
        max_peer_failures,
        metadata,
    )
    if on_progress is not None:
        on_progress(reused, total)
    await transfer.run()
    _finish(partial, dest, layout, ref, model_id, start, end, n_layers)
    return FetchResult(dest, total, transfer.fetched, reused, transfer.by_peer, transfer.refetched)


def _finish(
    partial: Path,
    dest: Path,
    layout: dict[str, dict[str, Any]],
    ref: mesh_pb2.ModelManifest,
    model_id: str,
    start: int,
    end: int,
    n_layers: int,
) -> None:
    """Index, marker, then one rename: ``dest`` appears only complete."""
    weight_map = {name: out for out, spec in layout.items() for name, _ in spec["tensors"]}
    index = {
        "metadata": {"total_size": sum(spec["size"] for spec in layout.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (partial / INDEX_NAME).write_text(json.dumps(index, indent=2))
    marker = {
        "model_id": model_id,
        "digest": ref.digest,
        "start": start,
        "end": end,
        "num_layers": n_layers,
        "manifest": manifest_to_dict(mesh_pb2.ModelManifest(model_id=ref.model_id, digest=ref.digest, files=ref.files)),
    }
    (partial / PARTIAL_MARKER).write_text(json.dumps(marker))
    for out in layout:
        with open(partial / out, "rb") as f:
            os.fsync(f.fileno())
    (partial / JOURNAL).unlink(missing_ok=True)
    (partial / _PLAN).unlink(missing_ok=True)
    fsync_dir(partial)
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(dest, old)
    os.replace(partial, dest)
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    log.info("%s layers [%d, %d) ready in %s", model_id, start, end, dest)
