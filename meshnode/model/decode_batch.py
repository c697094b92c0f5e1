"""Decoding requests at one stage run as one batched forward.

Caches stay merged in mlx-lm's batch caches between steps, so the KV is not copied while members
stay. Membership follows each step's list, so no join or leave message can be lost; before a member
runs alone or its KV is kept or dropped, :func:`take_back` returns its cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeGuard

import mlx.core as mx

from meshnode.model.layer_shard import LayerShard
from meshnode.model.shard import Shard, any_thread_stream


class Member(Protocol):
    """A request's use of a stage: ``cache`` (None while in a batch) and the ``batch`` holding it."""

    cache: list[Any] | None
    batch: DecodeBatch | None


def take_back(member: Member) -> None:
    """``member``'s cache out of the batch holding it, if any."""
    if member.batch is not None:
        member.batch.release(member)


def cache_of(member: Member) -> list[Any]:
    """``member``'s cache, taken back from the batch holding it, if any; raises once it is closed."""
    take_back(member)
    if member.cache is None:
        raise RuntimeError("the request's cache here is closed (kept or dropped)")
    return member.cache


def _aliases(cache: list[Any]) -> list[int]:
    """For each layer, the first layer holding the same cache object."""
    first: dict[int, int] = {}
    return [first.setdefault(id(c), i) for i, c in enumerate(cache)]


def batchable_cache(cache: list[Any]) -> bool:
    """Whether mlx-lm can merge every cache of this list (quantized and chunked caches cannot)."""
    return all(_mergeable(c) for c in cache)


def batchable_shard(shard: LayerShard) -> TypeGuard[Shard]:
    """Whether a stage's requests can step in a batch here."""
    return isinstance(shard, Shard) and shard.group_size == 1 and batchable_cache(shard.make_cache())


def _mergeable(cache: Any) -> bool:
    if not callable(getattr(type(cache), "merge", None)):
        return False
    parts = getattr(cache, "caches", None)  # a CacheList merges its parts
    return parts is None or all(_mergeable(p) for p in parts)


class DecodeBatch:
    """One stage's decoding members as one batch of caches.

    ``lock`` is held by whoever steps the batch (from :meth:`follow` until the step is evaluated);
    :meth:`release` takes it too, so a member's stream may end on any thread."""

    def __init__(self, make_cache: Callable[[], list[Any]]):
        """``make_cache()``: a fresh per-request cache list of the stage."""
        self.lock = threading.RLock()
        self._make_cache = make_cache
        self._members: list[Member] = []
        self._cache: list[Any] | None = None
        self._alias: list[int] | None = None

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, member: Member) -> bool:
        return any(m is member for m in self._members)

    @property
    def cache(self) -> list[Any] | None:
        """The batch's per-layer caches, rows in :meth:`follow`'s order."""
        return self._cache

    def follow(self, members: Sequence[Member]) -> list[Any]:
        """Make the batch exactly ``members``, rows in that order; the caches to run the step on."""
        with self.lock, mx.stream(any_thread_stream()):
            return self._follow(list(members))

    def _follow(self, want: list[Member]) -> list[Any]:
        named = {id(m) for m in want}
        if len(named) != len(want):
            raise ValueError("a request named twice in one step")
        for member in [m for m in self._members if id(m) not in named]:
            self._release(member)
        joining = [m for m in want if m not in self]
        if joining:
            self._join(joining)
        order = [self._index(m) for m in want]
        if order != list(range(len(order))):
            self._each(lambda c: c.filter(mx.array(order)))
            self._members = want
        return self._held()[0]

    def release(self, member: Member) -> None:
        """Take ``member`` out of the batch, its cache extracted back to it."""
        with self.lock, mx.stream(any_thread_stream()):
            self._release(member)

    def _release(self, member: Member) -> None:
        if member not in self:
            return
        idx = self._index(member)
        member.cache, member.batch = self._extract(idx), None
        rest = [i for i in range(len(self._members)) if i != idx]
        del self._members[idx]
        if rest:
            self._each(lambda c: c.filter(mx.array(rest)))
        else:
            self._cache = self._alias = None

    def release_all(self) -> None:
        for member in list(self._members):
            self.release(member)

    # -- inside
    def _index(self, member: Member) -> int:
        return next(i for i, m in enumerate(self._members) if m is member)

    def _held(self) -> tuple[list[Any], list[int]]:
        """The merged caches and which layer's cache each layer uses."""
        assert self._cache is not None and self._alias is not None, "the batch holds a member"
        return self._cache, self._alias

    def _distinct(self) -> list[int]:
        return sorted(set(self._held()[1]))

    def _each(self, fn: Callable[[Any], object]) -> None:
        cache = self._held()[0]
        for i in self._distinct():
            fn(cache[i])

    def _join(self, joining: list[Member]) -> None:
        for member in joining:
            if member.batch is not None:  # another batch holds its cache
                member.batch.release(member)
        caches = [m.cache for m in joining if m.cache is not None]
        if len(caches) != len(joining):
            raise ValueError("a request joined a batch without its cache (it is in another batch)")
        alias = _aliases(caches[0])
        if self._alias is not None and alias != self._alias:
            raise ValueError("requests of different stages in one batch")
        merged: list[Any] = [None] * len(alias)
        for i in sorted(set(alias)):
            merged[i] = type(caches[0][i]).merge([c[i] for c in caches])
        for i, j in enumerate(alias):
            merged[i] = merged[j]
        if self._cache is None:
            self._cache, self._alias = merged, alias
        else:
            held = self._held()[0]
            for i in self._distinct():
                held[i].extend(merged[i])
        for member in joining:
            member.cache, member.batch = None, self  # the batch holds its KV now
        self._members.extend(joining)

    def _extract(self, idx: int) -> list[Any]:
        fresh: list[Any] | None = None
        cache, alias = self._held()
        out: list[Any] = [None] * len(alias)
        for i in self._distinct():
            batch = cache[i]
            if batch.empty():  # a cache this stage never writes (a kind only other stages run)
                fresh = fresh if fresh is not None else self._make_cache()
                out[i] = fresh[i]
            else:
                out[i] = batch.extract(idx)
        for i, j in enumerate(alias):
            out[i] = out[j]
        return out
