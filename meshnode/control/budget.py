"""The memory this node offers the mesh, as the machine takes it back and gives it again.

What a node could hold without swapping is what it holds now plus what the machine has free,
less a margin. An offer that no longer fits in that is lowered at once (a re-plan costs less than a
swap storm or an OOM kill); one below what the configured budget and the room allow is raised
only once that room has lasted ``dwell`` seconds, so a page cache filling and emptying does not
make plans flap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshnode import sysinfo
from meshnode.planner.plans import human_bytes

if TYPE_CHECKING:
    from meshnode.control.peers import Peers

log = logging.getLogger(__name__)

LOWER_TO = 0.9  # a lowered offer leaves this share of the room, so noise does not lower it again
RAISE_STEP = 0.1  # of the configured budget: a smaller gain is not worth a re-plan


class Budget:
    """The offer of one node: ``update`` with what it holds and what is free; the new offer or None."""

    def __init__(self, configured: int, margin: int, dwell: float, *, clock: Callable[[], float] = time.monotonic):
        self.configured = self.offered = configured
        self.margin, self.dwell, self._clock = margin, dwell, clock
        self._room_since: float | None = None  # since when a raise has had room

    def update(self, held: int, available: int) -> int | None:
        room = max(0, held + available - self.margin)
        if room < self.offered:
            self._room_since = None
            self.offered = int(room * LOWER_TO)
            return self.offered
        target = min(self.configured, int(room * LOWER_TO))
        small = target < self.configured and target - self.offered < RAISE_STEP * self.configured
        if target <= self.offered or small:
            self._room_since = None  # no raise worth a re-plan
            return None
        now = self._clock()
        if self._room_since is None:
            self._room_since = now
        if now - self._room_since < self.dwell:
            return None
        self._room_since = None
        self.offered = target
        return self.offered


async def watch(
    budget: Budget,
    held: Callable[[], int],
    available: Callable[[], int],
    announce: Callable[[int, int], None],
    interval: float = 1.0,
) -> None:
    """Every ``interval`` seconds, weigh what is ``held`` and ``available``; ``announce(new, old)``
    each change of the offer."""
    while True:
        await asyncio.sleep(interval)
        old = budget.offered
        new = budget.update(held(), await asyncio.to_thread(available))
        if new is not None:
            announce(new, old)


def start(budget: Budget, peers: Peers, event: Callable[..., None]) -> asyncio.Task[None]:
    """Watch ``budget`` against what MLX holds here and the machine has free, telling the mesh each
    new offer with the next heartbeats."""

    def announce(new: int, old: int) -> None:
        peers.update_me(memory_budget=new)
        event("budget", offered=new, was=old)
        if new < old:
            log.warning(
                "the machine took memory back: offering %s (was %s) so the mesh re-plans before it swaps",
                human_bytes(new),
                human_bytes(old),
            )
        else:
            log.info("memory came back: offering %s again (was %s)", human_bytes(new), human_bytes(old))

    return asyncio.create_task(
        watch(budget, sysinfo.mlx_memory, sysinfo.available_memory, announce), name="meshnode-budget"
    )
