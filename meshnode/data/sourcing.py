"""Where a node's layers come from when its disk lacks them: peers first, the Hub as a fallback.

:class:`LayerSource` is what the node asks for "a folder holding layers [start, end) of the served
model". The local model folder answers when it covers them; else a folder fetched earlier into
``<cache>/peer-models/`` (resumed if a transfer was interrupted); else the tensors are fetched
from the live peers that announce the model (:func:`meshnode.data.transfer.fetch_layers`); with
no peer holding them, from Hugging Face (:func:`hub_layers`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from meshnode.data.holdings import Holding
from meshnode.data.manifest import INDEX_NAME, layers_held, num_layers_of, read_marker
from meshnode.data.transfer import FetchError, ModelStore, fetch_layers, fetch_metadata

log = logging.getLogger(__name__)


def folder_name(model_id: str, start: int, end: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '_', model_id)[:120]}-{start}-{end}"


def covers(model_dir: Path, start: int, end: int) -> bool:
    """Whether ``model_dir`` holds every tensor of layers [start, end) (and the embedding/head
    those layers need: a transfer's folder always holds them for its own range)."""
    try:
        marker = read_marker(model_dir)
    except (OSError, ValueError):
        return False
    if marker is None:
        return (model_dir / "config.json").is_file()  # a complete mlx-lm folder
    return marker.get("start", 0) <= start and end <= marker.get("end", -1)


def cached_metadata(cache_root: Path, model_id: str) -> Path | None:
    """A folder fetched earlier for ``model_id`` (its layers or its metadata only), the one with
    the most layers, or None."""
    best, best_n = None, -1
    if cache_root.is_dir():
        for d in sorted(cache_root.iterdir()):
            if not d.is_dir() or d.name.endswith(".partial"):
                continue
            try:
                marker = read_marker(d)
            except (OSError, ValueError):
                continue
            if marker is not None and marker.get("model_id") == model_id and marker["end"] - marker["start"] > best_n:
                best, best_n = d, marker["end"] - marker["start"]
    return best


async def metadata_from_peers(model_id: str, cache_root: Path, candidates: Callable[[], Sequence[tuple[str, object]]],
                              deadline_s: float, poll_s: float = 1.0) -> Path:
    """Wait (up to ``deadline_s``) for peers holding ``model_id`` and fetch its small files (config,
    tokenizer, chat template) into ``<cache_root>/<id>-0-0``; ``candidates()`` lists (name, channel)
    pairs of the peers known now. Raises FetchError when none answered in time."""
    import asyncio
    import time

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
            raise FetchError(f"model {model_id!r} is not on this disk and no peer supplied it in "
                             f"{deadline_s:.0f} s ({reason})")
        if time.monotonic() - said > 15:
            log.info("model %s is not on this disk; waiting for a peer that holds it (%s)", model_id, reason)
            said = time.monotonic()
        await asyncio.sleep(poll_s)


def holdings_of(store: ModelStore) -> tuple[Holding, ...]:
    """What this node announces: every model folder its store serves, with its layer ranges."""
    out = []
    for model_id in store.model_ids()[:16]:
        path = store.path_of(model_id)
        try:
            ranges = tuple(layers_held(path))
            complete = read_marker(path) is None
        except (OSError, ValueError) as exc:
            log.warning("not announcing %s: %s", path, exc)
            continue
        out.append((model_id, complete, tuple(r for r in ranges if r[0] < r[1])[:64]))
    return tuple(out)


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
        if self.cache_root.is_dir():
            for d in sorted(self.cache_root.iterdir()):
                if d.is_dir() and not d.name.endswith(".partial") and covers(d, start, end):
                    try:
                        if read_marker(d).get("model_id") == self.model_id:
                            return d
                    except (OSError, ValueError, AttributeError):
                        continue
        return None

    async def folder(self, start: int, end: int, peers: Sequence[tuple[str, object]],
                     on_progress: Callable[[int, int], None] | None = None) -> Path:
        """A folder holding layers [start, end): local, else fetched from ``peers`` ((name,
        channel) pairs of live peers that announce the model), else from the Hub."""
        path = self.local(start, end)
        if path is not None:
            return path
        dest = self.cache_root / folder_name(self.model_id, start, end)
        self.cache_root.mkdir(parents=True, exist_ok=True)
        if peers:
            result = await fetch_layers(peers, self.model_id, start, end, dest, num_layers=self.num_layers,
                                        on_progress=on_progress)
            log.info("fetched layers [%d, %d) of %s: %.1f MiB from peers %s, %.1f MiB resumed, %d refetched",
                     start, end, self.model_id, result.fetched_bytes / 2**20,
                     {k: round(v / 2**20, 1) for k, v in result.by_peer.items()}, result.reused_bytes / 2**20,
                     result.refetched)
        elif self.model_id.count("/") != 1:  # not a Hub id: wait for a peer (the caller tries again)
            raise FetchError(f"no live peer announces layers of {self.model_id} yet")
        else:
            log.info("no peer holds %s; downloading layers [%d, %d) from Hugging Face", self.model_id, start, end)
            dest = await asyncio.to_thread(hub_layers, self.model_id, start, end)
        self.store.add(self.model_id, dest)
        return dest


def hub_layers(model_id: str, start: int, end: int) -> Path:
    """Internet download of only the safetensors files that hold layers [start, end), as the
    model's ``model.safetensors.index.json`` maps them, plus its config/tokenizer files.

    Not exercised by the tests: these machines cannot reach the Hub. It downloads whole files
    (the Hub serves files, not tensors), so a stage gets the shards its layers live in, not only
    its own tensors; the folder is an ordinary mlx-lm folder that Shard loads.
    """
    from huggingface_hub import hf_hub_download, snapshot_download

    from meshnode.modelsource import HUB_PATTERNS

    small = [p for p in HUB_PATTERNS if not p.endswith(".safetensors")]
    base = Path(snapshot_download(model_id, allow_patterns=small))
    index_file = base / INDEX_NAME
    if not index_file.is_file():  # one weight file: it holds every layer
        return Path(snapshot_download(model_id, allow_patterns=HUB_PATTERNS))
    weight_map = json.loads(index_file.read_text())["weight_map"]
    n = num_layers_of(json.loads((base / "config.json").read_text()))
    files = set()
    for name, fname in weight_map.items():
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m is None or start <= int(m.group(1)) < end or not 0 <= int(m.group(1)) < n:
            files.add(fname)  # embeddings, norm and head files are small next to the layers
    for fname in sorted(files):
        hf_hub_download(model_id, fname)
    return base
