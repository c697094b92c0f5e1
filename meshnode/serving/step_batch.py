"""Continuous batching across stages: concurrent requests' decode steps go through the pipeline
together, one batched forward per stage and one frame per hop for all of them.

Each generation keeps its own thread, its own mlx-lm ``generate_step`` (sampling, processors,
stop strings, cancellation, the prompt cache) and its own prefill through the stages. Only its
one-position steps change: while another request of the same placement decodes too, the step is
handed to the placement's :class:`StepBatcher`, which gathers the steps that arrive together,
runs them as one batch (the head's local stage over its requests' caches merged,
meshnode.model.decode_batch; each remote stage over one batch stream, meshnode.transport.batch_hop)
and gives every request its own row of logits back. A request decoding alone steps on its own as
before (its stages build its next step ahead: the fastest single stream).

Switching is safe at step boundaries: a request stepping alone promises its stages that its next
step comes on its own stream (``next_single``, so they build it ahead); when another request
starts decoding it makes no promise for one step, then joins the batch. Leaving the batch needs
nothing: a stage takes a request's cache back from its batch before the request's own message.

Failures: a batched step that fails raises in every request of it, and each recovers as it would
from its own step failing (failover replays it on a new placement). A remote stage that fails or
refuses a batched step (one that cannot batch, an older version) turns batching off for the
placement, whose requests then step on their own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from meshnode.model.decode_batch import DecodeBatch, batchable_cache
from meshnode.model.scheduler import mlx_idle
from meshnode.model.shard import Shard, any_thread_stream
from meshnode.transport.batch_hop import BatchHop
from meshnode.transport.refusals import StageError

log = logging.getLogger(__name__)

# The longest the first step of a round waits for the other batched requests' steps (each arrives
# once its thread has sampled its last token, taking the node's MLX baton in turn); a round starts
# as soon as every batched request is there. One that is not there by then steps in the next round.
GATHER_S = 0.05


def can_batch(handles) -> bool:
    """Whether every stage of a placement can take batched decode steps: a plain local shard whose
    caches mlx-lm batches, or a remote stage reached over its data port."""
    for stage in handles:
        shard = getattr(stage, "shard", None)
        if shard is not None:
            if not (isinstance(shard, Shard) and shard.group_size == 1 and batchable_cache(shard.make_cache())):
                return False
        elif getattr(stage, "data_port", None) is None or getattr(stage, "auth", None) is None:
            return False
    return True


class StepBatcher:
    """The decode steps of one placement's concurrent requests, run as batches."""

    def __init__(self, handles, on_round: Callable[[int], None] | None = None):
        """``on_round(rows)``: told of every round run (meshnode.metrics.NodeMetrics.batched_step)."""
        self._handles = list(handles)
        self._on_round = on_round
        self._cond = threading.Condition()
        self._decoding: set[Any] = set()  # requests (PipelineModel) between their first step and their end
        self._batched: set[Any] = set()  # those stepping in batches
        self._pending: dict[Any, mx.array] = {}  # steps waiting for the next round, by request
        self._results: dict[Any, Any] = {}  # a round's rows (or its error), by request
        self._running = False
        self._hops: dict[int, BatchHop] = {}  # remote stages' batch streams, by stage index
        self._batches = {i: DecodeBatch(h.shard.make_cache) for i, h in enumerate(self._handles)
                         if getattr(h, "shard", None) is not None}
        self.off: str | None = None  # why batching is off for this placement (a stage refused it)
        self.widest = 0  # the most requests one round has stepped (tests, diagnostics)

    # -- what a request's PipelineModel asks
    def decoding(self, model) -> None:
        with self._cond:
            self._decoding.add(model)

    def others_decoding(self, model) -> bool:
        """Whether another request of this placement decodes now (this one should batch)."""
        if self.off is not None:
            return False
        with self._cond:
            return any(m is not model for m in self._decoding)

    def alone(self, model) -> None:
        """``model`` steps on its own from here (no other request decodes)."""
        with self._cond:
            self._batched.discard(model)
            self._cond.notify_all()

    def leave(self, model) -> None:
        """``model``'s generation ended (its stages take its caches back as they close)."""
        with self._cond:
            self._decoding.discard(model)
            self._batched.discard(model)
            self._pending.pop(model, None)
            idle = not self._decoding and not self._running
            self._cond.notify_all()
        if idle:
            self._close_hops()

    def step(self, model, x: mx.array) -> mx.array:
        """``model``'s next one-position step (``x``: [1, 1] token ids), run in a batch with the
        other requests' steps that arrive with it; its logits ([1, 1, vocab])."""
        mx.eval(x)  # built on this thread's stream (its sampler's): another thread may run the round
        with mlx_idle(), self._cond:  # the baton is free while this request waits for its round
            self._batched.add(model)
            self._pending[model] = x
            self._cond.notify_all()  # a leader waiting for the others may be waiting for this one
            first = time.monotonic()
            while model not in self._results:
                if not self._running:
                    waiting = self._batched - set(self._pending)
                    left = GATHER_S - (time.monotonic() - first)
                    if not waiting or left <= 0:
                        round_, self._pending = self._pending, {}
                        self._running = True
                        break
                    self._cond.wait(left)
                else:
                    self._cond.wait()
            else:
                return self._take(model)
        try:
            with mx.stream(any_thread_stream()):
                out = self._run(round_)
                rows: list[Any] = [out[i : i + 1] for i in range(len(round_))]
                mx.eval(rows)  # each request samples from its row on its own thread
        except BaseException as exc:  # noqa: BLE001 - every request of the round gets it
            rows = [exc] * len(round_)
        with self._cond:
            self._results.update(zip(round_, rows))
            self._running = False
            self._cond.notify_all()
            return self._take(model)

    def _take(self, model) -> mx.array:
        out = self._results.pop(model)
        if isinstance(out, BaseException):
            raise out
        return out

    # -- a round
    def _run(self, round_: dict[Any, mx.array]) -> mx.array:
        models = list(round_)
        self.widest = max(self.widest, len(models))
        if self._on_round is not None:
            self._on_round(len(models))
        h = mx.concatenate([round_[m] for m in models], axis=0)
        for i, stage in enumerate(self._handles):
            if i in self._batches:
                h = self._local(i, stage, models, h)
            else:
                h = self._remote(i, stage, models, h)
        return h

    def _local(self, i: int, stage, models: list, h: mx.array) -> mx.array:
        batch = self._batches[i]
        sessions = [m.state.sessions[i] for m in models]
        with batch.lock:  # the step is evaluated before a member's close may take its cache back
            for session in sessions:
                session.batch = batch
            out = stage.shard.forward(h, batch.follow(sessions))
            mx.eval(out)
        return out

    def _remote(self, i: int, stage, models: list, h: mx.array) -> mx.array:
        hop = self._hops.get(i)
        if hop is None:
            host, port = stage.data_port
            try:
                hop = self._hops[i] = BatchHop(stage, host, port, auth=stage.auth, node_id=stage.caller)
            except OSError as exc:
                raise StageError(f"stage [{stage.start}, {stage.end}) on {stage.node_id}: batch stream not "
                                 f"opened ({exc})") from None
        try:
            return hop.step([m.request_id for m in models], h)
        except StageError as exc:
            # Lost with its stage (failover makes a new placement), or refused: an older peer, a
            # stage that cannot batch. Either way this placement's requests step on their own now.
            self._hops.pop(i, None)
            hop.close()
            self.off = str(exc)
            log.warning("batched decode steps off for this placement: %s", exc)
            raise

    def _close_hops(self) -> None:
        hops, self._hops = self._hops, {}
        for hop in hops.values():
            hop.close()
