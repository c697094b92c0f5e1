"""Lockstep: concurrent requests' decode steps go through the pipeline together, one batched
forward per stage and one frame per hop (continuous batching is the whole-model node's, in
meshnode.serving.batching). A request switches in and out at
step boundaries; a failed batched step raises in each of its requests."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from meshnode import blas
from meshnode.model.decode_batch import DecodeBatch, batchable_shard
from meshnode.model.scheduler import mlx_idle, mlx_turn
from meshnode.model.shard import any_thread_stream
from meshnode.transport.lockstep_hop import LockstepHop
from meshnode.transport.refusals import StageError

if TYPE_CHECKING:
    from meshnode.config import LockstepSetting
    from meshnode.serving.generation import PipelineModel
    from meshnode.serving.local_stage import LocalStage
    from meshnode.transport.remote_stage import RemoteStage

log = logging.getLogger(__name__)

# The longest a round waits for its group's other steps; a late one steps in the next round.
GATHER_S = 0.05


def lockstep_wanted(setting: LockstepSetting) -> bool:
    """The ``lockstep`` setting. "auto": only on the CPU with a BLAS meshnode.blas loaded, whose
    batched rows cost a fraction of a row each; with the reference BLAS steps in turn overlap better."""
    if setting == "auto":
        return mx.default_device().type == mx.DeviceType.cpu and blas.loaded() is not None
    return bool(setting)


def can_lockstep(handles: Sequence[LocalStage | RemoteStage]) -> bool:
    """Whether every stage takes batched decode steps (a batchable local shard, or a data port)."""
    for stage in handles:
        shard = getattr(stage, "shard", None)
        if shard is not None:
            if not batchable_shard(shard):
                return False
        else:
            address = getattr(stage, "data_port", None)
            if getattr(stage, "auth", None) is None or address is None or address() is None:
                return False
    return True


class _Group:
    """One micro-batch: requests that step together, with their own caches merged at each stage."""

    def __init__(self, handles: Sequence[Any]):
        self.members: set[Any] = set()
        self.pending: dict[Any, mx.array] = {}  # steps waiting for the next round
        self.results: dict[Any, mx.array | BaseException] = {}  # a round's rows (or its error), by request
        self.running = False
        self.free_since = 0.0  # when its last round ended (monotonic)
        self.hops: dict[int, LockstepHop] = {}  # by stage index
        self.batches = {
            i: DecodeBatch(h.shard.make_cache) for i, h in enumerate(handles) if getattr(h, "shard", None) is not None
        }


class LockstepGroups:
    """The decode steps of one placement's concurrent requests, run as batches: requests are dealt
    into one group per stage, so every stage stays busy; a request stays in its group."""

    def __init__(self, handles: Sequence[LocalStage | RemoteStage], on_round: Callable[[int], None] | None = None):
        """``on_round(rows)``: told of every round run."""
        self._handles = list(handles)
        self._on_round = on_round
        self._cond = threading.Condition()
        self._decoding: set[Any] = set()  # requests between their first step and their end
        self._groups = [_Group(self._handles) for _ in range(max(1, len(self._handles)))]
        self._group_of: dict[Any, _Group] = {}
        self.off: str | None = None  # why batching is off (a stage refused it)
        self.widest = 0  # the most requests one round has stepped

    # -- what a request's PipelineModel asks
    def decoding(self, model: PipelineModel) -> None:
        with self._cond:
            self._decoding.add(model)

    def others_decoding(self, model: PipelineModel) -> bool:
        """Whether another request of this placement decodes now."""
        if self.off is not None:
            return False
        with self._cond:
            return any(m is not model for m in self._decoding)

    def alone(self, model: PipelineModel) -> None:
        """``model`` steps on its own from here (no other request decodes)."""
        with self._cond:
            self._ungroup(model)

    def leave(self, model: PipelineModel) -> None:
        """``model``'s generation ended."""
        with self._cond:
            self._decoding.discard(model)
            self._ungroup(model)
            idle = not self._decoding and not any(g.running for g in self._groups)
        if idle:
            self._close_hops()

    def _ungroup(self, model: PipelineModel) -> None:
        group = self._group_of.pop(model, None)
        if group is not None:
            group.members.discard(model)
            group.pending.pop(model, None)
            self._cond.notify_all()

    def _group(self, model: PipelineModel) -> _Group:
        group = self._group_of.get(model)
        if group is None:
            group = self._group_of[model] = min(self._groups, key=lambda g: len(g.members))
            group.members.add(model)
        return group

    def step(self, model: PipelineModel, x: mx.array) -> mx.array:
        """``model``'s next step, run with its group's; its logits ([1, 1, vocab])."""
        mx.eval(x)  # built on this thread's stream: another thread may run the round
        # The leader takes the baton only for the local stage, so other groups run meanwhile.
        with mlx_idle():
            return self._step(model, x)

    def _step(self, model: PipelineModel, x: mx.array) -> mx.array:
        with self._cond:
            group = self._group(model)
            group.pending[model] = x
            self._cond.notify_all()  # a leader may be waiting for this one
            first = time.monotonic()
            while model not in group.results:
                if not group.running:
                    waiting = group.members - set(group.pending)
                    # Counted from the later of this arrival and the last round's end, so members
                    # have time to sample and come back instead of locking into one row a round.
                    left = GATHER_S - (time.monotonic() - max(first, group.free_since))
                    if not waiting or left <= 0:
                        round_, group.pending = group.pending, {}
                        group.running = True
                        break
                    self._cond.wait(left)
                else:
                    self._cond.wait()
            else:
                return self._take(group, model)
        try:
            out = self._run(group, round_)
            with mlx_turn(), mx.stream(any_thread_stream()):
                rows: list[Any] = [out[i : i + 1] for i in range(len(round_))]
                mx.eval(rows)  # each request samples from its row on its own thread
        except BaseException as exc:  # noqa: BLE001 - every request of the round gets it
            rows = [exc] * len(round_)
        with self._cond:
            group.results.update(zip(round_, rows))
            group.running, group.free_since = False, time.monotonic()
            self._cond.notify_all()
            return self._take(group, model)

    @staticmethod
    def _take(group: _Group, model: PipelineModel) -> mx.array:
        out = group.results.pop(model)
        if isinstance(out, BaseException):
            raise out
        return out

    # -- a round
    def _run(self, group: _Group, round_: dict[Any, mx.array]) -> mx.array:
        models = list(round_)
        self.widest = max(self.widest, len(models))
        if self._on_round is not None:
            self._on_round(len(models))
        # Joined on the host: the baton may be elsewhere.
        h = mx.array(np.concatenate([np.asarray(round_[m]) for m in models], axis=0).astype(np.int32))
        for i, stage in enumerate(self._handles):
            if i in group.batches:
                h = self._local(group.batches[i], i, stage, models, h)
            else:
                h = self._remote(group, i, stage, models, h)
        return h

    @staticmethod
    def _local(batch: DecodeBatch, i: int, stage: Any, models: list[Any], h: mx.array) -> mx.array:
        sessions = [m.state.sessions[i] for m in models]
        # The batch's lock: the step is evaluated before a member's close takes its cache back.
        with mlx_turn(), mx.stream(any_thread_stream()), batch.lock:
            out: mx.array = stage.shard.forward(h, batch.follow(sessions))
            mx.eval(out)
        return out

    def _remote(self, group: _Group, i: int, stage: Any, models: list[Any], h: mx.array) -> mx.array:
        hop = group.hops.get(i)
        if hop is None:
            address = stage.data_port()
            if address is None:
                raise StageError(f"stage [{stage.start}, {stage.end}) on {stage.node_id}: its data port closed")
            host, port = address
            try:
                hop = group.hops[i] = LockstepHop(stage, host, port, auth=stage.auth, node_id=stage.caller)
            except OSError as exc:
                raise StageError(
                    f"stage [{stage.start}, {stage.end}) on {stage.node_id}: batch stream not opened ({exc})"
                ) from None
        try:
            return hop.step([m.request_id for m in models], h)
        except StageError as exc:
            # Lost with its stage, or refused: requests step on their own now.
            group.hops.pop(i, None)
            hop.close()
            self.off = str(exc)
            log.warning("batched decode steps off for this placement: %s", exc)
            raise

    def _close_hops(self) -> None:
        for group in self._groups:
            hops, group.hops = group.hops, {}
            for hop in hops.values():
                hop.close()
