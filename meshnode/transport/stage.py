"""The pipeline's data plane over gRPC, and the stage logic every transport shares.

gRPC carries activations where the data port (meshnode.transport.hop) is not used. A step is
awaited while the stage's node heartbeats, however long it takes: a step's time says nothing of
liveness. A stage is lost when its node stops heartbeating, refuses or drops the stream, or faults.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import grpc
import mlx.core as mx
import numpy as np
from google.protobuf.message import DecodeError

from meshnode.model.decode_batch import cache_of, take_back
from meshnode.model.rewind import CannotRewind
from meshnode.model.scheduler import StepWatch, mlx_idle
from meshnode.model.tensor import TensorGroupError
from meshnode.model.wire import (
    ACTIVATIONS,
    Placeholder,
    RawReply,
    RawRequest,
    WireError,
    check_activation,
    check_tokens,
    host_array,
    to_array,
    to_tensor,
)
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.transport.refusals import (
    FAULT,
    STATUS,
    ContextExceeded,
    InvalidInput,
    PrefixMiss,
    StageError,
    StageFault,
    StagePending,
    StageRefused,
    StageUnavailable,
    stage_error,
)

if TYPE_CHECKING:
    from meshnode.model.decode_batch import DecodeBatch
    from meshnode.model.layer_shard import LayerShard
    from meshnode.model.pace import Pace
    from meshnode.model.prefixes import PrefixStore
    from meshnode.model.scheduler import TokenScheduler
    from meshnode.transport.streams import StageStream, StreamTicket
    from meshnode.trust.auth import ClusterAuth

log = logging.getLogger(__name__)

POLL = 0.25  # seconds between liveness checks of an awaited stage
KEEP_WAIT = 5.0  # seconds a finished request waits for its stages to keep its prefix
# The answer to a keep (not an empty frame, which reads as end of stream).
KEPT = mesh_pb2.ForwardReply(output=mesh_pb2.Tensor())


class StageServer:
    """Serves ``Forward`` streams for the shards this node holds in the current plan."""

    def __init__(
        self,
        scheduler: TokenScheduler,
        *,
        vocab_size: int,
        max_chunk: int,
        max_context: int,
        inject_latency: float = 0.0,
        prefixes: PrefixStore | None = None,
        pace: Pace | None = None,
        model: str = "",
        on_fault: Callable[[str], object] | None = None,
    ):
        self.scheduler = scheduler
        self.pace, self.model = pace, model  # the pace is told the time of every one-position step
        self.prefixes = prefixes  # the prompt cache's kept prefixes (None: off)
        self.inject_latency = inject_latency  # seconds added to every reply (tests)
        self.vocab_size = vocab_size
        self.max_chunk = max_chunk
        self.max_context = max_context
        # epoch -> its shards; two epochs while a new plan loads (make before break).
        self.epochs: dict[int, dict[tuple[int, int], LayerShard]] = {}
        # Told of every fault of a served stage, from whichever thread ran it.
        self.on_fault = on_fault
        self.steps = StepWatch()  # a step that never ends is a stalled node
        # Batched decode steps: open data-port streams, by stream_key.
        self.streams: dict[tuple[str, int, int], OpenStage] = {}
        self.batches: dict[int, DecodeBatch] = {}  # by batch stream

    def fault(self, shard: LayerShard, what: str, whose: str, exc: BaseException) -> StageFault:
        """The refusal for ``shard`` raising on ``what``, logged and told to on_fault."""
        spec = shard.spec
        log.exception("layers [%d, %d) failed on %s", spec.start, spec.end, whose)
        error = f"layers [{spec.start}, {spec.end}) failed on {what}: {type(exc).__name__}: {exc}"
        if self.on_fault is not None:
            self.on_fault(error)
        return StageFault(f"{FAULT}{error}")

    def serve(self, epoch: int, shards: dict[tuple[int, int], LayerShard]) -> None:
        self.epochs[epoch] = dict(shards)

    def retire_before(self, epoch: int) -> None:
        for old in [e for e in self.epochs if e < epoch]:
            del self.epochs[old]
        if self.prefixes is not None:  # free prefixes of layers no longer served
            served = {key for shards in self.epochs.values() for key in shards}
            for layers in self.prefixes.layer_ranges():
                if layers not in served:
                    self.prefixes.forget(layers)

    def open(self, msg: mesh_pb2.ForwardRequest) -> OpenStage:
        """One request's use of a stage served here (raises a :class:`StageError` kind)."""
        key = (msg.start_layer, msg.end_layer)
        shard = self.shard_for(msg)
        cache = None
        if msg.resume:
            cache, why = (
                self.prefixes.resume(key, msg.resume, msg.resume_length, shard)
                if self.prefixes is not None and shard.keeps_prefixes
                else (None, "no prompt cache here")
            )
            if cache is None:
                raise PrefixMiss(
                    f"prefix {msg.resume} ({msg.resume_length} positions) of layers [{key[0]}, {key[1]}): {why}",
                )
        return OpenStage(self, shard, cache, msg.resume_length if cache is not None else 0)

    def shard_for(self, msg: mesh_pb2.ForwardRequest) -> LayerShard:
        """The shard a stream's opening names, or a :class:`StageError` kind."""
        key = (msg.start_layer, msg.end_layer)
        if msg.epoch not in self.epochs:
            serving = sorted(self.epochs) or "none"
            if msg.epoch > max(self.epochs, default=0):  # a plan this node is still adopting or loading
                raise StagePending(f"epoch {msg.epoch} is not served here yet (serving {serving})")
            raise StageRefused(f"epoch {msg.epoch} is not served here (serving {serving})")
        shard = self.epochs[msg.epoch].get(key)
        if shard is None:
            raise StageUnavailable(f"layers [{key[0]}, {key[1]}) are not loaded here")
        return shard

    async def forward(
        self, requests: AsyncIterator[mesh_pb2.ForwardRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[mesh_pb2.ForwardReply]:
        stage: OpenStage | None = None
        try:
            async for msg in requests:
                try:
                    if stage is None:  # a resume may read a kept prefix back from disk: off the loop
                        stage = await asyncio.to_thread(self.open, msg) if msg.resume else self.open(msg)
                    if msg.keep:  # the request's last message: keep its KV, then say it is kept
                        await self.scheduler.call(partial(stage.keep, msg))
                        yield KEPT
                        continue
                    stage.admit(msg.input.shape[1] if len(msg.input.shape) > 1 else 0, msg.rewind)
                    output, seconds = await self.scheduler.call(partial(stage.run, msg))
                except StageError as refusal:
                    if isinstance(refusal, InvalidInput):
                        log.warning("refused a malformed activation for %s: %s", msg.request_id or "?", refusal)
                    await context.abort(refusal.code, str(refusal))
                if self.inject_latency:
                    await asyncio.sleep(self.inject_latency)
                yield mesh_pb2.ForwardReply(output=output, stage_seconds=seconds)
        except DecodeError:
            # A corrupt message is the caller's error, not UNKNOWN and a traceback.
            await context.abort(STATUS[InvalidInput], "malformed ForwardRequest")
        finally:
            if stage is not None:
                stage.close()
            stage = None


class OpenStage:
    """One request's use of one stage on the serving side: its KV cache and what it has seen."""

    def __init__(self, server: StageServer, shard: LayerShard, cache: list | None = None, resumed: int = 0):
        """``cache``: a kept prefix's KV holding ``resumed`` positions."""
        self.server, self.shard = server, shard
        self.layers = (shard.spec.start, shard.spec.end)
        self.cache: list[Any] | None = cache if cache is not None else shard.make_cache()
        self.seen = resumed
        if server.prefixes is not None and resumed:
            server.prefixes.grow(self.layers, resumed)
        self.prepared: tuple[Placeholder, mx.array] | None = None  # the next step, built ahead
        self.batch: DecodeBatch | None = None  # holds this request's cache while it decodes in a batch

    def admit(self, positions: int, rewind: int = 0) -> None:
        """Count ``positions`` more of this request's KV here, ``rewind`` fewer (rejected drafts)."""
        if rewind > self.seen:
            raise InvalidInput(f"rewind of {rewind} positions, {self.seen} held")
        self.seen += positions - rewind
        if self.seen > self.server.max_context:
            raise ContextExceeded(f"request exceeds the context of {self.server.max_context} tokens")
        if self.server.prefixes is not None:  # kept prefixes make room for this request's KV
            self.server.prefixes.grow(self.layers, positions - rewind)

    def keep(self, msg: mesh_pb2.ForwardRequest) -> None:
        """The request's last message: keep its KV for a later request with the same start."""
        take_back(self)
        cache, self.cache, self.prepared = self.cache, None, None
        self.close()  # its positions are the kept prefix's now
        if self.server.prefixes is not None and cache is not None and self.shard.keeps_prefixes:
            self.server.prefixes.keep(self.layers, msg.keep, cache, msg.keep_length)

    def close(self) -> None:
        """The stream ended: its positions are free for kept prefixes again."""
        take_back(self)
        self.cache = self.prepared = None
        if self.server.prefixes is not None and self.seen:
            self.server.prefixes.grow(self.layers, -self.seen)
            self.seen = 0

    def _host_input(self, tensor: mesh_pb2.Tensor | RawRequest) -> np.ndarray:
        if self.shard.spec.is_first:
            return check_tokens(tensor, self.server.vocab_size, self.server.max_chunk)
        return check_activation(tensor, self.shard.hidden_size, self.server.max_chunk)

    def run(self, msg: mesh_pb2.ForwardRequest | RawRequest) -> tuple[mesh_pb2.Tensor, float]:
        """Run one message on the MLX thread: the output and the seconds it took."""
        started = time.perf_counter()
        out = self.run_array(msg)
        return to_tensor(out), time.perf_counter() - started

    def run_array(self, msg: mesh_pb2.ForwardRequest | RawRequest) -> mx.array:
        """Run one message on the MLX thread: the output, evaluated."""
        pace = self.server.pace
        started, cpu = time.perf_counter(), time.process_time() if pace is not None else 0.0  # a syscall
        with self.server.steps.step():
            out = self._run_array(msg)
        if pace is not None and out.shape[1] == 1 and not self.shard.spec.is_last:
            pace.observe((self.server.model, self.layers), time.perf_counter() - started, time.process_time() - cpu)
        return out

    def _run_array(self, msg: mesh_pb2.ForwardRequest | RawRequest) -> mx.array:
        take_back(self)
        try:
            host = self._host_input(msg.input)
            if self.prepared is not None:  # this step's graph was built ahead: fill in its input
                placeholder, out = self.prepared
                self.prepared = None
                if host.shape[1] != 1 or msg.rewind:
                    raise WireError(f"{host.shape[1]} positions (rewind {msg.rewind}) after a promise of one")
                placeholder.fill(host, msg.input.dtype)
            else:
                cache = cache_of(self)
                self.shard.rewind(cache, msg.rewind)
                out = self.shard.forward(to_array(host, msg.input.dtype), cache)
            mx.eval(out)
            return out
        except (WireError, CannotRewind) as exc:
            raise InvalidInput(str(exc)) from None
        except TensorGroupError as exc:  # the group's ring broke: the caller re-plans
            raise StageUnavailable(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the model raised on this input: report it, keep serving
            raise self.server.fault(self.shard, "this input", f"{msg.request_id or '?'}'s input", exc) from None

    def prepare(self) -> None:
        """Build the next one-position step on a placeholder, ready before its input arrives."""
        take_back(self)
        if self.prepared is None:
            self.prepared = self.shard.build_ahead(self.cache)


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
        return reply

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

    def __init__(self, session: RemoteSession, future: concurrent.futures.Future, positions: int):
        self.session, self.future, self.positions = session, future, positions
        self.sent = time.perf_counter()

    def done(self) -> bool:
        return self.future.done()

    def wait_handle(self) -> concurrent.futures.Future:
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
