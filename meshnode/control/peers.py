"""The other nodes and how to reach them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

import grpc

from meshnode.config import DATA_OFFSET, ECHO_OFFSET
from meshnode.control.browse import Browser
from meshnode.control.links import LinkProber, LinkStat, best_paths
from meshnode.control.membership import Membership
from meshnode.control.messages import node_to_pb
from meshnode.control.reachability import Reachability
from meshnode.control.settings import PeerSettings
from meshnode.ids import NodeId
from meshnode.nodeinfo import NodeInfo
from meshnode.planner import LinkSpec
from meshnode.proto import mesh_pb2
from meshnode.transport.service import MAX_GRPC_MESSAGE
from meshnode.trust import tls
from meshnode.trust.auth import ClusterAuth
from meshnode.trust.signed import SignedChannel

log = logging.getLogger(__name__)


class Peers:
    """What this node knows of the mesh: who is alive, which peers never answer, what each link measures,
    and one signed gRPC channel per address, which everything that talks to a peer asks for."""

    def __init__(
        self,
        settings: PeerSettings,
        node_id: NodeId,
        auth: ClusterAuth,
        identity: tls.TlsIdentity | None = None,
        stalled_for: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """``stalled_for``: seconds this node's own longest model step has run past stall_timeout (0: none)."""
        self.settings, self.node_id, self.auth, self.tls = settings, node_id, auth, identity
        self.me: NodeInfo | None = None
        self.membership: Membership | None = None  # from start()
        self.static_targets = list(settings.peers)
        # Peers mDNS announces but heartbeats never reach (macOS Local Network privacy, a firewall).
        self.reach = Reachability(grace=max(10.0, 5 * settings.failure_timeout))
        self.links = LinkProber(self.channel_to, interval=settings.link_probe_interval)
        self.peer_links: dict[str, tuple[LinkStat, ...]] = {}  # what each peer measured
        self.data_port_open = False
        self.stalled_for = stalled_for  # this node's own stall (announced)
        self._said_stalled = False
        self._channels: dict[str, grpc.aio.Channel] = {}

    @property
    def members(self) -> Membership:
        """The membership, made by :meth:`start`."""
        if self.membership is None:
            raise RuntimeError("the peers are not started yet")
        return self.membership

    def start(self, me: NodeInfo) -> None:
        self.me = me
        self.membership = Membership(me, failure_timeout=self.settings.failure_timeout)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    def update_me(self, **changes: Any) -> NodeInfo:
        """Change what this node announces with the next heartbeats; returns it, changed."""
        assert self.me is not None, "the peers are started"
        self.me = dataclasses.replace(self.me, **changes)
        if self.membership is not None:
            self.membership.me = self.me
        return self.me

    def me_pb(self) -> mesh_pb2.NodeInfo:
        assert self.me is not None, "the peers are started"
        msg = node_to_pb(self.me)
        msg.links.extend(link.to_pb() for link in self.links.links())
        msg.stalled_for = stalled = self.stalled_for()
        if bool(stalled) != self._said_stalled:
            self._said_stalled = bool(stalled)
            if stalled:
                log.warning(
                    "a model step here has run for %.0f s (stall_timeout %.0f s): telling peers this node is stalled",
                    stalled,
                    self.settings.stall_timeout,
                )
            else:
                log.info("the stalled model step ended: this node serves again")
        return msg

    # ------------------------------------------------------------------ who is there
    def alive_infos(self) -> dict[str, NodeInfo]:
        return self.membership.alive_infos() if self.membership is not None else {}

    def heard_within(self, node_id: str) -> bool:
        """The node heartbeats and is not stalled: worth waiting for, however long its step takes."""
        return self.membership is not None and self.membership.heard_within(node_id) and not self.stalled(node_id)

    def heard_since(self, node_id: str, since: float) -> bool:
        return self.membership is not None and self.membership.heard_since(node_id, since) and not self.stalled(node_id)

    def stalled(self, node_id: str) -> bool:
        """The node says one of its model steps has run past stall_timeout."""
        if node_id == self.node_id:
            return self.stalled_for() > 0
        peer = self.membership.peers.get(node_id) if self.membership is not None else None
        return peer is not None and peer.info.stalled_for > 0

    @contextlib.asynccontextmanager
    async def holders_of(
        self, model_id: str, cluster_id: str
    ) -> AsyncIterator[Callable[[], list[tuple[str, grpc.aio.Channel]]]]:
        """While open: a function listing (node id, channel) of the peers that may hold ``model_id``."""
        browser = Browser(self.node_id, cluster_id) if self.settings.mdns and self.membership is None else None
        if browser is not None:
            await browser.start()

        def candidates() -> list[tuple[str, grpc.aio.Channel]]:
            found = [(t, self.channel_to(t)) for t in self.static_targets]
            if self.membership is not None:  # a running node: its live peers
                found[:0] = [
                    (nid, self.channel_to(p.target))
                    for nid, p in sorted(self.membership.alive_peers().items())
                    if model_id in p.info.models or any(h[0] == model_id for h in p.info.holdings)
                ]
            for nid, info in (browser.peers() if browser is not None else {}).items():
                if model_id in info.models and info.addresses:
                    found.append((nid, self.channel_to(f"{info.addresses[0]}:{info.grpc_port}")))
            return found

        try:
            yield candidates
        finally:
            if browser is not None:
                await browser.stop()

    def offered_models(self) -> set[str]:
        """The models the live nodes (this one included) offer: what the mesh serves."""
        return {m for info in self.alive_infos().values() for m in info.models}

    def plan_error_of(self, model_id: str) -> str:
        """Why no plan of ``model_id`` fits, as a live peer announces it; "" if none does."""
        if self.membership is None:
            return ""
        return next((e for p in self.membership.alive_peers().values() if (e := p.plan_errors.get(model_id))), "")

    def on_discovery(self, node_id: str, info: NodeInfo | None, cluster_id: str) -> None:
        if info is None:
            log.info("mDNS says %s left; waiting for heartbeats to confirm", node_id)
            self.reach.withdrawn(node_id)
            return
        if info.cluster_id != cluster_id or node_id == self.node_id:
            return
        self.members.add_target(info, f"{info.addresses[0]}:{info.grpc_port}")
        self.reach.announced(node_id, f"{info.addresses[0]}:{info.grpc_port}")

    # ------------------------------------------------------------------ how to reach them
    def channel_to(self, node_id_or_target: str) -> grpc.aio.Channel:
        target = node_id_or_target
        peer = self.membership.peers.get(node_id_or_target) if self.membership else None
        if peer is not None:
            target = peer.target
        channel = self._channels.get(target)
        if channel is None:
            options = [
                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE),
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE),
                # Retry an unreachable peer within a second, not gRPC's default of up to two minutes.
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ]
            if self.tls:
                channel = grpc.aio.secure_channel(
                    target, tls.channel_credentials(self.tls), options=options + tls.channel_options()
                )
            else:
                channel = grpc.aio.insecure_channel(target, options=options)
            if self.settings.authenticate:  # signed when each call opens; nothing per message
                channel = SignedChannel(channel, self.auth, self.node_id)
            self._channels[target] = channel
        return channel

    def data_channel(self, node_id: str) -> grpc.aio.Channel:
        """The channel for per-token traffic to a peer: over its fastest measured address."""
        peer = self.membership.peers.get(node_id) if self.membership else None
        address = self.links.best_address(node_id)
        if peer is None or address is None:
            return self.channel_to(node_id)
        return self.channel_to(f"{address}:{peer.info.grpc_port}")

    def data_port_of(self, node_id: str) -> tuple[str, int] | None:
        """A peer's data port on its fastest measured address; None where activations go over gRPC."""
        peer = self.membership.peers.get(node_id) if self.membership else None
        if not self.data_port_open or peer is None or not peer.info.tensor_port:
            return None
        address = self.links.best_address(node_id) or peer.target.rsplit(":", 1)[0].strip("[]")
        return address, peer.info.tensor_port + DATA_OFFSET

    def probe_targets(self) -> dict[str, tuple[tuple[str, ...], int, int]]:
        if self.membership is None:
            return {}
        return {
            p.info.node_id: (
                p.info.addresses,
                p.info.grpc_port,
                p.info.tensor_port + ECHO_OFFSET if p.info.tensor_port else 0,
            )
            for p in self.membership.alive_peers().values()
        }

    # ------------------------------------------------------------------ what the links measure
    def measured(self) -> list[tuple[str, LinkStat]]:
        """Every link figure this node knows: its own probes and what peers reported."""
        out: list[tuple[str, LinkStat]] = [(self.node_id, stat) for stat in self.links.links()]
        out += [(nid, stat) for nid, stats in self.peer_links.items() for stat in stats]
        return out

    def link_specs(self, members: Collection[str]) -> dict[tuple[str, str], LinkSpec]:
        """The planner's links: each pair's fastest path."""
        return {
            (min(pair), max(pair)): LinkSpec(
                rtt_s=stat.rtt_us * 1e-6,
                bandwidth_Bps=stat.bandwidth,
                overhead_s=max(stat.rpc_rtt_us - stat.rtt_us, 0.0) * 1e-6,
                jitter_s=stat.jitter_us * 1e-6,
            )
            for pair, (_, stat) in best_paths(self.measured(), members).items()
        }

    def links_of(self, node_id: str) -> list[dict[str, object]]:
        stats = self.links.links() if node_id == self.node_id else self.peer_links.get(node_id, ())
        return [link.to_dict() for link in stats]
