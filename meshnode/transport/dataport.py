"""The data port: a bare TCP stream beside gRPC, for the per-token hot path.

A grpcio round trip costs many times a TCP one, so activations travel here in frames: a uint32
length, then a protobuf message or a raw reply or step (meshnode.model.wire). Nothing is unpickled;
every frame's length is bounded before it is read. A stream opens with a :class:`DataHello` signed
and checked as a gRPC call is; with ``encrypt = true`` this port is not opened.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from google.protobuf.message import DecodeError

from meshnode.errors import MeshnodeError
from meshnode.model.wire import LENGTH, MAX_TENSOR_BYTES
from meshnode.proto import mesh_pb2
from meshnode.transport.listener import ThreadedListener, recv_exact
from meshnode.trust.auth import HEADER_MAC, HEADER_NODE, HEADER_NONCE, HEADER_TS, ClusterAuth

log = logging.getLogger(__name__)

HELLO_METHOD = "/meshnode.v1.Data/Open"
MAX_HELLO = 64 * 1024
MAX_FRAME = MAX_TENSOR_BYTES + 64 * 1024  # one activation and its envelope
HELLO_TIMEOUT = 5.0
MAX_CONNECTIONS = 256
_INLINE = 64 * 1024  # frames up to this size go out in one send


class FrameError(MeshnodeError, ValueError):
    """A frame that breaks the protocol: too long, cut short, or not the message it must be."""


def send_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) > MAX_FRAME:
        raise FrameError(f"frame of {len(payload)} bytes exceeds the limit of {MAX_FRAME}")
    if len(payload) <= _INLINE:
        sock.sendall(LENGTH.pack(len(payload)) + payload)
    else:  # no copy of a large activation just to put 4 bytes in front of it
        sock.sendall(LENGTH.pack(len(payload)))
        sock.sendall(payload)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME) -> bytearray | None:
    """The next frame's payload, or None if the peer closed the stream between frames."""
    header = recv_exact(sock, LENGTH.size)
    if header is None:
        return None
    (n,) = LENGTH.unpack(header)
    if n > max_bytes:
        raise FrameError(f"frame of {n} bytes announced (limit {max_bytes})")
    payload = recv_exact(sock, n)
    if payload is None:
        raise FrameError("stream closed inside a frame")
    return payload


HEADER = LENGTH.size  # bytes before a frame's payload


def send_prepared(sock: socket.socket, buf: bytearray, n: int) -> None:
    """Send the ``n``-byte payload the caller wrote into ``buf`` after :data:`HEADER` free bytes."""
    if n > MAX_FRAME:
        raise FrameError(f"frame of {n} bytes exceeds the limit of {MAX_FRAME}")
    LENGTH.pack_into(buf, 0, n)
    with memoryview(buf) as view:
        sock.sendall(view[: HEADER + n])


def recv_frame_into(
    sock: socket.socket, spare: bytearray | None, max_bytes: int = MAX_FRAME
) -> tuple[memoryview, bytearray] | None:
    """As :func:`recv_frame`, into ``spare`` when large enough: (payload, buffer)."""
    header = recv_exact(sock, HEADER)
    if header is None:
        return None
    (n,) = LENGTH.unpack(header)
    if n > max_bytes:
        raise FrameError(f"frame of {n} bytes announced (limit {max_bytes})")
    buf = spare if spare is not None and len(spare) >= n else bytearray(n)
    view = memoryview(buf)[:n]
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise FrameError("stream closed inside a frame")
        got += k
    return view, buf


def hello(auth: ClusterAuth, node_id: str, opening: mesh_pb2.DataOpen) -> bytes:
    body = opening.SerializeToString()
    fields = dict(auth.sign(HELLO_METHOD, node_id, body))
    data: bytes = mesh_pb2.DataHello(
        open=body, ts=fields[HEADER_TS], nonce=fields[HEADER_NONCE], node=fields[HEADER_NODE], mac=fields[HEADER_MAC]
    ).SerializeToString()
    return data


def connect(
    host: str, port: int, *, auth: ClusterAuth, node_id: str, opening: mesh_pb2.DataOpen, timeout: float
) -> socket.socket:
    """A stream to a peer's data port, hello sent (the verdict comes with the first reply)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keepalive(sock)
        send_frame(sock, hello(auth, node_id, opening))
    except BaseException:
        sock.close()
        raise
    return sock


def keepalive(sock: socket.socket, idle: int = 10, interval: int = 5, probes: int = 3) -> None:
    """TCP keepalive, so a vanished peer's KV cache is freed within seconds, not at the idle timeout."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPALIVE", idle),  # Linux / macOS spelling
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", probes),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
            except OSError:
                pass


Handler = Callable[[socket.socket, mesh_pb2.DataOpen, str], None]


class DataServer:
    """Accepts data streams, checks each hello, hands the stream to the handler of what it opens."""

    def __init__(self, host: str, port: int, *, auth: ClusterAuth, verify: bool, forward: Handler):
        self._auth, self._verify = auth, verify
        self._forward = forward
        self._listener = ThreadedListener(
            host, port, self._serve, name="meshnode-data", max_connections=MAX_CONNECTIONS
        )
        self.port = self._listener.port

    def _serve(self, conn: socket.socket, host: str) -> None:
        keepalive(conn)
        conn.settimeout(HELLO_TIMEOUT)
        try:
            frame = recv_frame(conn, MAX_HELLO)
            if frame is None:
                return
            msg = mesh_pb2.DataHello.FromString(bytes(frame))
        except (FrameError, DecodeError, TimeoutError) as exc:
            self._auth.log_refusal(host, "data stream", f"bad hello ({exc or type(exc).__name__})")
            return
        if self._verify:
            reason = self._auth.check(
                HELLO_METHOD,
                [(HEADER_TS, msg.ts), (HEADER_NONCE, msg.nonce), (HEADER_NODE, msg.node), (HEADER_MAC, msg.mac)],
                msg.open,
            )
            if reason is not None:
                self._auth.log_refusal(host, "data stream", reason)
                return
        try:
            opening = mesh_pb2.DataOpen.FromString(msg.open)
        except DecodeError:
            self._auth.log_refusal(host, "data stream", "signed opening does not parse")
            return
        if opening.HasField("forward"):
            self._forward(conn, opening, host)
        else:
            self._auth.log_refusal(host, "data stream", "opens nothing this node serves")

    def close(self) -> None:
        self._listener.close()
