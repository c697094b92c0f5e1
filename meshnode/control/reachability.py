"""Peers that mDNS shows but that never answer (macOS Local Network privacy, a firewall).
Pure bookkeeping with an injected clock."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["HINT", "Reachability"]

HINT = (
    "If that machine runs meshnode: on macOS 15 or later, a per-user service (LaunchAgent) needs the "
    "Local Network permission on both machines (System Settings > Privacy & Security > Local Network: "
    "turn on the entry for Python, the interpreter of meshnode's venv), then restart the service; or "
    "install it with `sudo meshnode install --system` (a LaunchDaemon, which macOS exempts). On Linux, "
    "check the firewall on both machines (e.g. `sudo nft list ruleset`, `sudo ufw status`): the peer's "
    "gRPC port (TCP, 8471 by default) must accept connections from this machine."
)


@dataclass
class _Announced:
    target: str  # host:port of its gRPC server, as announced
    failing_since: float | None = None  # first failure since the last answer or announcement
    error: str = ""
    reported: bool = False  # logged as unreachable

    def failing_for(self, now: float) -> float:
        """Seconds since the first failed heartbeat (0 while it answers)."""
        return now - self.failing_since if self.failing_since is not None else 0.0


class Reachability:
    """Marks a peer *unreachable* when it is announced but every heartbeat failed for ``grace``
    seconds; logs a hint (at most every ``hint_every`` seconds) and when it answers again."""

    def __init__(self, grace: float, *, clock: Callable[[], float] = time.monotonic, hint_every: float = 900.0):
        self.grace = grace
        self.clock = clock
        self.hint_every = hint_every
        self._peers: dict[str, _Announced] = {}  # node id -> announced now
        self._hinted_at = float("-inf")

    # -- what discovery and heartbeats tell
    def announced(self, node_id: str, target: str) -> None:
        """A new or changed announcement."""
        peer = self._peers.get(node_id)
        if peer is None or peer.target != target:
            self._peers[node_id] = _Announced(target)

    def withdrawn(self, node_id: str) -> None:
        """No longer announced; liveness is the failure detector's business."""
        self._peers.pop(node_id, None)

    def answered(self, target: str) -> None:
        for peer in self._peers.values():
            if peer.target == target:
                peer.failing_since = None

    def failed(self, target: str, error: str) -> None:
        now = self.clock()
        for peer in self._peers.values():
            if peer.target == target:
                if peer.failing_since is None:
                    peer.failing_since = now
                peer.error = error

    # -- what to say
    def unreachable(self) -> dict[str, _Announced]:
        now = self.clock()
        return {
            nid: p
            for nid, p in self._peers.items()
            if p.failing_since is not None and now - p.failing_since >= self.grace
        }

    def check(self) -> list[tuple[int, str, dict[str, object]]]:
        """Log lines due now, as (level, message, event fields)."""
        now = self.clock()
        out: list[tuple[int, str, dict[str, object]]] = []
        bad = self.unreachable()
        for nid, peer in sorted(bad.items()):
            if peer.reported:
                continue
            peer.reported = True
            message = (
                f"peer {nid} is announced over mDNS but has not answered at {peer.target} for "
                f"{peer.failing_for(now):.0f} s ({peer.error})"
            )
            if now - self._hinted_at >= self.hint_every:
                self._hinted_at = now
                message += ". " + HINT
            out.append((logging.WARNING, message, {"node_id": nid, "address": peer.target, "error": peer.error}))
        for nid, peer in sorted(self._peers.items()):
            if peer.reported and nid not in bad:
                peer.reported = False
                out.append((logging.INFO, f"peer {nid} answers at {peer.target} again", {"node_id": nid}))
        return out

    def report(self) -> list[dict[str, object]]:
        """Each unreachable peer for /v1/mesh."""
        now = self.clock()
        return [
            {"node_id": nid, "address": p.target, "seconds": round(p.failing_for(now), 1), "error": p.error}
            for nid, p in sorted(self.unreachable().items())
        ]
