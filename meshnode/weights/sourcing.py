"""Where a node's layers come from when its disk lacks them: peers first, the Hub as a fallback."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from meshnode.weights.holdings import Holding
from meshnode.weights.hub import hub_layers, is_hub_id
from meshnode.weights.manifest import (
    cached_folders,
    folder_name,
    layers_held,
    read_marker,
)
from meshnode.weights.store import ModelStore
from meshnode.weights.transfer import DiskSpaceError, FetchError, fetch_layers, fetch_metadata

log = logging.getLogger(__name__)


def covers(model_dir: Path, start: int, end: int) -> bool:
    """Whether ``model_dir`` holds every tensor of layers [start, end) and what they need."""
    try:
        marker = read_marker(model_dir)
    except (OSError, ValueError):
        return False
    if marker is None:
        return (model_dir / "config.json").is_file()  # a complete mlx-lm folder
    first: int = marker.get("start", 0)
    last: int = marker.get("end", -1)
    return first <= start and end <= last


def cached_metadata(cache_root: Path, model_id: str) -> Path | None:
    """The folder fetched earlier for ``model_id`` with the most layers, or None."""
    best, best_n = None, -1
    for d, marker in cached_folders(cache_root):
        if marker is not None and marker.get("model_id") == model_id and marker["end"] - marker["start"] > best_n:
            best, best_n = d, marker["end"] - marker["start"]
    return best


async def metadata_from_peers(
    model_id: str,
    cache_root: Path,
    candidates: Callable[[], Sequence[tuple[str, object]]],
    deadline_s: float,
    poll_s: float = 1.0,
) -> Path:
    """Fetch ``model_id``'s small files from a peer, waiting up to ``deadline_s``; else FetchError."""
    import asyncio

    dest = cache_root / folder_name(model_id, 0, 0)
    cache_root.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + deadline_s
    said = 0.0
    while True:
        peers = list(candidates())
        if peers:
            try:
                return await fetch_metadata(peers, model_id, dest, timeout=10.0)
            except FetchError as exc:
                reason = str(exc)
        else:
            reason = "no peer known yet"
        if time.monotonic() > end:
            raise FetchError(
                f"model {model_id!r} is not on this disk and no peer supplied it in {deadline_s:.0f} s ({reason})"
            )
        if time.monotonic() - said > 15:
            log.info("model %s is not on this disk; waiting for a peer that holds it (%s)", model_id, reason)
            said = time.monotonic()
        await asyncio.sleep(poll_s)


def holdings_of(store: ModelStore) -> tuple[Holding, ...]:
    """Every model folder the store serves, with its layer ranges."""
    out = []
    for model_id in store.model_ids()[:16]:
        path = store.path_of(model_id)
        assert path is not None, "model_ids() lists the models held"
        try:
            ranges = tuple(layers_held(path))
            complete = read_marker(path) is None
        except (OSError, ValueError) as exc:
            log.warning("not announcing %s: %s", path, exc)
            continue
        out.append((model_id, complete, tuple(r for r in ranges if r[0] < r[1])[:64]))
    return tuple(out)


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
    """``fn``, called from any thread, runs on ``loop``."""

    def call(done: int, total: int) -> None:
        loop.call_soon_threadsafe(fn, done, total)

    return call


class LayerSource:
    """Folders holding a layer range of one model, fetched from peers when missing."""

    def __init__(self, model_id: str, model_path: Path, cache_root: Path, store: ModelStore, num_layers: int):
        self.model_id = model_id
        self.model_path = Path(model_path)
        self.cache_root = Path(cache_root)
        self.store = store
        self.num_layers = num_layers

    def local(self, start: int, end: int) -> Path | None:
        if covers(self.model_path, start, end):
            return self.model_path
        for d, marker in cached_folders(self.cache_root):
            if marker is not None and marker.get("model_id") == self.model_id and covers(d, start, end):
                return d
        return None

    async def folder(
        self,
        start: int,
        end: int,
        peers: Sequence[tuple[str, object]],
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Path:
        """A folder holding layers [start, end): local, else from ``peers``, else from the Hub."""
        path = self.local(start, end)
        if path is not None:
            return path
        dest = self.cache_root / folder_name(self.model_id, start, end)
        self.cache_root.mkdir(parents=True, exist_ok=True)
        if peers:
            try:
                result = await fetch_layers(
                    peers, self.model_id, start, end, dest, num_layers=self.num_layers, on_progress=on_progress
                )
            except DiskSpaceError:
                raise
            except FetchError as exc:
                if not is_hub_id(self.model_id):
                    raise
                log.info(
                    "peers cannot supply layers [%d, %d) of %s (%s); downloading them from Hugging Face",
                    start,
                    end,
                    self.model_id,
                    exc,
                )
                dest = await self._from_hub(start, end, on_progress)
            else:
                log.info(
                    "fetched layers [%d, %d) of %s: %.1f MiB from peers %s, %.1f MiB resumed, %d refetched",
                    start,
                    end,
                    self.model_id,
                    result.fetched_bytes / 2**20,
                    {k: round(v / 2**20, 1) for k, v in result.by_peer.items()},
                    result.reused_bytes / 2**20,
                    result.refetched,
                )
        elif not is_hub_id(self.model_id):  # wait for a peer (the caller tries again)
            raise FetchError(f"no live peer announces layers of {self.model_id} yet")
        else:
            log.info("no peer holds %s; downloading layers [%d, %d) from Hugging Face", self.model_id, start, end)
            dest = await self._from_hub(start, end, on_progress)
        self.store.add(self.model_id, dest)
        return dest

    async def _from_hub(self, start: int, end: int, on_progress: Callable[[int, int], None] | None) -> Path:
        loop = asyncio.get_running_loop()
        report = None if on_progress is None else _on_loop(loop, on_progress)
        return await asyncio.to_thread(
            hub_layers, self.model_id, start, end, self.cache_root, metadata=self.model_path, on_progress=report
        )
