"""The prompt cache on disk: kept prefixes' KV written under the cache folder, read back on a miss.

A stage writes the KV of its layers for every prefix it keeps (meshnode.model.prefixes) to
``<root>/<model>/<key>/layers-<start>-<end>.safetensors``, in mlx-lm's prompt cache format
(:func:`mlx_lm.models.cache.save_prompt_cache`) with the key, the layer range and the positions in
its metadata. A head writes the prefix's tokens beside it (``tokens.npy``), so that its index
(meshnode.serving.promptcache) is rebuilt after a restart. Writes run on a thread of their own,
after the answer has ended.

A prefix no longer in memory is read back from the entries whose layer ranges cover the layers a
stage holds now, so a re-plan that moves layers keeps the cache. The folder is bounded by size,
least recently used prefix out first. An entry that cannot be read, or whose metadata does not
match its name, is deleted and never used.
"""

from __future__ import annotations

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
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

log = logging.getLogger(__name__)

Layers = tuple[int, int]
ENTRY = re.compile(r"layers-(\d+)-(\d+)\.safetensors")
TOKENS = "tokens.npy"
FORMAT = "1"  # the metadata's "format": entries of another format are not read


def model_folder(model: str) -> str:
    """A folder name for a model id (ids may hold slashes and colons)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("._") or "model"


class PrefixDisk:
    """Kept prefixes on this node's disk, for one model; writes are queued, reads are synchronous."""

    def __init__(self, root: Path, model: str, limit: int,
                 on_write: Callable[[int], None] | None = None):
        """``root``: the prompt cache folder, shared by every model (``limit`` bytes bound all of
        it); ``on_write``: told the bytes of each entry written."""
        self.root = Path(root)
        self.folder = self.root / model_folder(model)
        self.limit = int(limit)
        self._on_write = on_write
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._pending: dict[str, int] = {}  # keys queued for writing: how many writes
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._write_loop, name="meshnode-prompt-disk", daemon=True)
        self._thread.start()

    # -- writing
    def keep(self, key: str, layers: Layers, caches: list[Any], positions: int) -> None:
        """Queue the write of ``caches`` (the evaluated caches of ``layers``, holding ``positions``)."""
        metadata = {"format": FORMAT, "key": key, "layers": f"{layers[0]},{layers[1]}", "positions": str(positions)}
        self._queue_write(key, lambda: self._write_entry(key, layers, caches, metadata))

    def keep_tokens(self, key: str, tokens: Sequence[int]) -> None:
        """Queue the write of the tokens a head asked its stages to keep under ``key``."""
        array = np.asarray(tokens, dtype=np.int32)
        self._queue_write(key, lambda: self._write_tokens(key, array))

    def holds(self, key: str) -> bool:
        """Whether ``key`` is on disk here or queued to be."""
        with self._lock:
            if key in self._pending:
                return True
        return (self.folder / key).is_dir()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write queued so far is done; whether it was within ``timeout``."""
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _queue_write(self, key: str, write: Callable[[], None]) -> None:
        with self._lock:
            self._pending[key] = self._pending.get(key, 0) + 1

        def run() -> None:
            try:
                write()
            finally:
                with self._lock:
                    self._pending[key] -= 1
                    if not self._pending[key]:
                        del self._pending[key]

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
        path = self.folder / key / f"layers-{layers[0]}-{layers[1]}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{uuid.uuid4().hex}.safetensors")
        try:
            save_prompt_cache(str(tmp), caches, metadata)
            os.replace(tmp, path)
            _touch(path)
        finally:
            tmp.unlink(missing_ok=True)
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
        """The caches of ``layers`` kept under ``key`` with at least ``positions`` positions, read
        from the entries that cover them, and evaluated; or None and why not. ``templates``: the
        caches the stage makes for those layers now (an entry of other kinds is not used)."""
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
        try:
            caches, metadata = load_prompt_cache(str(path), return_metadata=True)
            mx.eval([c.state for c in caches])
        except Exception as exc:  # truncated, corrupt, or not an entry at all
            log.warning("prompt cache: deleted %s, which could not be read: %s", path, exc)
            path.unlink(missing_ok=True)
            return None, f"{path.name} could not be read"
        expected = {"format": FORMAT, "key": key, "layers": f"{layers[0]},{layers[1]}"}
        if any(metadata.get(k) != v for k, v in expected.items()) or len(caches) != layers[1] - layers[0]:
            log.warning("prompt cache: deleted %s, whose metadata does not match its name", path)
            path.unlink(missing_ok=True)
            return None, f"{path.name} is not the entry its name says"
        if int(metadata.get("positions", 0)) < positions:
            return None, f"{metadata.get('positions')} positions on disk, {positions} asked"
        return caches, ""

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
            except Exception as exc:
                log.warning("prompt cache: deleted %s, which could not be read: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            out.append((key, tokens.astype(np.int64)))
        return out


def _dirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir()]
    except FileNotFoundError:
        return []


_last_stamp = 0
_stamp_lock = threading.Lock()


def _touch(path: Path) -> None:
    """Mark ``path`` used now: strictly after every other use this process marked, since the
    kernel's file clock ticks in milliseconds and the order of uses decides what goes first."""
    global _last_stamp
    with _stamp_lock:
        _last_stamp = max(time.time_ns(), _last_stamp + 1000)
        stamp = _last_stamp
    try:
        os.utime(path, ns=(stamp, stamp))
    except FileNotFoundError:
        pass
