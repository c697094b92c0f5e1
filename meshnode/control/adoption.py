"""Plan adoption: which plan this node follows, under which epoch."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshnode.control.epochs import EpochState
from meshnode.control.messages import plan_from_pb
from meshnode.planner import Plan
from meshnode.proto import mesh_pb2

if TYPE_CHECKING:
    from meshnode.serving.served import ServedModel

log = logging.getLogger(__name__)


def describe(plan: Plan) -> str:
    if plan.unloaded:
        return f"{plan.model} unloaded ({plan.reason})"
    return ", ".join(f"[{s.start_layer},{s.end_layer})@{'+'.join(s.nodes)}" for s in plan.stages)


class Adoption:
    """Every plan that reaches the node for one model goes through here: one plan per epoch,
    checked against the model, then handed to its :class:`~meshnode.serving.served.ServedModel`."""

    def __init__(self, served: ServedModel, *, grace: float, event: Callable[..., None]):
        self.served = served
        # Nodes started together hear each other before either publishes (grace).
        self.epochs = EpochState(grace=grace)
        self.changed_at = 0.0  # for the coordinator's dwell
        # When the plan last changed after this node's first (monotonic): every node keeps them, so a
        # newly elected coordinator knows how much the mesh has moved lately.
        self.changes: deque[float] = deque(maxlen=8)
        self._event = event

    # ------------------------------------------------------------------ what this node holds
    @property
    def epoch(self) -> int:
        return self.epochs.epoch

    @property
    def plan(self) -> Plan | None:
        return self.served.plan

    @property
    def ready_epoch(self) -> int:
        return self.served.ready_epoch

    @property
    def plan_error(self) -> str:
        return self.served.plan_error

    @property
    def plan_coordinator(self) -> str:
        """Who published the plan held here."""
        return self.epochs.held.coordinator if self.epochs.held is not None else ""

    # ------------------------------------------------------------------ plans arriving
    def heard_of(
        self, msg: mesh_pb2.HeartbeatRequest | mesh_pb2.HeartbeatReply | mesh_pb2.ModelState, sender: str
    ) -> None:
        """A heartbeat or reply from ``sender``."""
        self.epochs.saw(msg.epoch)
        if msg.HasField("plan") and self.epochs.offered(msg.plan.epoch, msg.plan.coordinator, sender):
            self.adopt_pb(msg.plan, source=sender)

    def on_install(self, msg: mesh_pb2.Plan) -> mesh_pb2.InstallReply:
        if self.epochs.holds(msg.epoch, msg.coordinator):  # heartbeats brought it first
            return mesh_pb2.InstallReply(accepted=True, epoch=self.epoch)
        if not self.epochs.offered(msg.epoch, msg.coordinator, msg.coordinator):
            log.info("refused plan epoch %d from %s: current epoch is %d", msg.epoch, msg.coordinator, self.epoch)
            return mesh_pb2.InstallReply(accepted=False, error=f"stale epoch (current {self.epoch})", epoch=self.epoch)
        try:
            self.adopt_pb(msg, source=msg.coordinator)
        except ValueError as exc:
            return mesh_pb2.InstallReply(accepted=False, error=str(exc), epoch=self.epoch)
        return mesh_pb2.InstallReply(accepted=True, epoch=self.epoch)

    def adopt_pb(self, msg: mesh_pb2.Plan, source: str) -> None:
        served = self.served
        try:
            plan = plan_from_pb(msg, served.profile.num_layers)
        except ValueError as exc:
            log.warning("ignoring an invalid plan from %s: %s", source, exc)
            raise
        if plan.model != served.model_id:
            raise ValueError(f"plan is for model {plan.model!r}; this node serves {served.model_id!r}")
        self.adopt(plan, coordinator=msg.coordinator, source=source)

    def adopt(self, plan: Plan, *, coordinator: str, source: str) -> None:
        if plan.epoch <= self.epoch and not self.epochs.takes_back(plan.epoch, coordinator):
            return
        self.served.take(plan)
        self.epochs.adopted(plan.epoch, coordinator)
        now = time.monotonic()
        if self.changed_at:  # a change of plan, not this node's first
            self.changes.append(now)
        self.changed_at = now
        log.info("epoch %d adopted (from %s): %s", plan.epoch, source, describe(plan))
        self._event("plan", epoch=plan.epoch, stages=describe(plan))
        self.served.apply_soon(plan)

    def drop(self) -> None:
        """No plan fits any more: stop serving the one held."""
        self.epochs.withdraw()
        log.warning("epoch %d withdrawn: %s", self.epoch, self.served.plan_error)
        self.served.drop()
