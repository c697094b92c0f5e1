"""The prompt cache's node side: KV of recent conversation prefixes, kept per layer range (so they
survive a re-plan) in the KV reserved for ``kv_requests``, least recently used out first."""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

if TYPE_CHECKING:
    from meshnode.model.layer_shard import LayerShard
    from meshnode.model.prefix_disk import PrefixDisk

log = logging.getLogger(__name__)

Layers = tuple[int, int]
# A sliding window or recurrent state cannot be cut back: only whole kept prefixes resume.
CANNOT_CUT = "this model's cache cannot be cut back"


def prefix_key(tokens: Sequence[int]) -> str:
    """The name of a kept prefix: a hash of exactly the tokens its KV holds."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=12).hexdigest()


@runtime_checkable
class KeptElsewhere(Protocol):
    """A prefix kept in a tensor group's workers: counted here, freed when the handle is dropped."""

    owner: Any  # the shard whose workers hold it

    def resume(self, positions: int) -> tuple[Any | None, str]:
        """A new request's cache, a copy of this prefix cut to ``positions``; or (None, why not)."""


class Resumed(list[Any]):
    """A cache resumed from a kept prefix: ``resumed_from`` (key, positions) lets the disk write
    only the positions after it."""

    def __init__(self, cache: list[Any], key: str, positions: int):
        super().__init__(cache)
        self.resumed_from = (key, positions)


def distinct(cache: list[Any]) -> list[Any]:
    """Each layer cache once: a shard's list aliases the layers it does not own to its own."""
    return list({id(c): c for c in cache}.values())


def _cut(cache: list[Any], positions: int) -> None:
    trim_prompt_cache(distinct(cache), positions)


def cut_to(cache: list[Any], positions: int) -> str:
    """Cut ``cache`` back to ``positions``: '' when it holds them now, else why not."""
    held = cache_positions(cache)
    if held < positions:
        return f"{held} positions held, {positions} asked"
    if held > positions:
        if not can_trim_prompt_cache(distinct(cache)):
            return CANNOT_CUT
        _cut(cache, held - positions)
    return ""


def copy_cut(cache: list[Any], positions: int) -> tuple[list[Any] | None, str]:
    """A copy of ``cache`` cut back to ``positions``, the original untouched; or (None, why not)."""
    held = cache_positions(cache)
    if positions > held:
        return None, f"{held} positions held, {positions} asked"
    if positions < held and not can_trim_prompt_cache(distinct(cache)):
        return None, CANNOT_CUT
    mine = copy.deepcopy(cache)
    if positions < held:
        _cut(mine, held - positions)
    return mine, ""


def cache_positions(cache: list[Any]) -> int:
    """Positions a KV cache holds (its first layer's offset)."""
    for layer in cache:
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int):
            return offset
    return 0


