"""Heartbeats: how nodes learn that the others are alive, and what they hold."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

import grpc

from meshnode.control.links import LinkStat
from meshnode.control.messages import node_from_pb, node_to_pb, plan_to_pb
from meshnode.control.settings import ControlSettings
from meshnode.errors import abort
from meshnode.nodeinfo import NodeInfo
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.serving.usage import Use
from meshnode.version import describe, incompatible

if TYPE_CHECKING:
    from meshnode.control.lanes import Lanes
    from meshnode.control.peers import Peers

log = logging.getLogger(__name__)


class Heartbeats:
    """Sends and answers heartbeats: node info, coordinator and per-model plan state; replies add
    known peers (gossip). A plan seen either way goes to adoption, so a missed Install still
    arrives. A peer refusing the connection is dropped at once, a silent one after ``failure_timeout``."""

    def __init__(
        self, settings: ControlSettings, node_id: str, cluster_id: str, started_at: float, peers: Peers, lanes: Lanes
    ):
        self.settings, self.node_id, self.cluster_id, self.started_at = settings, node_id, cluster_id, started_at
        self.peers, self.lanes = peers, lanes
        self.coordinator: str | None = None  # set by the control loop
        self.goodbyes: set[str] = set()  # peers that left, as opposed to lost
        self._versions: dict[str, tuple[str, int]] = {}  # each peer's last (version, protocol) logged
        self.sent_bytes = self.received_bytes = 0  # heartbeats and their replies, serialized

    # ------------------------------------------------------------------ out
    def _fill(self, msg: mesh_pb2.HeartbeatRequest | mesh_pb2.HeartbeatReply) -> None:
        """What this node says of itself in a heartbeat or a reply."""
        msg.node.CopyFrom(self.peers.me_pb())
        msg.coordinator = self.coordinator or ""
        msg.alive.extend(sorted(self.peers.alive_infos()))
        for lane in self.lanes:
            if lane.model_id is None:
                continue  # still loading
            a = lane.adoption
            use = lane.served.use_now()
            state = msg.models.add(
                model=lane.model_id,
                epoch=a.epoch,
                ready_epoch=a.ready_epoch,
                plan_error=a.plan_error,
                last_used=use.last_used,
                active=use.active,
                waiting=use.waiting,
            )
            if a.plan is not None:
                state.plan.CopyFrom(plan_to_pb(a.plan, a.plan_coordinator))
            if lane is self.lanes.primary:  # a single-model heartbeat's fields
                msg.epoch, msg.ready_epoch, msg.plan_error = state.epoch, state.ready_epoch, state.plan_error
                if state.HasField("plan"):
                    msg.plan.CopyFrom(state.plan)

    async def beat_all(self) -> None:
        """One heartbeat to every peer known and every static address, at once."""
        membership = self.peers.members
        targets = {p.target for p in membership.peers.values()} | set(self.peers.static_targets)
        await asyncio.gather(*(self.beat(t) for t in targets), return_exceptions=True)

    async def beat(self, target: str) -> None:
        peers = self.peers
        msg = mesh_pb2.HeartbeatRequest()
        self._fill(msg)
        stub = mesh_pb2_grpc.MeshStub(peers.channel_to(target))
        self.sent_bytes += msg.ByteSize()
        try:
            reply = await stub.Heartbeat(msg, timeout=self.settings.failure_timeout / 2)
        except grpc.aio.AioRpcError as exc:
            peers.reach.failed(target, f"{exc.code().name}: {(exc.details() or '')[:200]}")
            if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                log.warning("peer at %s refused us (another cluster key?): %s", target, exc.details())
            elif exc.code() == grpc.StatusCode.UNAVAILABLE and "refused" in (exc.details() or "").lower():
                # Nothing listens: the process is gone, no need to wait out the timeout.
                for peer in peers.members.alive_peers().values():
                    if peer.target == target:
                        log.warning("%s refuses connections: its process is gone", peer.info.node_id)
                        peers.members.goodbye(peer.info.node_id)
            return
        peers.reach.answered(target)
        self.received_bytes += reply.ByteSize()
        try:
            info = node_from_pb(reply.node)
        except ValueError as exc:
            log.warning("ignoring a bad heartbeat reply from %s: %s", target, exc)
            return
        if info.cluster_id != self.cluster_id:
            log.warning("peer at %s belongs to another cluster; ignoring it", target)
            return
        if why := incompatible(info.node_id, info.version, info.protocol):
            self._refuse(info, why)
            return
        self._observe(info, target, reply)
        for known in reply.known:
            try:
                k = node_from_pb(known)
            except ValueError:
                continue
            if (
                k.cluster_id == self.cluster_id
                and k.node_id != self.node_id
                and k.node_id not in peers.members.peers
                and not incompatible(k.node_id, k.version, k.protocol)
            ):
                peers.members.add_target(k, f"{k.addresses[0]}:{k.grpc_port}" if k.addresses else target)

    async def say_goodbye(self, target: str) -> None:
        stub = mesh_pb2_grpc.MeshStub(self.peers.channel_to(target))
        await stub.Leave(mesh_pb2.Goodbye(node_id=self.node_id), timeout=1.0)

    # ------------------------------------------------------------------ in
    async def on_heartbeat(
        self, request: mesh_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> mesh_pb2.HeartbeatReply:
        try:
            info = node_from_pb(request.node)
        except ValueError as exc:
            log.warning("refused a malformed heartbeat from %s: %s", context.peer(), exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if info.cluster_id != self.cluster_id:
            log.warning("refused a heartbeat from %s (%s): other cluster", info.node_id, context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not a member of this cluster")
        if why := incompatible(info.node_id, info.version, info.protocol):
            self._refuse(info, why)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        membership = self.peers.membership
        if membership is None:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "starting")
        target = f"{info.addresses[0]}:{info.grpc_port}" if info.addresses else _peer_host(context, info.grpc_port)
        if info.node_id == self.node_id:
            if info.started_at != self.started_at:
                log.error(
                    "two nodes use node id %s (the other at %s); give one a different --node-id", info.node_id, target
                )
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"node id {info.node_id} is already in use")
        self._observe(info, target, request)
        reply = mesh_pb2.HeartbeatReply()
        self._fill(reply)
        # Gossip only the peers the caller does not list as alive: a steady mesh sends none, so
        # what a node sends grows with the peers it beats, not with their square.
        told = set(request.alive) | {info.node_id}
        reply.known.extend(node_to_pb(p.info) for nid, p in membership.alive_peers().items() if nid not in told)
        self.received_bytes += request.ByteSize()
        self.sent_bytes += reply.ByteSize()
        return reply

    def on_goodbye(self, node_id: str) -> None:
        membership = self.peers.membership
        if membership is not None and node_id in membership.peers:
            log.info("%s said goodbye", node_id)
            self.goodbyes.add(node_id)
            membership.goodbye(node_id)

    def _refuse(self, info: NodeInfo, why: str) -> None:
        """Log once per peer and version why it cannot join this node's mesh."""
        if self._versions.get(info.node_id) != (info.version, info.protocol):
            self._versions[info.node_id] = (info.version, info.protocol)
            log.warning("refusing %s: %s", info.node_id, why)

    def _observe(self, info: NodeInfo, target: str, msg: mesh_pb2.HeartbeatRequest | mesh_pb2.HeartbeatReply) -> None:
        peers = self.peers
        if self._versions.get(info.node_id) != (info.version, info.protocol):
            self._versions[info.node_id] = (info.version, info.protocol)
            if info.version != describe():
                log.info("%s runs meshnode %s; this node runs %s", info.node_id, info.version, describe())
        try:
            peers.peer_links[info.node_id] = tuple(LinkStat.from_pb(link) for link in msg.node.links[:256])
        except ValueError as exc:
            log.warning("ignoring bad link figures from %s: %s", info.node_id, exc)
        peers.members.observe(
            info, target=target, coordinator=msg.coordinator, epoch=msg.epoch, alive_view=frozenset(msg.alive)
        )
        peer = peers.members.peers[info.node_id]
        states = model_states(msg)
        peer.ready_epochs = {model: state.ready_epoch for model, state in states}
        peer.plan_errors = {model: state.plan_error[:1000] for model, state in states if state.plan_error}
        peer.uses = {
            model: Use(state.last_used if math.isfinite(state.last_used) else 0.0, state.active, state.waiting)
            for model, state in states
            if state is not msg
        }
        for model, state in states:
            lane = self.lanes.get(model)
            if lane is not None:  # else the control loop loads it (Lanes.learn)
                lane.adoption.heard_of(state, info.node_id)


def model_states(
    msg: mesh_pb2.HeartbeatRequest | mesh_pb2.HeartbeatReply,
) -> list[tuple[str, mesh_pb2.HeartbeatRequest | mesh_pb2.HeartbeatReply | mesh_pb2.ModelState]]:
    """(model, state) pairs a heartbeat tells of (without ``models``: its plan's, else "")."""
    if msg.models:
        return [(state.model, state) for state in msg.models[:64]]
    return [(msg.plan.model if msg.HasField("plan") else "", msg)]


def _peer_host(context: grpc.aio.ServicerContext, port: int) -> str:
    peer = context.peer()  # "ipv4:1.2.3.4:5678"
    host = peer.split(":")[1] if peer.startswith("ipv4:") else "127.0.0.1"
    return f"{host}:{port}"
