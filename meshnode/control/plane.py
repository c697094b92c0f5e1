"""The control loop: every ``heartbeat_interval``, heartbeat everyone, then look at the mesh.

Each tick: membership says who joined and who is gone; reachability says which announced peers
never answer; the oldest live node is elected coordinator (meshnode.control.election) and, if
that is this node, it weighs and publishes a plan (meshnode.control.coordinator); then this
node's serving runtime keeps its part of the plan loaded and retires older epochs once the
current one is ready everywhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

from meshnode.control.adoption import Adoption
from meshnode.control.coordinator import Coordinator
from meshnode.control.election import Candidate, choose_coordinator
from meshnode.control.heartbeats import Heartbeats

if TYPE_CHECKING:
    from meshnode.control.peers import Peers
    from meshnode.serving.served import ServedModel

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, settings, node_id: str, cluster_id: str, started_at: float, peers: "Peers",
                 served: "ServedModel", *, event: Callable[..., None]):
        self.settings, self.node_id, self.peers, self.served = settings, node_id, peers, served
        self._event = event
        self.adoption = Adoption(served, grace=max(1.0, 2 * settings.heartbeat_interval), event=event)
        self.heartbeats = Heartbeats(settings, node_id, cluster_id, started_at, peers, self.adoption)
        self.coordinator = Coordinator(settings, node_id, peers, self.adoption, event=event)
        self._since = 0.0

    @property
    def coordinator_id(self) -> str | None:
        return self.heartbeats.coordinator

    async def run(self) -> None:
        self._since = time.monotonic()  # peers can find this node from now (rule 4 of epochs)
        while True:
            await self.beat_now()
            await asyncio.sleep(self.settings.heartbeat_interval)

    async def beat_now(self) -> None:
        """Heartbeat every peer, then tick (also when a plan became ready: tell the mesh now)."""
        await self.heartbeats.beat_all()
        try:
            self.tick()
        except Exception:
            log.exception("control loop tick failed")

    def tick(self) -> None:
        membership, reach = self.peers.membership, self.peers.reach
        epoch = self.adoption.epoch
        joined, left = membership.refresh()
        for nid in sorted(joined):
            log.info("peer %s joined (epoch %d)", nid, epoch)
            self._event("join", node_id=nid)
        for nid in sorted(left):
            log.warning("peer %s is gone (no heartbeat for %.1f s; epoch %d)", nid, self.settings.failure_timeout,
                        epoch)
            self._event("leave" if nid in self.heartbeats.goodbyes else "loss", node_id=nid)
        self.heartbeats.goodbyes -= joined | left
        for level, message, fields in reach.check():
            log.log(level, "%s", message)
            self._event("unreachable" if level > logging.INFO else "reachable", **fields)
        alive = membership.alive_infos()
        coordinator = choose_coordinator(Candidate(n.node_id, n.started_at) for n in alive.values())
        if coordinator != self.heartbeats.coordinator:
            log.info("coordinator is now %s (was %s)", coordinator, self.heartbeats.coordinator)
            self._event("coordinator", node_id=coordinator)
            self.heartbeats.coordinator = coordinator
        if coordinator == self.node_id and self.adoption.epochs.may_publish_first(time.monotonic() - self._since):
            self.coordinator.coordinate(alive)
        self.served.ensure_applied()
        self.served.retire_previous()
