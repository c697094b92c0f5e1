"""A pipeline hop over the data port (meshnode.transport.dataport): activations in bare TCP frames.

Serving side (:func:`serve_forward`): each frame after the hello is run on the connection's own
thread under the MLX baton, with the gRPC path's checks; a refusal is a ``ForwardReply`` with
``code`` and ``error``, then the stream closes. Head side (:class:`HopSession`): the generation
thread sends and reads itself, one ``send`` and one ``recv`` per hop; replies come back in order.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import grpc
import mlx.core as mx
from google.protobuf.message import DecodeError

from meshnode.model.scheduler import mlx_idle, set_priority
from meshnode.model.wire import (
    TAKES_RAW,
    RawReply,
    RawRequest,
    WireError,
    is_raw,
    raw_reply_into,
    raw_request_into,
    to_tensor,
)
from meshnode.proto import mesh_pb2
from meshnode.tracing import mark
from meshnode.transport.dataport import (
    HEADER,
    FrameError,
    connect,
    recv_frame,
    recv_frame_into,
    send_frame,
    send_prepared,
)
from meshnode.transport.refusals import InvalidInput, StageError, stage_error
from meshnode.transport.stage_server import KEPT

if TYPE_CHECKING:
    from meshnode.model.wire import Placeholder
    from meshnode.transport.remote_stage import RemoteStage
    from meshnode.transport.stage_server import OpenStage, StageServer
    from meshnode.transport.streams import StreamTicket
    from meshnode.trust.auth import ClusterAuth

log = logging.getLogger(__name__)

# Runs ``fn`` on this thread holding the node's MLX baton (TokenScheduler.run_here).
RunHere = Callable[[Callable[[], Any]], Any]
IDLE_TIMEOUT = 3600.0  # seconds without a message before a stream is dropped
FRAME_STALL = 30.0  # seconds a started reply may stop arriving before the stream is lost
# Linux wakes a socket's reader on the waker's CPU, so a local peer would wait for this thread's
# time slice; one sched_yield after a send lets it run first.
_yield = getattr(os, "sched_yield", lambda: None)
WRITE_INLINE = 64 * 1024  # larger frames go out from the writer thread, never blocking the head


# --------------------------------------------------------------------------- serving side

# A test harness's seam: given a request's id, returns a function called with each message's positions
# on the stream's thread without the baton; what that returns, if anything, runs inside the stage's step
# under the baton (waiting there stalls the step, raising is the stage's fault).
StreamHook = Callable[[str], Callable[[int], "Callable[[], None] | None"]]


def serve_forward(
    server: StageServer,
    run_here: RunHere,
    conn: socket.socket,
    opening: mesh_pb2.DataOpen,
    host: str,
    hook: StreamHook | None = None,
) -> None:
    """Serve one request's stream to one stage until the head closes it.

    ``run_here(fn)`` runs ``fn`` on this thread holding the node's MLX baton.
    """
    request_id = opening.forward.request_id or "?"
    raw = opening.forward.raw_replies
    before = hook(request_id) if hook is not None else None
    out = bytearray()  # raw replies are written here, token after token
    try:
        stage = server.open(opening.forward)
    except StageError as refusal:
        refuse(conn, refusal)
        return
    conn.settimeout(IDLE_TIMEOUT)
    # Batched decode steps find this request's cache by this name.
    key = stream_key(opening.forward.request_id, opening.forward.start_layer, opening.forward.end_layer)
    if opening.forward.request_id:
        server.streams[key] = stage
    try:
        while True:
            try:
                frame = recv_frame(conn)
                if frame is None:
                    return  # the head is done with this request
                mark("stage.arrived")
                msg = RawRequest(frame) if raw and is_raw(frame) else mesh_pb2.ForwardRequest.FromString(bytes(frame))
            except (FrameError, DecodeError, WireError) as exc:
                log.warning("refused a malformed frame from %s for %s: %s", host, request_id, exc)
                refuse(conn, InvalidInput("malformed ForwardRequest"))
                return
            # The request's last message: keep its KV, then say so.
            if not isinstance(msg, RawRequest) and msg.keep:
                run_here(partial(stage.keep, msg))
                send_frame(conn, KEPT_FRAME)
                continue
            positions = (
                msg.positions if isinstance(msg, RawRequest) else msg.input.shape[1] if len(msg.input.shape) > 1 else 0
            )
            inside = before(positions) if before is not None else None
            # A prefill chunk claims the baton with its prompt left; without work, its own positions count.
            set_priority(msg.work or (positions if positions > 1 else 0))
            try:
                stage.admit(positions, msg.rewind)
                if inside is not None:
                    run_here(partial(_run_hook, stage, inside, request_id))
                if raw:
                    n = run_here(partial(_run_raw, stage, msg, out))
                else:
                    payload = run_here(partial(_run_message, stage, msg))
            except StageError as refusal:
                if isinstance(refusal, InvalidInput):
                    log.warning("refused a malformed activation from %s for %s: %s", host, request_id, refusal)
                refuse(conn, refusal)
                return
            if server.inject_latency:
                time.sleep(server.inject_latency)
            mark("stage.computed")
            if raw:
                send_prepared(conn, out, n)
            else:
                send_frame(conn, payload)
            mark("stage.sent")
            _yield()
            if msg.next_single:  # build the next step while the rest of the pipeline works
                run_here(stage.prepare)
                mark("stage.prepared")
    finally:
        if server.streams.get(key) is stage:
            del server.streams[key]
        if stage.batch is not None:  # taking its cache out of the batch is MLX work: under the baton
            run_here(stage.close)
        else:
            stage.close()


def stream_key(request_id: str, start: int, end: int) -> tuple[str, int, int]:
    """How :attr:`StageServer.streams` names a request's own stream to a stage."""
    return request_id, start, end


