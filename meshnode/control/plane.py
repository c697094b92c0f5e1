"""The control loop: every ``heartbeat_interval``, heartbeat everyone, then look at the mesh."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshnode.control.demand import expired, keep_alive_of, total, victim
from meshnode.control.election import Candidate, choose_coordinator
from meshnode.control.heartbeats import Heartbeats
from meshnode.control.settings import ControlSettings
from meshnode.proto import mesh_pb2
from meshnode.serving.loading import retire_previous
from meshnode.serving.usage import Use

if TYPE_CHECKING:
    from meshnode.control.adoption import Adoption
    from meshnode.control.coordinator import Coordinator
    from meshnode.control.lanes import Lane, Lanes
    from meshnode.control.peers import Peers
    from meshnode.nodeinfo import NodeInfo
    from meshnode.serving.modelfiles import Holders

log = logging.getLogger(__name__)


class ControlPlane:
    """Runs the control loop. Each tick: find who is alive; if this node coordinates, plan each
    model's lane and load or unload models on demand; then each served model keeps its part of
    the plan loaded and retires older epochs."""

    def __init__(
        self,
        settings: ControlSettings,
        node_id: str,
        cluster_id: str,
        started_at: float,
        peers: Peers,
        lanes: Lanes,
        *,
        event: Callable[..., None],
        holders: Holders | None = None,
    ) -> None:
        """``holders``: opens a search for the peers holding a model."""
        self.settings, self.node_id, self.peers, self.lanes = settings, node_id, peers, lanes
        self._event, self._holders = event, holders
        self.heartbeats = Heartbeats(settings, node_id, cluster_id, started_at, peers, lanes)
        self._since = 0.0
        self._lane_since: dict[str, float] = {}  # when each lane was first loaded (epochs rule 4)
        self._loaded_at: dict[str, float] = {}  # unix time each model's plan was first loaded here
        self._no_room: dict[str, frozenset[str]] = {}  # models unloaded for want of room -> members then

    @property
    def coordinator_id(self) -> str | None:
        return self.heartbeats.coordinator

    @property
    def adoption(self) -> Adoption:
        """The first model's plan adoption."""
        return self.lanes.primary.adoption

    @property
    def coordinator(self) -> Coordinator:
        return self.lanes.primary.coordinator

    def on_install(self, msg: mesh_pb2.Plan) -> mesh_pb2.InstallReply:
        """A coordinator's Install, for the lane of the model it names."""
        lane = self.lanes.get(msg.model)
        if lane is None:
            return mesh_pb2.InstallReply(accepted=False, error=f"model {msg.model!r} is not known here yet")
        return lane.adoption.on_install(msg)

    async def run(self) -> None:
        self._since = time.monotonic()  # peers can find this node from now (rule 4 of epochs)
        while True:
            await self.beat_now()
            await asyncio.sleep(self.settings.heartbeat_interval)

    async def beat_now(self) -> None:
        """Heartbeat every peer, then tick."""
        await self.heartbeats.beat_all()
        try:
            self.tick()
        except Exception:  # one failed tick must not stop the control loop
            log.exception("control loop tick failed")

    def tick(self) -> None:
        membership, reach = self.peers.members, self.peers.reach
        epoch = self.adoption.epoch
        joined, left = membership.refresh()
        for nid in sorted(joined):
            log.info("peer %s joined (epoch %d)", nid, epoch)
            self._event("join", node_id=nid)
        for nid in sorted(left):
            log.warning(
                "peer %s is gone (no heartbeat for %.1f s; epoch %d)", nid, self.settings.failure_timeout, epoch
            )
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
        offered = self.peers.offered_models()
        if self._holders is not None:
            self.lanes.learn(sorted(offered), self._holders)
        if coordinator == self.node_id:
            self._coordinate(alive, offered)
        for lane in self.lanes:
            if lane.model_id is not None:
                lane.served.ensure_applied()
                retire_previous(lane.served)

    def _coordinate(self, alive: dict[str, NodeInfo], offered: set[str]) -> None:
        """Plan each model into the memory the others leave; load and unload on demand."""
        now, wall = time.monotonic(), time.time()
        lanes = [lane for lane in self.lanes if lane.model_id is not None]
        uses = {lane.model_id: self.use_of(lane) for lane in lanes}
        for lane in lanes:
            model, plan = lane.model_id, lane.served.plan
            if plan is not None and not plan.unloaded:
                self._loaded_at.setdefault(model, wall)
            else:
                self._loaded_at.pop(model, None)
            # A lane loaded later hears the mesh's epochs of its model before it may publish.
            since = self._since if lane is self.lanes.primary else self._lane_since.setdefault(model, now)
            if not lane.adoption.epochs.may_publish_first(now - since):
                continue
            if model not in offered:
                if plan is not None and not plan.unloaded:
                    lane.coordinator.unload("no live node offers it any more")
                continue
            use = uses[model]
            if plan is not None and plan.unloaded:
                # Placed again when a request waits, or (unloaded for room) when the members change.
                retry = model in self._no_room and self._no_room[model] != frozenset(alive)
                if use.waiting or retry:
                    lane.coordinator.coordinate(alive)
                    if lane.coordinator.needs_room and use.waiting:
                        self._make_room(lane, lanes, uses)
                    if model in self._no_room:
                        self._no_room[model] = frozenset(alive)
                continue
            self._no_room.pop(model, None)
            if plan is not None and expired(
                use, keep_alive_of(self.settings.keep_alive, model), self._loaded_at.get(model, wall), wall
            ):
                lane.coordinator.unload("idle for longer than its keep_alive")
                continue
            lane.coordinator.coordinate(alive)
            if lane.coordinator.needs_room:
                others = ", ".join(m for m in uses if m != model) or "the other models"
                lane.coordinator.unload(f"does not fit beside {others}; loaded when a request asks for it")
                self._no_room[model] = frozenset(alive)

    def _make_room(self, wanted: Lane, lanes: list[Lane], uses: dict[str, Use]) -> None:
        loaded = {
            lane.model_id: uses[lane.model_id]
            for lane in lanes
            if lane is not wanted and lane.served.plan is not None and not lane.served.plan.unloaded
        }
        model = victim(loaded, self._loaded_at)
        if model is None:
            return  # every loaded model is in use: the request waits for one to be idle
        lane = self.lanes.get(model)
        assert lane is not None, "victim() names a loaded model"
        lane.coordinator.unload(f"the least recently used idle model, unloaded to make room for {wanted.model_id}")

    def use_of(self, lane: Lane) -> Use:
        """The requests for the lane's model over the mesh."""
        peers = self.peers.membership.alive_peers().values() if self.peers.membership is not None else ()
        return total([lane.served.use_now(), *(p.uses[lane.model_id] for p in peers if lane.model_id in p.uses)])