class PrefixStore:
    """This node's kept prefixes, per layer range; thread-safe."""

    def __init__(
        self,
        capacity: int,
        on_resume: Callable[[int, str], None] | None = None,
        on_drop: Callable[[str], None] | None = None,
        disk: PrefixDisk | None = None,
        mlx_turn: Callable[[], Any] | None = None,
    ):
        """``capacity``: positions one layer range may hold, kept and in use; ``mlx_turn``: a context
        holding the node's MLX baton, for reading from disk."""
        self.capacity = max(0, int(capacity))
        self._on_resume, self._on_drop = on_resume, on_drop
        self.disk = disk
        self._mlx_turn = mlx_turn or nullcontext
        self._lock = threading.Lock()
        self._kept: dict[Layers, OrderedDict[str, tuple[list[Any], int]]] = {}
        self._in_use: dict[Layers, int] = {}
        self.hits = 0
        self.reused_positions = 0
        self.disk_hits = 0

    # -- the requests open here
    def grow(self, layers: Layers, positions: int) -> None:
        """An open request took ``positions`` more KV positions (negative: released)."""
        with self._lock:
            self._in_use[layers] = max(0, self._in_use.get(layers, 0) + positions)
            dropped = self._fit(layers)
        self._dropped(dropped)

    # -- keeping and resuming
    def keep(
        self, layers: Layers, key: str, cache: list[Any], positions: int, parent: tuple[str, int] | None = None
    ) -> bool:
        """Keep ``cache`` (a finished request's) cut to ``positions``; ``parent``: the kept prefix
        it started from, if not marked on it (:class:`Resumed`)."""
        if positions <= 0 or positions > self.capacity:
            return False
        elsewhere = getattr(cache, "keep_as_prefix", None)
        if elsewhere is not None:
            cache, why = elsewhere(positions)
        else:
            why = cut_to(cache, positions)
            if not why:  # a step built ahead (never run) is dropped, not kept lazily
                mx.eval([c.state for c in distinct(cache)])
        if why:
            log.debug("not keeping %s for layers %s: %s", key, layers, why)
            return False
        if self.disk is not None and not isinstance(cache, KeptElsewhere):
            parent = parent or getattr(cache, "resumed_from", None)
            self.disk.keep(key, layers, cache[layers[0] : layers[1]], positions, parent)
        with self._lock:
            kept = self._kept.setdefault(layers, OrderedDict())
            kept.pop(key, None)
            kept[key] = (cache, positions)
            dropped = self._fit(layers)
            held = key in kept
        self._dropped(dropped)
        return held or self.disk is not None

    def resume(
        self, layers: Layers, key: str, positions: int, shard: LayerShard | None = None
    ) -> tuple[list[Any] | None, str]:
        """A copy of the cache kept under ``key``, cut to ``positions``; or (None, why not)."""
        with self._lock:
            kept = self._kept.get(layers)
            entry = kept.get(key) if kept is not None else None
            if entry is not None:
                self._kept[layers].move_to_end(key)
        if entry is None or positions > entry[1]:
            return self._from_disk(layers, key, positions, shard)
        cache = entry[0]
        if shard is not None and (
            cache.owner is not shard if isinstance(cache, KeptElsewhere) else shard.owned(cache) is None
        ):
            return None, "kept for these layers as another shard ran them"
        mine, why = cache.resume(positions) if isinstance(cache, KeptElsewhere) else copy_cut(cache, positions)
        if mine is None:
            return None, why
        self._resumed(positions, "memory")
        return Resumed(mine, key, positions) if isinstance(mine, list) else mine, ""

    def _from_disk(
        self, layers: Layers, key: str, positions: int, shard: LayerShard | None
    ) -> tuple[list[Any] | None, str]:
        """A prefix read back from disk; or (None, why not)."""
        if self.disk is None or shard is None:
            return None, "not kept here"
        with self._mlx_turn():
            template = shard.disk_template()
            if template is None:
                return None, "not kept here"
            owned, why = self.disk.load(key, layers, positions, template)
            if owned is None:
                log.debug("prompt cache: %s of layers %s not read from disk: %s", key, layers, why)
                return None, f"not kept here ({why})"
            cache = shard.make_cache(owned)
            why = cut_to(cache, positions)
        if why:
            return None, why
        self._resumed(positions, "disk")
        return Resumed(cache, key, positions), ""

    def _resumed(self, positions: int, source: str) -> None:
        with self._lock:
            self.hits += 1
            self.reused_positions += positions
            self.disk_hits += source == "disk"
        if self._on_resume is not None:
            self._on_resume(positions, source)

    def forget(self, layers: Layers | None = None) -> None:
        """Drop every prefix kept for ``layers`` (or all)."""
        with self._lock:
            dropped = [
                (lr, key)
                for lr in ([layers] if layers is not None else list(self._kept))
                for key in self._kept.pop(lr, {})
            ]
        self._dropped(dropped)

    def held(self, layers: Layers) -> int:
        """Positions kept for ``layers``."""
        with self._lock:
            return sum(p for _, p in self._kept.get(layers, {}).values())

    def layer_ranges(self) -> list[Layers]:
        with self._lock:
            return list(self._kept)

    def keys(self, layers: Layers) -> list[str]:
        with self._lock:
            return list(self._kept.get(layers, {}))

    def _dropped(self, dropped: list[tuple[Layers, str]]) -> None:
        """Tell ``on_drop`` of each (layers, key) given up here and not kept on disk either."""
        if self._on_drop is not None:
            for layers, key in dropped:
                if self.disk is None or not self.disk.holds(key, layers):
                    self._on_drop(key)

    def _fit(self, layers: Layers) -> list[tuple[Layers, str]]:
        """Give up least recently used prefixes of ``layers`` until all fits; (layers, key) of each."""
        kept = self._kept.get(layers)
        dropped: list[tuple[Layers, str]] = []
        if not kept:
            return dropped
        room = self.capacity - self._in_use.get(layers, 0)
        total = sum(p for _, p in kept.values())
        while kept and total > room:
            key, (_, positions) = kept.popitem(last=False)
            dropped.append((layers, key))
            total -= positions
            log.debug(
                "prompt cache: gave up prefix %s (%d positions) of layers %s: %d kept + %d in use > %d",
                key,
                positions,
                layers,
                total + positions,
                self._in_use.get(layers, 0),
                self.capacity,
            )
        return dropped