def _run_hook(stage: OpenStage, inside: Callable[[], None], request_id: str) -> None:
    """A hook's part of a step, on the MLX thread; what it raises is the stage's fault."""
    server = stage.server
    with server.steps.step():
        try:
            inside()
        except Exception as exc:  # noqa: BLE001 - reported as the stage's computation raising
            raise server.fault(stage.shard, "this input", f"{request_id}'s input", exc) from None


def _run_message(stage: OpenStage, msg: mesh_pb2.ForwardRequest | RawRequest) -> bytes:
    output, seconds = stage.run(msg)
    reply: bytes = mesh_pb2.ForwardReply(output=output, stage_seconds=seconds).SerializeToString()
    return reply


def _run_raw(stage: OpenStage, msg: mesh_pb2.ForwardRequest | RawRequest, buf: bytearray) -> int:
    """Run ``msg`` and write its raw reply (with TAKES_RAW) into ``buf`` after the frame header; its length."""
    mark("stage.running")
    started = time.perf_counter()
    out = stage.run_array(msg)
    return raw_reply_into(buf, HEADER, out, time.perf_counter() - started, TAKES_RAW)


def refuse(conn: socket.socket, refusal: StageError) -> None:
    """Send ``refusal`` as a reply's status and details: the head reads it as the gRPC status."""
    try:
        send_frame(conn, mesh_pb2.ForwardReply(code=refusal.code.value[0], error=str(refusal)).SerializeToString())
    except OSError:
        pass


_CODES = {c.value[0]: c for c in grpc.StatusCode}
KEPT_FRAME = KEPT.SerializeToString()


# --------------------------------------------------------------------------- head side


