"""Models for peers: :class:`ModelStore` answers ``Manifest`` and ``Fetch`` for the models this
node holds, complete or in part. Nothing outside the manifest's files is ever opened."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from meshnode.errors import abort
from meshnode.proto import mesh_pb2
from meshnode.weights.manifest import (
    build_manifest,
    cached_folders,
    is_weight_file,
    layers_held,
    manifest_from_dict,
    read_marker,
    safe_relpath,
)
from meshnode.weights.weightfiles import read_safetensors_header, weight_files

__all__ = ["CHUNK", "ModelStore"]

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # bytes per Fetch message


@dataclass
class _Held:
    """One local model folder served to peers."""

    path: Path
    manifest: mesh_pb2.ModelManifest
    files: dict[str, mesh_pb2.FileEntry]  # by path
    # Partial folders: per original path, sorted (offset, length, local file, local offset).
    spans: dict[str, list[tuple[int, int, Path, int]]] | None = None

    def locate(self, rel: str, offset: int, length: int) -> tuple[Path, int, int] | None:
        """(local file, local offset, expected local file size or -1) of a byte range, or None."""
        entry = self.files[rel]
        if self.spans is None:
            return self.path / rel, offset, entry.size
        if not is_weight_file(rel):
            local = self.path / rel
            return (local, offset, entry.size) if local.is_file() else None
        for start, n, local, local_off in self.spans.get(rel, ()):
            if start <= offset and offset + length <= start + n:
                return local, local_off + offset - start, -1
        return None


class ModelStore:
    """The models this node can serve to peers: ``local_models`` (id -> complete folder) and the
    folders under ``cache_root``. Manifests are hashed once, in a thread, on first request."""

    def __init__(
        self,
        cache_root: Path | str | None = None,
        local_models: Mapping[str, Path | str] | None = None,
        *,
        chunk_size: int = CHUNK,
    ):
        self.cache_root = Path(cache_root) if cache_root else None
        self.chunk_size = int(chunk_size)
        self._paths: dict[str, Path] = {k: Path(v) for k, v in (local_models or {}).items()}
        self._held: dict[str, _Held] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def add(self, model_id: str, path: Path | str) -> None:
        """Serve ``path`` as ``model_id``."""
        self._paths[model_id] = Path(path)
        self._held.pop(model_id, None)

    def _scan(self) -> None:
        if self.cache_root is None:
            return
        for d, marker in cached_folders(self.cache_root):
            if marker is not None and isinstance(marker.get("model_id"), str):
                self._paths.setdefault(marker["model_id"], d)
            elif (d / "config.json").is_file():
                self._paths.setdefault(d.name, d)

    def path_of(self, model_id: str) -> Path | None:
        return self._paths.get(model_id)

    def model_ids(self) -> list[str]:
        """Every model held, in full or in part."""
        self._scan()
        return sorted(self._paths)

    async def held(self, model_id: str) -> _Held | None:
        if model_id not in self._paths:
            self._scan()
        path = self._paths.get(model_id)
        if path is None:
            return None
        lock = self._locks.setdefault(model_id, asyncio.Lock())
        async with lock:
            if model_id not in self._held:
                self._held[model_id] = await asyncio.to_thread(self._load, model_id, path)
            return self._held[model_id]

    @staticmethod
    def _load(model_id: str, path: Path) -> _Held:
        marker = read_marker(path)
        if marker is None:
            m = build_manifest(path, model_id)
            m.layers_held.extend(f"{a}-{b}" for a, b in layers_held(path))
            m.complete = True
            return _Held(path, m, {f.path: f for f in m.files})
        original = manifest_from_dict(marker["manifest"])
        files = {f.path: f for f in original.files}
        local: dict[str, tuple[Path, int]] = {}  # tensor name -> (local file, local offset)
        for wf in weight_files(path):
            with open(wf, "rb") as f:
                header_len = 8 + int.from_bytes(f.read(8), "little")
            for name, info in read_safetensors_header(wf).items():
                local[name] = (wf, header_len + int(info["data_offsets"][0]))
        m = mesh_pb2.ModelManifest(model_id=model_id, digest=original.digest, complete=False)
        spans: dict[str, list[tuple[int, int, Path, int]]] = {}
        for f in original.files:
            entry = m.files.add()
            entry.CopyFrom(f)
            del entry.tensors[:]
            for t in f.tensors:
                if t.name in local:
                    entry.tensors.append(t)
                    spans.setdefault(f.path, []).append((t.offset, t.length, *local[t.name]))
        m.layers_held.extend(f"{a}-{b}" for a, b in layers_held(path))
        return _Held(path, m, files, spans)

    async def Manifest(
        self, request: mesh_pb2.ManifestRequest, context: grpc.aio.ServicerContext
    ) -> mesh_pb2.ModelManifest:
        held = await self.held(request.model_id)
        if held is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"model {request.model_id!r} is not held here")
        return held.manifest

    async def Fetch(
        self, request: mesh_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[mesh_pb2.Chunk]:
        """Stream bytes [offset, offset + length) of one listed file (length 0: to its end)."""
        held = await self.held(request.model_id)
        if held is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"model {request.model_id!r} is not held here")
        rel = safe_relpath(request.path)
        if rel is None:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"refused path {request.path[:200]!r}")
        entry = held.files.get(rel)
        if entry is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"{rel!r} is not a file of model {request.model_id!r}")
        offset = request.offset
        length = request.length or max(entry.size - offset, 0)
        if offset > entry.size or offset + length > entry.size:
            await abort(
                context,
                grpc.StatusCode.OUT_OF_RANGE,
                f"{rel}: bytes [{offset}, {offset + length}) outside its {entry.size} bytes",
            )
        where = held.locate(rel, offset, length)
        if where is None:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"{rel}: bytes [{offset}, {offset + length}) not held here")
        local, local_off, expect = where
        try:
            f = open(local, "rb")
        except OSError as e:
            await context.abort(grpc.StatusCode.DATA_LOSS, f"{rel}: cannot open: {e.strerror}")
        with f:
            if expect >= 0 and os.fstat(f.fileno()).st_size != expect:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{rel} changed since its manifest")
            f.seek(local_off)
            done = 0
            while done < length:
                data = await asyncio.to_thread(f.read, min(self.chunk_size, length - done))
                if not data:
                    await context.abort(grpc.StatusCode.DATA_LOSS, f"{rel}: file ends before its manifest says")
                yield mesh_pb2.Chunk(offset=offset + done, data=data)
                done += len(data)
