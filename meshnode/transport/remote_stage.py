"""The calling side of a pipeline stage: a stage a peer holds, as the head calls it (``RemoteStage``),
and one request's stream to it over gRPC ``Forward`` where the data port (meshnode.transport.hop) is
not used.

A step is awaited while the stage's node heartbeats, however long it takes: a step's time says nothing of
liveness. A stage is lost when its node stops heartbeating, refuses or drops the stream, or faults.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, cast

import grpc
import mlx.core as mx

from meshnode.model.scheduler import mlx_idle
from meshnode.model.wire import (
    ACTIVATIONS,
    Placeholder,
    RawReply,
    WireError,
    host_array,
    to_array,
    to_tensor,
)
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.transport.refusals import StageError, StageFault, stage_error

if TYPE_CHECKING:
    from meshnode.transport.streams import StageStream, StreamTicket
    from meshnode.trust.auth import ClusterAuth

log = logging.getLogger(__name__)

POLL = 0.25  # seconds between liveness checks of an awaited stage
KEEP_WAIT = 5.0  # seconds a finished request waits for its stages to keep its prefix


class RemoteSession:
    """One request's gRPC stream to one remote stage, driven from the generation thread."""

    remote: Literal[True] = True

    def __init__(self, stage: RemoteStage, request_id: str, resume: tuple[str, int] | None = None):
        self._stage = stage
        self._request_id = request_id
        self._resume = resume  # the kept prefix to start from
        self._call: grpc.aio.StreamStreamCall | None = None
        # (bound to the node's loop at their first use there)
        self._write_lock, self._read_lock = asyncio.Lock(), asyncio.Lock()
        self._queued = 0  # positions sent and not answered yet
        self._rewind = 0  # positions the stage drops before the next message

    def rewind(self, positions: int) -> None:  # sent with the next message
        self._rewind += positions

    async def _forward(self, tensor: mesh_pb2.Tensor, rewind: int = 0) -> mesh_pb2.ForwardReply:
        st = self._stage
        msg = mesh_pb2.ForwardRequest(input=tensor, rewind=rewind)
        try:
            async with self._write_lock:
                if self._call is None:
                    self._call = st.stub.Forward(timeout=st.request_timeout)
                    msg.request_id, msg.epoch, msg.model = self._request_id, st.epoch, st.model
                    msg.start_layer, msg.end_layer = st.start, st.end
                    if self._resume is not None:
                        msg.resume, msg.resume_length = self._resume
                await self._call.write(msg)
            # Acquired in the order the writes finished: the n-th reader gets the n-th reply.
            async with self._read_lock:
                reply = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise stage_error(st, exc) from None
        if reply is grpc.aio.EOF:
            code = await self._call.code()
            details = await self._call.details()
            raise stage_error(st, None, code, details)
        return cast(mesh_pb2.ForwardReply, reply)  # the Forward stream's replies (mesh.proto)

    def submit(self, x: mx.array, *, next_single: bool = False, work: int = 0) -> RemoteTicket:
        """Send ``x`` without waiting for the reply (``next_single``, ``work``: data port only)."""
        if x.dtype == mx.uint32:
            x = x.astype(mx.int32)
        st = self._stage
        positions = x.shape[1]
        self._queued += positions
        future = asyncio.run_coroutine_threadsafe(self._forward(to_tensor(x), self._rewind), st.loop)
        self._rewind = 0
        return RemoteTicket(self, future, positions)

    def forward(self, x: mx.array) -> mx.array:
        """On the generation thread; the I/O runs on the loop."""
        return self.finish(self.submit(x))

    def finish(self, ticket: StreamTicket, into: Placeholder | None = None) -> mx.array:
        if not ticket.done():
            with mlx_idle():  # others use the MLX thread while this one waits
                ticket.wait()
        return ticket.result(into)

    def keep(self, key: str, positions: int) -> None:
        """Ask the stage to keep this request's KV and end the stream."""
        call = self._call
        if call is None:
            return
        try:
            with mlx_idle():  # network only: as HopSession.keep
                asyncio.run_coroutine_threadsafe(self._keep(call, key, positions), self._stage.loop).result(KEEP_WAIT)
        except Exception as exc:  # noqa: BLE001 - the answer is complete; only the cache is lost
            log.debug("stage [%d, %d) did not take the prefix to keep: %s", self._stage.start, self._stage.end, exc)

    async def _keep(self, call: grpc.aio.StreamStreamCall, key: str, positions: int) -> None:
        async with self._write_lock:
            await call.write(mesh_pb2.ForwardRequest(keep=key, keep_length=positions))
            await call.done_writing()
        async with self._read_lock:  # replies still in flight, then the stream's end
            while await call.read() is not grpc.aio.EOF:
                pass

    def close(self) -> None:
        if self._call is not None:
            call, self._call = self._call, None
            self._stage.loop.call_soon_threadsafe(call.cancel)