class HopSession:
    """One request's stream to one remote stage over its data port, driven from the generation thread."""

    remote: Literal[True] = True

    def __init__(
        self,
        stage: RemoteStage,
        request_id: str,
        host: str,
        port: int,
        *,
        auth: ClusterAuth,
        node_id: str,
        resume: tuple[str, int] | None = None,
    ):
        self._stage = stage
        opening = mesh_pb2.DataOpen(
            forward=mesh_pb2.ForwardRequest(
                request_id=request_id,
                epoch=stage.epoch,
                start_layer=stage.start,
                end_layer=stage.end,
                raw_replies=True,
                model=stage.model,
            )
        )
        if resume is not None:  # start from a prefix the stage kept
            opening.forward.resume, opening.forward.resume_length = resume
        self._sock = connect(host, port, auth=auth, node_id=node_id, opening=opening, timeout=stage.hop_timeout)
        # Replies are awaited with select, liveness checked in between.
        self._sock.settimeout(FRAME_STALL)
        self._unanswered: deque[HopTicket] = deque()
        self._queued = 0  # positions sent and not answered yet
        self._writes: queue.Queue[bytes | None] | None = None  # frames for the writer thread
        self._writing = 0  # frames handed to it and not yet written
        self._write_error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._spare: bytearray | None = None  # a raw reply's buffer, back from the last reply used
        self._rewind = 0  # positions the stage drops before the next message
        self._takes_raw = False  # the stage reads raw decode steps
        self._out = bytearray(64)  # a raw decode step is written here, token after token

    def rewind(self, positions: int) -> None:
        """Drop the last ``positions`` of the stage's KV for this request, with the next message."""
        self._rewind += positions

    # -- writing
    def submit(self, x: mx.array, *, next_single: bool = False, work: int = 0) -> HopTicket:
        """Send ``x`` without waiting for the reply. ``next_single``: the next message is one position,
        so the stage may build it ahead."""
        mark("head.submit")
        mx.eval(x)  # the head's own step ends here (its bytes go on the wire)
        mark("head.evaluated")
        positions = x.shape[1]
        if self._takes_raw and positions == 1 and not work:  # a decode step: no message to build
            n = raw_request_into(self._out, HEADER, x, next_single, self._rewind)
            payload = None
        else:
            if x.dtype == mx.uint32:
                x = x.astype(mx.int32)
            payload = mesh_pb2.ForwardRequest(
                input=to_tensor(x), next_single=next_single, work=work, rewind=self._rewind
            ).SerializeToString()
        mark("head.serialized")
        self._rewind = 0
        self._queued += positions
        ticket = HopTicket(self, positions)
        self._unanswered.append(ticket)
        try:
            with self._lock:  # behind frames already queued, or large: the writer thread sends it
                later = self._writing > 0 or (payload is not None and len(payload) > WRITE_INLINE)
                self._writing += later
            if later:
                self._write_later(payload if payload is not None else bytes(self._out[HEADER : HEADER + n]))
            else:
                if payload is None:
                    send_prepared(self._sock, self._out, n)
                else:
                    send_frame(self._sock, payload)
                mark("head.sent")
                _yield()
        except OSError as exc:
            raise self._lost(exc) from None
        return ticket

    def _write_later(self, payload: bytes) -> None:
        if self._write_error is not None:
            raise self._lost(self._write_error)
        if self._writes is None:
            self._writes = queue.Queue()
            threading.Thread(target=self._writer, args=(self._writes,), name="meshnode-hop-writer", daemon=True).start()
        self._writes.put(payload)

    def _writer(self, writes: queue.Queue[bytes | None]) -> None:
        while True:
            payload = writes.get()
            if payload is None:
                return
            try:
                send_frame(self._sock, payload)
            except OSError as exc:
                self._write_error = exc
                return
            finally:
                with self._lock:
                    self._writing -= 1

    # -- reading
    def readable(self) -> bool:
        return bool(select.select([self._sock], [], [], 0)[0])

    def fileno(self) -> int:
        return self._sock.fileno()

    def _read_next(self) -> None:
        """Read one reply for the oldest unanswered ticket, waiting while the stage is alive."""
        ticket = self._unanswered[0]
        spare, self._spare = self._spare, None  # the reply is read into it, or it is not needed
        reply = read_reply(self._sock, self._stage, ticket.sent, spare)
        if type(reply) is RawReply and reply.flags & TAKES_RAW:
            self._takes_raw = True
        self._unanswered.popleft()
        ticket.reply = reply

    def _lost(self, exc: BaseException) -> StageError:
        return lost(self._stage, exc)

    def forward(self, x: mx.array) -> mx.array:
        """One activation through the stage and back; other generations use MLX meanwhile."""
        return self.finish(self.submit(x))

    def finish(self, ticket: StreamTicket, into: Placeholder | None = None) -> mx.array:
        """The reply to ``ticket``; other generations use MLX while this one waits."""
        if not ticket.done():
            with mlx_idle():
                ticket.wait()
        return ticket.result(into)

    def keep(self, key: str, positions: int) -> None:
        """Ask the stage to keep this request's KV and wait for its KEPT, so the next turn finds it."""
        payload = mesh_pb2.ForwardRequest(keep=key, keep_length=positions).SerializeToString()
        # Without the baton: two nodes keeping requests whose stages the other serves would deadlock.
        with mlx_idle():
            self._keep(payload)

    def _keep(self, payload: bytes) -> None:
        try:
            with self._lock:
                later = self._writing > 0
                self._writing += later
            if later:
                self._write_later(payload)
            else:
                send_frame(self._sock, payload)
            self._unanswered.append(HopTicket(self, 0))  # the stage's KEPT, after the replies in flight
            while self._unanswered:
                self._read_next()
        except (OSError, StageError) as exc:  # the answer is complete; only the cache is lost
            log.debug("stage [%d, %d) did not take the prefix to keep: %s", self._stage.start, self._stage.end, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._writes is not None:
            self._writes.put(None)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def read_reply(
    sock: socket.socket, st: RemoteStage, sent: float, spare: bytearray | None = None, stream: str = "data stream"
) -> mesh_pb2.ForwardReply | RawReply:
    """The next reply from stage ``st``, waited for while it is alive; failures raise :class:`StageError`."""
    try:
        while not select.select([sock], [], [], st.poll)[0]:
            st.check(sent)
        mark("head.readable")
        got = recv_frame_into(sock, spare)
    except TimeoutError:
        raise StageError(
            f"stage [{st.start}, {st.end}) on {st.node_id} stopped sending in the middle of "
            f"a reply ({FRAME_STALL:.0f} s)"
        ) from None
    except (OSError, FrameError, ValueError) as exc:
        raise lost(st, exc, stream) from None
    if got is None:
        raise lost(st, ConnectionError("the stage closed the stream"), stream)
    frame, buf = got
    try:
        reply = RawReply(frame, buf) if is_raw(frame) else mesh_pb2.ForwardReply.FromString(bytes(frame))
    except (WireError, DecodeError):
        raise StageError(f"stage [{st.start}, {st.end}) on {st.node_id} sent a reply that does not parse") from None
    if not isinstance(reply, RawReply) and (reply.error or reply.code):
        raise stage_error(st, None, _CODES.get(reply.code, grpc.StatusCode.UNKNOWN), reply.error)
    return reply


def lost(st: RemoteStage, exc: BaseException, stream: str = "data stream") -> StageError:
    return StageError(f"stage [{st.start}, {st.end}) on {st.node_id}: {stream} lost ({exc})")


class HopTicket:
    """One message sent over a hop; ``result`` checks and decodes its reply."""

    def __init__(self, session: HopSession, positions: int):
        self.session, self.positions = session, positions
        self.sent = time.perf_counter()
        self.reply: mesh_pb2.ForwardReply | RawReply | None = None

    def done(self) -> bool:
        if self.reply is None and self.session._unanswered[0] is self and self.session.readable():
            self.wait()
        return self.reply is not None

    def wait(self) -> None:
        """Block until the reply is here, while the stage is alive (no MLX work)."""
        while self.reply is None:
            self.session._read_next()

    def check(self) -> None:
        """Raise StageError if the stage is lost while this reply is awaited."""
        if self.reply is None:
            self.session._stage.check(self.sent)

    def wait_handle(self) -> HopSession:
        return self.session

    def result(self, into: Placeholder | None = None) -> mx.array:
        self.wait()
        session, reply = self.session, self.reply
        assert reply is not None, "wait() read it"
        session._queued -= self.positions
        out = session._stage.accept(reply, self.positions, self.sent, "tcp", into)
        if type(reply) is RawReply:  # its bytes are copied out: the next reply may be read there
            session._spare = reply.buffer
        return out
