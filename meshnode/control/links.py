"""Measured links: RTT, jitter and bandwidth to every address of every peer, one address at a time,
so the planner can weigh groups against pipelines and data takes the fastest path."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc

from meshnode.control.echo import echo_rtt
from meshnode.planner.plans import tail_round_trip
from meshnode.proto import mesh_pb2, mesh_pb2_grpc

log = logging.getLogger(__name__)

MAX_PROBE_BYTES = 4 * 2**20  # the largest probe payload echoed or accepted
BULK_ROUNDS = 2


@dataclass(frozen=True)
class LinkStat:
    peer: str
    address: str
    rtt_us: float  # TCP echo round trip (the gRPC one where the echo is unreachable)
    jitter_us: float
    bandwidth: float  # bytes/s
    measured_at: float
    rpc_rtt_us: float = 0.0  # a small gRPC call: the network plus the RPC stack

    def to_pb(self) -> mesh_pb2.Link:
        return mesh_pb2.Link(
            peer=self.peer,
            address=self.address,
            rtt_us=self.rtt_us,
            jitter_us=self.jitter_us,
            bandwidth=self.bandwidth,
            measured_at=self.measured_at,
            rpc_rtt_us=self.rpc_rtt_us,
        )

    @classmethod
    def from_pb(cls, msg: mesh_pb2.Link) -> LinkStat:
        values = (msg.rtt_us, msg.jitter_us, msg.bandwidth, msg.rpc_rtt_us)
        if not all(0 <= v < 1e13 for v in values) or len(msg.peer) > 128 or len(msg.address) > 64:
            raise ValueError("link figures out of range")
        return cls(msg.peer, msg.address, msg.rtt_us, msg.jitter_us, msg.bandwidth, msg.measured_at, msg.rpc_rtt_us)

    def to_dict(self) -> dict[str, object]:
        return {
            "peer": self.peer,
            "address": self.address,
            "rtt_us": round(self.rtt_us, 1),
            "rpc_rtt_us": round(self.rpc_rtt_us, 1),
            "jitter_us": round(self.jitter_us, 1),
            "bandwidth": round(self.bandwidth),
            "measured_at": self.measured_at,
        }


def probe_reply(request: mesh_pb2.ProbeRequest) -> mesh_pb2.ProbeReply:
    """Echo back the number of bytes asked for (bounded)."""
    return mesh_pb2.ProbeReply(payload=bytes(min(request.reply_bytes, MAX_PROBE_BYTES)))


TYPICAL_MESSAGE = 16 * 2**10  # bytes, the order of a prefill chunk's activation


def transfer_seconds(link: LinkStat, nbytes: int = TYPICAL_MESSAGE) -> float:
    """A one-way trip at the link's slow moments (as the planner costs it) plus serialisation of ``nbytes``."""
    return tail_round_trip(link.rtt_us, link.jitter_us) * 0.5e-6 + nbytes / max(link.bandwidth, 1.0)


def best(links: Iterable[LinkStat]) -> LinkStat | None:
    """The path that carries a typical message fastest, so a low-latency but throttled path loses,
    and so does one that wanders (Wi-Fi beside Ethernet to the same machine)."""
    ranked = sorted(links, key=lambda s: (transfer_seconds(s), s.address))
    return ranked[0] if ranked else None


