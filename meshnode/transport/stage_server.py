"""The serving side of a pipeline stage: a node's stages for one model, served to peers over gRPC
``Forward``, and one request's KV cache and position there, which the data port serves through too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc
import mlx.core as mx
import numpy as np
from google.protobuf.message import DecodeError

from meshnode.model.decode_batch import cache_of, take_back
from meshnode.model.rewind import CannotRewind
from meshnode.model.scheduler import StepWatch
from meshnode.model.tensor import TensorGroupError
from meshnode.model.wire import (
    Placeholder,
    RawRequest,
    WireError,
    check_activation,
    check_tokens,
    to_array,
    to_tensor,
)
from meshnode.proto import mesh_pb2
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
)

if TYPE_CHECKING:
    from meshnode.model.decode_batch import DecodeBatch
    from meshnode.model.layer_shard import LayerShard
    from meshnode.model.pace import Pace
    from meshnode.model.prefixes import PrefixStore
    from meshnode.model.scheduler import TokenScheduler

log = logging.getLogger(__name__)

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

    def __init__(self, server: StageServer, shard: LayerShard, cache: list[Any] | None = None, resumed: int = 0):
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
