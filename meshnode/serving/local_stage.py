"""A stage whose layers this process holds, and one request's KV cache in it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import mlx.core as mx

from meshnode.model.decode_batch import cache_of, take_back
from meshnode.model.layer_shard import LayerShard
from meshnode.model.wire import Placeholder
from meshnode.serving.prefill import DoneTicket
from meshnode.transport.refusals import PrefixMiss

if TYPE_CHECKING:
    from meshnode.model.decode_batch import DecodeBatch
    from meshnode.model.prefixes import PrefixStore


class LocalSession:
    remote: Literal[False] = False

    def __init__(self, shard: LayerShard, prefixes: PrefixStore | None = None, resume: tuple[str, int] | None = None):
        self._shard = shard
        self._prefixes = prefixes
        self._layers = (shard.start, shard.end)
        self._seen = 0
        self._prepared: tuple[Placeholder, mx.array] | None = None
        self.batch: DecodeBatch | None = None  # the head's batch holding this request's cache
        cache = None
        if resume is not None:  # start from a prefix kept here
            cache, why = prefixes.resume(self._layers, *resume, shard=shard) if prefixes is not None else (None, "off")
            if cache is None:
                raise PrefixMiss(f"layers [{shard.start}, {shard.end}) here: prefix {resume[0]}: {why}")
            self.grow(resume[1])
        # (None while a DecodeBatch holds it)
        self.cache: list[Any] | None = cache if cache is not None else shard.make_cache()

    def grow(self, positions: int) -> None:
        self._seen += positions
        if self._prefixes is not None:  # kept prefixes make room for this request's KV
            self._prefixes.grow(self._layers, positions)

    def keep(self, key: str, positions: int) -> bool:
        """Keep this request's KV here; whether it was."""
        take_back(self)
        cache, self.cache, self._prepared = self.cache, None, None
        self.close()  # its positions are the kept prefix's now
        return (
            self._prefixes is not None
            and cache is not None
            and self._prefixes.keep(self._layers, key, cache, positions)
        )

    def prepare(self) -> bool:
        """Build the next step on a placeholder while a remote stage before it works; False if not."""
        take_back(self)
        self._prepared = self._shard.build_ahead(self.cache)
        if self._prepared is None:
            return False
        if self._shard.spec.is_last:
            placeholder, out = self._prepared
            self._prepared = (placeholder, out[:, -1:, :])
        return True

    @property
    def placeholder(self) -> Placeholder:
        """The input of the step :meth:`prepare` built."""
        assert self._prepared is not None, "prepare() built a step"
        return self._prepared[0]

    def run_prepared(self) -> mx.array:
        """The step :meth:`prepare` built, its placeholder filled."""
        assert self._prepared is not None, "prepare() built a step"
        (_, out), self._prepared = self._prepared, None
        return out

    def submit(self, x: mx.array, *, work: int = 0) -> DoneTicket:
        """Run one prefill chunk now; only its effect on the cache matters."""
        cache = cache_of(self)
        self.grow(x.shape[1])
        out = self._shard.forward(x, cache)
        if self._shard.spec.is_last:
            owned = self._shard.owned(cache)
            # As mlx-lm's own prefill: evaluate the cache, never the chunk's logits.
            mx.eval([c.state for c in owned] if owned is not None else out)
        else:
            mx.eval(out)
        return DoneTicket(out, x.shape[1])

    def forward(self, x: mx.array, all_positions: bool = False) -> mx.array:
        """``all_positions``: the last stage's logits of every position of ``x``."""
        # Stays lazy: generate_step overlaps building the next step with evaluating this one.
        cache = cache_of(self)
        self.grow(x.shape[1])
        if not self._shard.spec.is_last:
            return self._shard.forward(x, cache)
        out = self._shard.forward(x, cache, all_positions=all_positions)
        return out if all_positions else out[:, -1:, :]

    def rewind(self, positions: int) -> None:
        """Drop the last ``positions`` of this request's KV here (rejected drafts)."""
        take_back(self)
        self._shard.rewind(self.cache, positions)
        self.grow(-positions)

    def close(self) -> None:
        take_back(self)
        self.cache = self._prepared = None
        if self._seen:
            self.grow(-self._seen)


class LocalStage:
    """A shard held by this process; ``prefixes``: this node's kept prefixes."""

    def __init__(self, shard: LayerShard, prefixes: PrefixStore | None = None):
        self.shard, self.prefixes = shard, prefixes
        self.start, self.end = shard.start, shard.end
        self.prefill_rate: float | None = None

    def open(self, request_id: str, resume: tuple[str, int] | None = None) -> LocalSession:
        return LocalSession(self.shard, self.prefixes, resume)
