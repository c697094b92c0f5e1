"""The network's own round trip via a bare TCP echo: a tensor ring pays only the network, a gRPC call
also the RPC stack. The echo trusts nothing it reads and bounds clients and frames."""

from __future__ import annotations

import logging
import socket
import statistics
import time

from meshnode.transport.listener import ThreadedListener, recv_exact

log = logging.getLogger(__name__)

FRAME = 64
MAX_CONNECTIONS = 8
MAX_FRAMES = 256
IDLE_S = 5.0


class EchoServer:
    def __init__(self, host: str, port: int, delay: float = 0.0):
        self.delay = delay  # seconds per answer: injected link latency for tests
        self._listener = ThreadedListener(
            host, port, self._serve, name="meshnode-echo", max_connections=MAX_CONNECTIONS
        )
        self.port = self._listener.port

    def _serve(self, conn: socket.socket, _host: str) -> None:
        conn.settimeout(IDLE_S)
        for _ in range(MAX_FRAMES):
            frame = _read(conn, FRAME)
            if frame is None or self._listener.stopped:
                return
            if self.delay:
                time.sleep(self.delay)
            conn.sendall(frame)

    def close(self) -> None:
        self._listener.close()


def _read(conn: socket.socket, n: int) -> bytes | None:
    buf = recv_exact(conn, n)
    return None if buf is None else bytes(buf)


def echo_rtt(host: str, port: int, samples: int = 12, timeout: float = 2.0) -> tuple[float, float]:
    """(median round trip, p90 - p10 spread); blocking. OSError on failure."""
    with socket.create_connection((host, port), timeout=timeout) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        frame = bytes(range(FRAME))
        conn.sendall(frame)  # warm up
        if _read(conn, FRAME) != frame:
            raise OSError("echo answered something else")
        rtts = []
        for _ in range(samples):
            t0 = time.perf_counter()
            conn.sendall(frame)
            got = _read(conn, FRAME)
            rtts.append(time.perf_counter() - t0)
            if got != frame:
                raise OSError("echo answered something else")
    rtts.sort()
    return statistics.median(rtts), rtts[int(0.9 * (len(rtts) - 1))] - rtts[int(0.1 * (len(rtts) - 1))]
