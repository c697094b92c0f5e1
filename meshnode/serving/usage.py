"""Requests for one model at this node: counted, and for a model loaded on demand held until it is loaded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshnode.serving.resilience import PlacementLost
from meshnode.serving.sampling import SamplingParams

if TYPE_CHECKING:
    from meshnode.serving.engine import TokenSource

log = logging.getLogger(__name__)

POLL_S = 0.05


@dataclass(frozen=True)
class Use:
    """Requests for one model: at one node, or added up over the mesh."""

    last_used: float = 0.0  # unix time the last request started or ended (0: never)
    active: int = 0  # generating now
    waiting: int = 0  # waiting for the model to be loaded

    @property
    def idle(self) -> bool:
        return self.active == 0 and self.waiting == 0


class UseCounter:
    """What :class:`Use` says of this node's requests for one model."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.active = self.waiting = 0
        self.last_used = 0.0
        self._clock = clock

    def now(self) -> Use:
        return Use(self.last_used, self.active, self.waiting)

    def touch(self) -> None:
        self.last_used = self._clock()


class CountedSource:
    """A model's token source with each generation counted, and held while the model is not loaded."""

    def __init__(
        self,
        source: TokenSource,
        counter: UseCounter,
        *,
        on_demand: Callable[[], bool],
        loaded: Callable[[], bool],
        deadline: Callable[[], float],
        give_up: Callable[[BaseException], BaseException],
        model: str,
    ):
        self._source, self.counter = source, counter
        self._on_demand, self._loaded, self._deadline, self._give_up = on_demand, loaded, deadline, give_up
        self._model = model

    async def tokens(self, prompt: Sequence[int], params: SamplingParams) -> AsyncGenerator[int, None]:
        c = self.counter
        c.touch()
        if self._on_demand():
            await self._wait_loaded()
        c.active += 1
        try:
            async with contextlib.aclosing(self._source.tokens(prompt, params)) as tokens:
                async for token in tokens:
                    yield token
        finally:
            c.active -= 1
            c.touch()

    async def _wait_loaded(self) -> None:
        c, deadline = self.counter, self._deadline()
        c.waiting += 1
        started = time.monotonic()
        log.info("a request waits for model %s to be loaded", self._model)
        try:
            while not self._loaded():
                if time.monotonic() - started > deadline:
                    raise self._give_up(
                        PlacementLost(
                            f"model {self._model} was not loaded within {deadline:.0f} s (the models loaded "
                            "now are all in use, or the load failed)"
                        )
                    )
                await asyncio.sleep(POLL_S)
        finally:
            c.waiting -= 1
        log.info("model %s is loaded: %.2f s waited", self._model, time.monotonic() - started)