class LinkProber:
    """Measures this node's links to its peers in the background."""

    def __init__(
        self,
        channel_for: Callable[[str], grpc.aio.Channel],
        *,
        interval: float = 30.0,
        samples: int = 12,
        bulk_bytes: int = 1 << 20,
        timeout: float = 2.0,
        pause: float = 0.05,
    ):
        self._channel_for = channel_for
        self.interval, self.samples, self.bulk_bytes = interval, samples, min(bulk_bytes, MAX_PROBE_BYTES)
        self.timeout, self.pause = timeout, pause
        self._stats: dict[tuple[str, str], LinkStat] = {}

    async def measure(self, peer: str, address: str, port: int, echo_port: int = 0) -> LinkStat:
        stub = mesh_pb2_grpc.MeshStub(self._channel_for(f"{address}:{port}"))
        small = mesh_pb2.ProbeRequest(payload=b"\0" * 64, reply_bytes=64)
        await stub.Probe(small, timeout=self.timeout)  # connect (and warm up) first
        rtts = []
        for _ in range(self.samples):
            t0 = time.perf_counter()
            await stub.Probe(small, timeout=self.timeout)
            rtts.append(time.perf_counter() - t0)
        rpc_rtt = statistics.median(rtts)
        rtts.sort()
        rtt, jitter = rpc_rtt, rtts[int(0.9 * (len(rtts) - 1))] - rtts[int(0.1 * (len(rtts) - 1))]
        if echo_port:
            try:  # the network's own round trip, without the RPC stack
                rtt, jitter = await asyncio.to_thread(echo_rtt, address, echo_port, self.samples, self.timeout)
            except OSError as exc:
                log.debug("echo of %s at %s:%d failed (%s); RTT from gRPC", peer, address, echo_port, exc)
        bulk = mesh_pb2.ProbeRequest(payload=b"\0" * self.bulk_bytes, reply_bytes=0)
        elapsed = []
        for _ in range(BULK_ROUNDS):
            t0 = time.perf_counter()
            await stub.Probe(bulk, timeout=self.timeout * 5)
            elapsed.append(time.perf_counter() - t0)
        bandwidth = self.bulk_bytes / max(min(elapsed) - rpc_rtt, 1e-6)
        return LinkStat(peer, address, rtt * 1e6, jitter * 1e6, bandwidth, time.time(), rpc_rtt * 1e6)

    async def refresh(self, peers: dict[str, tuple[tuple[str, ...], int, int]]) -> None:
        """Measure every stale (peer, address); forget peers that are gone. ``peers``: node id ->
        (addresses, gRPC port, echo port or 0)."""
        for key in [k for k in self._stats if k[0] not in peers]:
            del self._stats[key]
        now = time.time()
        for peer, (addresses, port, echo_port) in peers.items():
            for address in addresses:
                stat = self._stats.get((peer, address))
                if stat is not None and now - stat.measured_at < self.interval:
                    continue
                try:
                    self._stats[(peer, address)] = await self.measure(peer, address, port, echo_port)
                except (TimeoutError, grpc.aio.AioRpcError) as exc:
                    code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "TIMEOUT"
                    log.debug("probing %s at %s failed: %s", peer, address, code)
                    self._stats.pop((peer, address), None)
                await asyncio.sleep(self.pause)

    async def run(self, peers: Callable[[], dict[str, tuple[tuple[str, ...], int, int]]], period: float = 1.0) -> None:
        while True:
            try:
                await self.refresh(peers())
            except asyncio.CancelledError:
                raise
            except Exception:  # never let measurement take the node down
                log.exception("link measurement failed")
            await asyncio.sleep(period)

    def links(self) -> tuple[LinkStat, ...]:
        return tuple(sorted(self._stats.values(), key=lambda s: (s.peer, s.rtt_us)))

    def best_address(self, peer: str) -> str | None:
        stat = best(s for s in self._stats.values() if s.peer == peer)
        return stat.address if stat else None


def best_paths(
    measured: Iterable[tuple[str, LinkStat]], members: Iterable[str]
) -> dict[frozenset[str], tuple[str, LinkStat]]:
    """The fastest path between each pair of ``members`` by either end: {frozenset({a, b}): (measurer, stat)}."""
    members = set(members)
    out: dict[frozenset[str], tuple[str, LinkStat]] = {}
    for src, stat in measured:
        if src not in members or stat.peer not in members or src == stat.peer or stat.bandwidth <= 0:
            continue
        key = frozenset((src, stat.peer))
        held = out.get(key)
        if held is None or transfer_seconds(stat) < transfer_seconds(held[1]):
            out[key] = (src, stat)
    return out


def ring_address(measured: Iterable[tuple[str, LinkStat]], member: str, group: Iterable[str]) -> str | None:
    """The address of ``member`` its group reaches fastest; None until measured."""
    others = set(group) - {member}
    stats = [stat for src, stat in measured if src in others and stat.peer == member]
    chosen = best(stats)
    return chosen.address if chosen else None
