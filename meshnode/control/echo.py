"""The network's own round trip, measured with a bare TCP echo.

A gRPC call from Python costs several hundred microseconds on its own, more than a wired LAN or a
Thunderbolt bridge adds. A tensor group's ring collectives run in C++ over plain TCP and pay the
network, not that stack; so the planner needs the two apart. Every node runs this echo on
``tensor_port + 2 * TENSOR_PORTS`` (one port after the tensor ports): it answers each fixed-size
frame with the same bytes, from blocking threads, so the measurement sees the network and the
kernel rather than an event loop.

The echo hands nothing to the node and reads nothing it has to trust: it returns what it got,
in frames of :data:`FRAME` bytes, to at most :data:`MAX_CONNECTIONS` clients at a time, each
dropped after :data:`IDLE_S` idle or :data:`MAX_FRAMES` frames.
"""

from __future__ import annotations

import logging
import socket
import statistics
import threading
import time

log = logging.getLogger(__name__)

FRAME = 64
MAX_CONNECTIONS = 8
MAX_FRAMES = 256
IDLE_S = 5.0


class EchoServer:
    def __init__(self, host: str, port: int, delay: float = 0.0):
        self.delay = delay  # seconds each answer waits (tests and benchmarks inject link latency)
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.5)
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="meshnode-echo", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # busy: the prober tries again at its next round
                continue
            threading.Thread(target=self._serve, args=(conn,), name="meshnode-echo-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(IDLE_S)
            for _ in range(MAX_FRAMES):
                frame = _read(conn, FRAME)
                if frame is None or self._stop.is_set():
                    return
                if self.delay:
                    time.sleep(self.delay)
                conn.sendall(frame)
        except OSError:
            return
        finally:
            conn.close()
            self._slots.release()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)


def _read(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


def echo_rtt(host: str, port: int, samples: int = 12, timeout: float = 2.0) -> tuple[float, float]:
    """(median round trip, p90 - p10 spread) in seconds of ``samples`` frames to an echo (blocking:
    run it in a thread). Raises OSError when the echo cannot be reached or answers wrongly."""
    with socket.create_connection((host, port), timeout=timeout) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        frame = bytes(range(FRAME))
        conn.sendall(frame)  # warm up: connection set up, buffers in place
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
