"""Which peers are alive: a peer is alive while we heard from it within ``failure_timeout``.
An mDNS removal is only a hint; a goodbye drops the peer at once. Pure; the clock is injected."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from meshnode.nodeinfo import NodeInfo
from meshnode.serving.usage import Use

log = logging.getLogger(__name__)


@dataclass
class Peer:
    info: NodeInfo
    target: str  # "host:port" we reach its gRPC server at
    last_seen: float = float("-inf")
    coordinator: str = ""
    epoch: int = 0
    alive_view: frozenset[str] = field(default_factory=frozenset)
    # By model: the plan epoch whose shards the peer has loaded.
    ready_epochs: dict[str, int] = field(default_factory=dict)
    plan_errors: dict[str, str] = field(default_factory=dict)  # by model: why no plan fits
    uses: dict[str, Use] = field(default_factory=dict)  # by model


class Membership:
    """The peers heard from within ``failure_timeout``: the failure detector."""

    def __init__(self, me: NodeInfo, *, failure_timeout: float, clock: Callable[[], float] = time.monotonic):
        self.me = me
        self.failure_timeout = failure_timeout
        self.clock = clock
        self.peers: dict[str, Peer] = {}
        self._alive: set[str] = set()

    def add_target(self, info: NodeInfo, target: str) -> None:
        """A peer learned of (mDNS, gossip): not alive until it answers."""
        if info.node_id == self.me.node_id:
            return
        peer = self.peers.get(info.node_id)
        if peer is None:
            self.peers[info.node_id] = Peer(info=info, target=target)
        else:
            peer.info, peer.target = info, target

    def observe(
        self, info: NodeInfo, *, target: str, coordinator: str, epoch: int, alive_view: frozenset[str] = frozenset()
    ) -> None:
        """We heard from a peer directly."""
        if info.node_id == self.me.node_id:
            return
        peer = self.peers.get(info.node_id)
        if peer is None:
            peer = self.peers[info.node_id] = Peer(info=info, target=target)
        peer.info, peer.target = info, target
        peer.last_seen = self.clock()
        peer.coordinator, peer.epoch, peer.alive_view = coordinator, epoch, alive_view

    def goodbye(self, node_id: str) -> None:
        peer = self.peers.get(node_id)
        if peer is not None:
            peer.last_seen = float("-inf")

    def forget(self, node_id: str) -> None:
        self.peers.pop(node_id, None)

    def refresh(self) -> tuple[set[str], set[str]]:
        """Re-evaluate liveness; returns (joined, left) since the last call."""
        now = self.clock()
        alive = {nid for nid, p in self.peers.items() if now - p.last_seen <= self.failure_timeout}
        joined, left = alive - self._alive, self._alive - alive
        self._alive = alive
        return joined, left

    def heard_since(self, node_id: str, since: float) -> bool:
        """Heard from ``node_id`` (or it is this node) at or after ``since``. Any thread."""
        if node_id == self.me.node_id:
            return True
        peer = self.peers.get(node_id)
        return peer is not None and peer.last_seen >= since

    def heard_within(self, node_id: str) -> bool:
        """Heard from within ``failure_timeout`` now, not as of the last :meth:`refresh`. Any thread."""
        return self.heard_since(node_id, self.clock() - self.failure_timeout)

    def alive_peers(self) -> dict[str, Peer]:
        return {nid: self.peers[nid] for nid in self._alive if nid in self.peers}

    def alive_infos(self) -> dict[str, NodeInfo]:
        """Alive nodes including this one."""
        out = {nid: p.info for nid, p in self.alive_peers().items()}
        out[self.me.node_id] = self.me
        return out
