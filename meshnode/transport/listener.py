"""A TCP listener that serves each connection on a blocking thread of its own.

A thread blocking in ``recv`` costs the kernel's round trip and little else, unlike an event loop.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class ThreadedListener:
    """Runs ``serve`` for each connection on its own thread, at most ``max_connections`` at once."""

    def __init__(
        self, host: str, port: int, serve: Callable[[socket.socket, str], None], *, name: str, max_connections: int
    ):
        self._serve = serve
        self._name = name
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.5)
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=name, daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # busy: the caller tries again, or uses another path
                continue
            with self._lock:
                self._open.add(conn)
            threading.Thread(
                target=self._run, args=(conn, str(addr[0])), name=f"{self._name}-conn", daemon=True
            ).start()

    def _run(self, conn: socket.socket, host: str) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._serve(conn, host)
        except OSError:
            pass  # the peer went away, or we are stopping
        except Exception:  # a bug in a handler must not take the listener down
            log.exception("%s: serving %s failed", self._name, host)
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()
            self._slots.release()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        with self._lock:
            conns = list(self._open)
        for conn in conns:  # wake threads blocked in recv
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2)


def recv_exact(conn: socket.socket, n: int) -> bytearray | None:
    """Exactly ``n`` bytes, or None when the peer closed first (at a boundary or mid-way)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return buf
