"""The prompt cache on disk: each stage writes its layers' KV of every kept prefix (mlx-lm's prompt
cache format) on a writer thread; a miss reads back the entries covering the layers held now, so a
re-plan keeps the cache. Bounded by size, least recently used out first; an unreadable or
mismatched entry is deleted, never used."""

from __future__ import annotations

import copy
import logging
import os
import queue
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache, load_prompt_cache, save_prompt_cache

log = logging.getLogger(__name__)

Layers = tuple[int, int]
ENTRY = re.compile(r"layers-(\d+)-(\d+)\.safetensors")
TOKENS = "tokens.npy"
FORMAT = "1"  # entries of another format are not read


def model_folder(model: str) -> str:
    """A folder name for a model id (ids may hold slashes and colons)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("._") or "model"


class PrefixDisk:
    """One model's kept prefixes on this node's disk; writes are queued, reads synchronous."""

    def __init__(self, root: Path, model: str, limit: int, on_write: Callable[[int], None] | None = None):
        """``root``: shared by every model; ``limit`` bytes bound all of it."""
        self.root = Path(root)
        self.folder = self.root / model_folder(model)
        self.limit = int(limit)
        self._on_write = on_write
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._pending: dict[tuple[str, Layers], int] = {}  # entries queued for writing: how many writes
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._write_loop, name="meshnode-prompt-disk", daemon=True)
        self._thread.start()

    # -- writing
    def keep(
        self, key: str, layers: Layers, caches: list[Any], positions: int, parent: tuple[str, int] | None = None
    ) -> None:
        """Queue the write of ``layers``' evaluated caches. With ``parent`` (key, positions) on disk,
        only the positions after it are written, as an entry naming it."""
        metadata = {"format": FORMAT, "key": key, "layers": f"{layers[0]},{layers[1]}", "positions": str(positions)}
        if (
            parent is not None
            and 0 < parent[1] < positions
            and self.holds(parent[0], layers)
            and all(type(c) in SEGMENTS for c in caches)
        ):
            caches = [_after(c, parent[1]) for c in caches]  # on the caller's (MLX) thread
            mx.eval([c.state for c in caches])
            metadata.update(parent=parent[0], start=str(parent[1]))
        self._queue_write(key, layers, lambda: self._write_entry(key, layers, caches, metadata))

    def holds(self, key: str, layers: Layers) -> bool:
        """Whether ``key``'s entry for ``layers`` is on disk or queued (writes run in order)."""
        with self._lock:
            if (key, layers) in self._pending:
                return True
        return self._entry(key, layers).is_file()

    def _entry(self, key: str, layers: Layers) -> Path:
        return self.folder / key / f"layers-{layers[0]}-{layers[1]}.safetensors"

    def keep_tokens(self, key: str, tokens: Sequence[int]) -> None:
        """Queue the write of the tokens kept under ``key``."""
        array = np.asarray(tokens, dtype=np.int32)
        self._queue.put(lambda: self._write_tokens(key, array))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every write queued so far; whether it was within ``timeout``."""
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _queue_write(self, key: str, layers: Layers, write: Callable[[], None]) -> None:
        entry = (key, layers)
        with self._lock:
            self._pending[entry] = self._pending.get(entry, 0) + 1

        def run() -> None:
            try:
                write()
            finally:
                with self._lock:
                    self._pending[entry] -= 1
                    if not self._pending[entry]:
                        del self._pending[entry]

        self._queue.put(run)

    def _write_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                job()
            except Exception:  # a full or read-only disk costs the disk cache, never the node
                log.exception("prompt cache: a write to %s failed", self.folder)

    def _write_entry(self, key: str, layers: Layers, caches: list[Any], metadata: dict[str, str]) -> None:
        nbytes = sum(getattr(c, "nbytes", 0) for c in caches)
        if nbytes > self.limit:
            log.debug("prompt cache: %s (%d bytes) is larger than prompt_cache_disk", key, nbytes)
            return
        self._make_room(nbytes)
        path = self._entry(key, layers)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{uuid.uuid4().hex}.safetensors")
        try:
            save_prompt_cache(str(tmp), caches, metadata)
            os.replace(tmp, path)
            _touch(path)
        finally:
            tmp.unlink(missing_ok=True)
        if "parent" in metadata:  # a parent is used as long as its children are
            _touch(self._entry(metadata["parent"], layers))
        written = path.stat().st_size
        log.debug("prompt cache: wrote %s of layers %s (%d bytes)", key, layers, written)
        if self._on_write is not None:
            self._on_write(written)

    def _write_tokens(self, key: str, tokens: np.ndarray) -> None:
        path = self.folder / key / TOKENS
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{uuid.uuid4().hex}.npy")
        try:
            np.save(tmp, tokens, allow_pickle=False)
            os.replace(tmp, path)
            _touch(path)
        finally:
            tmp.unlink(missing_ok=True)

    def _make_room(self, nbytes: int) -> None:
        """Delete least recently used prefixes (of any model) until ``nbytes`` more fit the limit."""
        entries = []
        for folder in (p for model in _dirs(self.root) for p in _dirs(model)):
            files = [f for f in folder.iterdir() if f.is_file()]
            stats = [f.stat() for f in files]
            entries.append((max((s.st_mtime for s in stats), default=0.0), sum(s.st_size for s in stats), folder))
        total = sum(size for _, size, _ in entries)
        for _, size, folder in sorted(entries, key=lambda e: e[0]):
            if total + nbytes <= self.limit:
                break
            shutil.rmtree(folder, ignore_errors=True)
            total -= size
            log.debug("prompt cache: removed %s from disk for room (%d bytes)", folder.name, size)

    # -- reading
    def load(self, key: str, layers: Layers, positions: int, templates: list[Any]) -> tuple[list[Any] | None, str]:
        """``layers``' caches kept under ``key`` with at least ``positions``, evaluated; or (None, why
        not). An entry of other kinds than ``templates`` is not used."""
        folder = self.folder / key
        ranges = {}
        for path in folder.glob("layers-*.safetensors"):
            match = ENTRY.fullmatch(path.name)
            if match:
                ranges[(int(match[1]), int(match[2]))] = path
        caches: list[Any] = []
        layer = layers[0]
        while layer < layers[1]:
            covering = [r for r in ranges if r[0] <= layer < r[1]]
            if not covering:
                return None, f"layer {layer} is not on disk here"
            start, end = max(covering, key=lambda r: r[1])
            read, why = self._read(ranges[(start, end)], key, (start, end), positions)
            if read is None:
                return None, why
            upto = min(end, layers[1])
            caches.extend(read[layer - start : upto - start])
            layer = upto
        for cache, template in zip(caches, templates, strict=True):
            if type(cache) is not type(template) or getattr(cache, "bits", None) != getattr(template, "bits", None):
                return None, f"kept as {type(cache).__name__}, the stage makes {type(template).__name__}"
        for path in [*ranges.values(), folder / TOKENS]:
            _touch(path)
        return caches, ""

    def _read(self, path: Path, key: str, layers: Layers, positions: int) -> tuple[list[Any] | None, str]:
        """The caches of the entry at ``path``, joined after those of the entries it extends."""
        segments: list[tuple[list[Any], int]] = []  # (caches, first position), newest first
        read: list[Path] = []
        while True:
            caches, metadata, why = self._read_one(path, key, layers)
            if caches is None:
                for child in read:  # an entry whose parent is gone can never be read again
                    child.unlink(missing_ok=True)
                return None, why
            start, held = int(metadata.get("start", 0)), int(metadata["positions"])
            if held < positions:
                return None, f"{held} positions on disk, {positions} asked"
            segments.append((caches, start))
            read.append(path)
            parent = metadata.get("parent")
            if parent is None:
                break
            if len(segments) >= MAX_CHAIN or not _is_key(parent):
                return None, f"{path.name} extends an entry too far back"
            path, key, positions = self._entry(parent, layers), parent, start
        for p in read[1:]:
            _touch(p)
        segments.reverse()
        if len(segments) == 1:
            return segments[0][0], ""
        ends = [start for _, start in segments[1:]]
        return [
            _joined([caches[i] for caches, _ in segments], [s for _, s in segments], ends)
            for i in range(len(segments[0][0]))
        ], ""

    def _read_one(self, path: Path, key: str, layers: Layers) -> tuple[list[Any] | None, dict[str, str], str]:
        try:
            caches, metadata = load_prompt_cache(str(path), return_metadata=True)
            mx.eval([c.state for c in caches])
            start, held = int(metadata.get("start", 0)), int(metadata.get("positions", 0))
        except Exception as exc:  # noqa: BLE001 - truncated, corrupt, or not an entry at all: deleted
            log.warning("prompt cache: deleted %s, which could not be read: %s", path, exc)
            path.unlink(missing_ok=True)
            return None, {}, f"{path.name} could not be read"
        expected = {"format": FORMAT, "key": key, "layers": f"{layers[0]},{layers[1]}"}
        if (
            any(metadata.get(k) != v for k, v in expected.items())
            or len(caches) != layers[1] - layers[0]
            or not 0 <= start < held
            or any(getattr(c, "offset", held - start) != held - start for c in caches)
        ):
            log.warning("prompt cache: deleted %s, whose metadata does not match its name", path)
            path.unlink(missing_ok=True)
            return None, {}, f"{path.name} is not the entry its name says"
        return caches, metadata, ""

    def discard(self, key: str) -> None:
        """Delete everything kept under ``key`` here."""
        shutil.rmtree(self.folder / key, ignore_errors=True)

    def recent_tokens(self, entries: int) -> list[tuple[str, np.ndarray]]:
        """The ``entries`` prefixes most recently kept or used, oldest first: (key, tokens)."""
        found = []
        for folder in _dirs(self.folder):
            path = folder / TOKENS
            if path.is_file():
                found.append((path.stat().st_mtime, folder.name, path))
        out = []
        for _, key, path in sorted(found)[-entries:] if entries > 0 else []:
            try:
                tokens = np.load(path, allow_pickle=False)
                if tokens.ndim != 1 or tokens.dtype.kind != "i":
                    raise ValueError(f"{tokens.dtype} tokens of shape {tokens.shape}")
            except Exception as exc:  # noqa: BLE001 - whatever the file holds, it is deleted, never the node's end
                log.warning("prompt cache: deleted %s, which could not be read: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            out.append((key, tokens.astype(np.int64)))
        return out


# The caches whose positions can be written as segments and joined again: plain and quantized KV.
SEGMENTS = (KVCache, QuantizedKVCache)
MAX_CHAIN = 1000  # entries one read may join (a conversation's turns)


def _is_key(name: str) -> bool:
    return bool(re.fullmatch(r"[0-9a-f]{1,64}", name))


def _after(cache: Any, start: int) -> Any:
    """A cache holding ``cache``'s positions from ``start`` on (lazy slices)."""
    out = copy.copy(cache)
    cut = lambda a: a[..., start : cache.offset, :]  # noqa: E731
    out.keys, out.values = tree_map(cut, cache.keys), tree_map(cut, cache.values)
    out.offset = cache.offset - start
    return out


def _joined(segments: list[Any], starts: list[int], ends: list[int]) -> Any:
    """One layer's cache from its segments: each one's positions from its start to the next's."""
    out = copy.copy(segments[-1])
    lengths = [end - start for start, end in zip(starts, ends)] + [segments[-1].offset]

    def join(*arrays: mx.array) -> mx.array:
        return mx.concatenate([a[..., :n, :] for a, n in zip(arrays, lengths)], axis=2)

    out.keys = tree_map(join, *[c.keys for c in segments])
    out.values = tree_map(join, *[c.values for c in segments])
    out.offset = starts[-1] + segments[-1].offset
    mx.eval(out.state)
    return out


def _dirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir()]
    except FileNotFoundError:
        return []


_last_stamp = 0
_stamp_lock = threading.Lock()


def _touch(path: Path) -> None:
    """Mark ``path`` used strictly after every other use here: the file clock ticks in ms, and the
    order of uses decides what goes first."""
    global _last_stamp
    with _stamp_lock:
        _last_stamp = max(time.time_ns(), _last_stamp + 1000)
        stamp = _last_stamp
    try:
        os.utime(path, ns=(stamp, stamp))
    except FileNotFoundError:
        pass