class RemoteTicket:
    """One message sent to a remote stage; ``result`` checks and decodes its reply."""

    def __init__(
        self, session: RemoteSession, future: concurrent.futures.Future[mesh_pb2.ForwardReply], positions: int
    ):
        self.session, self.future, self.positions = session, future, positions
        self.sent = time.perf_counter()

    def done(self) -> bool:
        return self.future.done()

    def wait_handle(self) -> concurrent.futures.Future[mesh_pb2.ForwardReply]:
        return self.future

    def check(self) -> None:
        """Raise StageError if the stage is lost while this reply is awaited."""
        if not self.future.done():
            try:
                self.session._stage.check(self.sent)
            except StageError:
                self.future.cancel()
                raise

    def wait(self) -> None:
        """Block until the reply is here, while the stage is alive."""
        st = self.session._stage
        while not self.future.done():
            concurrent.futures.wait([self.future], timeout=st.poll)
            self.check()

    def result(self, into: Placeholder | None = None) -> mx.array:
        st = self.session._stage
        self.wait()
        reply = self.future.result()
        self.session._queued -= self.positions
        return st.accept(reply, self.positions, self.sent, "grpc", into)


class RemoteStage:
    """A stage held by a peer, as the generation thread sees it."""

    def __init__(
        self,
        *,
        node_id: str,
        channel: grpc.aio.Channel,
        loop: asyncio.AbstractEventLoop,
        start: int,
        end: int,
        epoch: int,
        hidden_size: int,
        hop_timeout: float,
        request_timeout: float = 3600.0,
        observe: Callable[[float, int, float, str], None] | None = None,
        data_port: Callable[[], tuple[str, int] | None] | None = None,
        auth: ClusterAuth | None = None,
        caller: str = "",
        alive: Callable[[], bool] | None = None,
        data_session: Callable[..., StageStream] | None = None,
        model: str = "",
    ):
        # Opens a stream over the peer's data port; None: all go over gRPC.
        self.data_session = data_session
        # Called with (seconds, positions, stage seconds, transport) after each round trip.
        self.observe = observe
        # Whether the stage's node heartbeats now (None: request_timeout alone bounds the wait).
        self.alive = alive
        # The peer's data port on its fastest address now (None: gRPC), asked at each stream's opening.
        self.data_port = data_port or (lambda: None)
        self.auth, self.caller = auth, caller
        self.node_id = node_id
        self.stub = mesh_pb2_grpc.MeshStub(channel)
        self.loop = loop
        self.start, self.end, self.epoch, self.model = start, end, epoch, model  # model: "" = the peer's first
        self.hidden_size = hidden_size
        self.hop_timeout = hop_timeout  # connecting to the stage (a refused or silent port is lost)
        self.poll = min(POLL, hop_timeout / 2)
        self.request_timeout = request_timeout
        self.prefill_rate: float | None = None  # seconds a position took here in the last prefill

    def accept(
        self,
        reply: mesh_pb2.ForwardReply | RawReply,
        positions: int,
        sent: float,
        transport: str,
        into: Placeholder | None = None,
    ) -> mx.array:
        """A reply's activation, checked against the plan; written into ``into`` when given."""
        if self.observe is not None:
            self.observe(time.perf_counter() - sent, positions, reply.stage_seconds, transport)
        try:
            if isinstance(reply, RawReply):
                array, dtype = reply.host(positions, self.hidden_size), reply.dtype
            else:
                array = host_array(reply.output, dtypes=ACTIVATIONS, expect=(1, positions, self.hidden_size))
                dtype = reply.output.dtype
            if into is not None:
                into.fill(array, dtype)
                return into.array
            return to_array(array, dtype)
        except WireError as exc:
            raise StageFault(
                f"stage [{self.start}, {self.end}) on {self.node_id} sent a bad activation: {exc}"
            ) from None

    def check(self, waiting_since: float) -> None:
        """Raise :class:`StageError` if this stage's node stopped heartbeating or reports a step past
        stall_timeout; an alive stage is busy, not lost."""
        waited = time.perf_counter() - waiting_since
        if self.alive is not None and not self.alive():
            raise StageError(
                f"stage [{self.start}, {self.end}) on {self.node_id} stopped heartbeating or is "
                f"stalled (its reply awaited {waited:.1f} s)"
            )
        if waited > self.request_timeout:
            raise StageError(
                f"stage [{self.start}, {self.end}) on {self.node_id} did not answer within {self.request_timeout:.0f} s"
            )

    def open(self, request_id: str, resume: tuple[str, int] | None = None) -> StageStream:
        """The request's stream to this stage: the data port where it has one, else gRPC."""
        found = self.data_port()
        if found is not None and self.auth is not None and self.data_session is not None:
            host, port = found
            try:
                return self.data_session(
                    self, request_id, host, port, auth=self.auth, node_id=self.caller, resume=resume
                )
            except OSError as exc:  # an older peer, or its data port blocked: gRPC still works
                log.info(
                    "data port of %s at %s:%d unreachable (%s); activations go over gRPC", self.node_id, host, port, exc
                )
                self.data_port = lambda: None
        return RemoteSession(self, request_id, resume)
