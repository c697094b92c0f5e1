"""Tell the mesh how fast this node computes now: a slowdown judged by meshnode.model.pace goes out
with the next heartbeats, and the coordinator plans with it (meshnode.control.coordinator)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from meshnode.model.pace import Pace, Probe, Slowdown, watch
from meshnode.nodeinfo import speed_note

if TYPE_CHECKING:
    from meshnode.control.lanes import Lane
    from meshnode.control.peers import Peers
    from meshnode.model.scheduler import TokenScheduler

log = logging.getLogger(__name__)


def start(
    pace: Pace,
    scheduler: TokenScheduler,
    peers: Peers,
    lanes: Iterable[Lane],
    event: Callable[..., None],
) -> asyncio.Task[None]:
    """Watch ``pace`` (probing on the MLX thread) and announce each change; ``lanes``: the node's
    served models, whose plans tell whether it holds layers."""
    probe = Probe()
    me = peers.node_id

    def serving() -> bool:
        return any((plan := lane.served.plan) is not None and me in plan.node_ids() for lane in lanes)

    def announce(slowdown: Slowdown) -> None:
        was_slow = peers.me is not None and peers.me.slowdown > 1
        peers.update_me(slowdown=slowdown.factor, slow_since=slowdown.since)
        event("pace", slowdown=slowdown.factor, since=slowdown.since)
        if not slowdown.slow:
            log.info("%s computes at its measured speed again: telling the mesh", me)
            return
        (log.info if was_slow else log.warning)(
            "%s (its steps take %.1fx as long as they have here, for %.0f s): telling the mesh",
            speed_note(me, slowdown.factor, slowdown.since),
            slowdown.factor,
            pace.dwell,
        )

    return asyncio.create_task(
        watch(pace, lambda: scheduler.call(probe), serving=serving, announce=announce), name="meshnode-pace"
    )
