"""The coordinator: weigh a plan for the live nodes and publish it under a new epoch."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from meshnode.control.adoption import describe
from meshnode.control.links import ring_address
from meshnode.control.messages import plan_to_pb
from meshnode.control.settings import PlanSettings
from meshnode.ids import NodeId
from meshnode.logonce import Once
from meshnode.nodeinfo import NodeInfo, speed_note
from meshnode.planner import LinkSpec, NodeSpec, Plan, PlanError
from meshnode.planner import estimate as plan_estimate
from meshnode.planner import plan as make_plan
from meshnode.planner.context import plan_longest_context
from meshnode.planner.pinned import pinned_plan
from meshnode.planner.plans import UNLOADED
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.weights.holdings import layers_of

if TYPE_CHECKING:
    from meshnode.control.adoption import Adoption
    from meshnode.control.peers import Peers

log = logging.getLogger(__name__)

# A working plan is replaced only by one estimated this much faster per token (hysteresis), or
# by one on fewer nodes that is no slower.
REPLAN_GAIN = 0.15
# Assumed all-reduce cost of an unmeasured node, so tensor groups form on measurements.
UNMEASURED_COLLECTIVE_S = 250e-6
# Each plan change this recent doubles an optional move's wait, so a mesh whose figures swing settles.
MOVES_WINDOW_S = 300.0
MOVES_BACKOFF_MAX = 16

# Faults after which a node holds none of a model's layers until it restarts: once may be one
# bad input, twice is a model the node cannot run.
FAULT_LIMIT = 2


def faulted(alive: dict[str, NodeInfo], model_id: str) -> dict[str, str]:
    """The nodes not to place ``model_id`` on, with why: stalled, or faulted FAULT_LIMIT times."""
    out = {}
    for nid, info in alive.items():
        if info.stalled_for > 0:
            out[nid] = f"{nid} is stalled (a model step has run for {info.stalled_for:.0f} s)"
            continue
        for model, count, error in info.faults:
            if model == model_id and count >= FAULT_LIMIT:
                out[nid] = f"{nid} failed {count} times running it ({error})"
    return out


Layout = list[tuple[int, int, tuple[NodeId, ...]]]  # each stage: (start layer, end layer, its nodes)


def layout(plan: Plan) -> Layout:
    return [(s.start_layer, s.end_layer, tuple(s.nodes)) for s in plan.stages]


def node_specs(
    alive: dict[str, NodeInfo], model_id: str | None = None, used: dict[str, int] | None = None
) -> list[NodeSpec]:
    """Each live node as the planner sees it, less the memory ``used`` by other models' plans.
    Layer times are measured for a node's first model only."""
    used = used or {}
    return [
        NodeSpec(
            node_id=n.node_id,
            memory_budget=max(0, n.memory_budget - used.get(n.node_id, 0)),
            compute=n.compute / n.slowdown,
            layer_seconds=(n.layer_seconds * n.slowdown or None)
            if model_id is None or n.models[:1] == (model_id,)
            else None,
            collective_s=n.collective_seconds or UNMEASURED_COLLECTIVE_S,
        )
        for n in alive.values()
    ]


def pays_to_move(current: Plan, current_s: float, desired: Plan) -> bool:
    """Whether a working plan (estimated ``current_s`` per token now) gives way to ``desired``: one
    ``REPLAN_GAIN`` faster, or one on fewer nodes and no slower (each node a plan holds is one more
    to lose, and a machine its owner wants back). The way back to more nodes needs the full gain,
    so the two never flap."""
    if layout(desired) == layout(current):
        return False
    if desired.estimate_s < current_s * (1 - REPLAN_GAIN):
        return True
    return len(set(desired.node_ids())) < len(set(current.node_ids())) and desired.estimate_s <= current_s


def rebalance_wait(dwell: float, moves: Sequence[float], now: float) -> float:
    """Seconds a working plan stays before an optional move: ``dwell``, doubled for each plan change
    at ``moves`` (their times) in the last MOVES_WINDOW_S, up to MOVES_BACKOFF_MAX times. A plan
    that lost a node is replaced at once, never through this wait."""
    recent = sum(1 for t in moves if now - t < MOVES_WINDOW_S)
    return dwell * min(MOVES_BACKOFF_MAX, 1 << recent)


def say_move(current_plan: Plan, current_s: float, desired: Plan, next_wait: float) -> None:
    log.info(
        "rebalancing: %s (est. %.2f ms/token) -> %s (est. %.2f ms/token; the next move waits %.0f s): %s",
        describe(current_plan),
        current_s * 1e3,
        describe(desired),
        desired.estimate_s * 1e3,
        next_wait,
        desired.reason,
    )


def squeezed(plan: Plan, alive: dict[str, NodeInfo], used: dict[str, int]) -> list[str]:
    """The nodes of ``plan`` that offer less memory now than it and the other models' plans put on them."""
    return sorted(
        nid
        for nid in set(plan.node_ids()) & alive.keys()
        if alive[nid].memory_budget < used.get(nid, 0) + sum(s.bytes for s in plan.stages if nid in s.nodes)
    )


def slow_notes(alive: dict[str, NodeInfo]) -> str:
    """The nodes planned slower than they measured, said as ``meshnode status`` says them."""
    return "; ".join(speed_note(n, i.slowdown, i.slow_since) for n, i in sorted(alive.items()) if i.slowdown > 1)


_PIN_REFUSED = Once()  # (layout, why) pairs logged: a coordinator weighs its plan every tick


def pinned_by_setting(
    served: Any, s: PlanSettings, nodes: list[NodeSpec], links: dict[tuple[str, str], LinkSpec]
) -> Plan | None:
    """The plan the plan_layout setting pins, or None (unset, or impossible now: said once)."""
    if not s.plan_layout:
        return None
    layout = s.plan_layout
    try:
        return plan_longest_context(
            lambda ctx: pinned_plan(
                served.profile, nodes, layout, max_context=ctx, links=links, requests=s.kv_requests, kv_bits=s.kv_bits
            ),
            served.profile.trained_context,
            s.max_context,
        )
    except PlanError as exc:
        if _PIN_REFUSED.first((layout, str(exc))):
            log.warning("plan_layout %r cannot be used now (%s): planning as usual", layout, exc)
        return None


class Coordinator:
    """Plans one model for the mesh; only the elected node calls :meth:`coordinate`, once a tick.
    A working plan is replaced only by one that pays (:func:`pays_to_move`) at two weighings in a
    row, and not within ``rebalance_dwell`` of the last change, so plans do not flap."""

    def __init__(
        self,
        settings: PlanSettings,
        node_id: str,
        peers: Peers,
        adoption: Adoption,
        *,
        event: Callable[..., None],
        used_by_others: Callable[[], dict[str, int]] = dict,
    ):
        """``used_by_others``: bytes each node holds for the other models' plans."""
        self.settings, self.node_id, self.peers, self.adoption = settings, node_id, peers, adoption
        self._event, self._used_by_others = event, used_by_others
        self._planned_for: frozenset[str] = frozenset()
        # started_at of each plan member: a restarted node comes back empty, so republish.
        self._incarnations: dict[str, float] = {}
        self._planned_at = 0.0
        self._pending: Layout | None = None  # a better layout, to confirm at the next weighing
        self._forced_note = ""  # why the configured strategy could not be used
        self._excluded: dict[str, str] = {}  # nodes left out for their faults
        # The model fits only if other models' plans make room.
        self.needs_room = False
        self._paces: dict[str, float] = {}  # the slowdowns the last weighing used
        self._held: Layout | None = None  # the last layout the mesh stayed put over, said once

    def coordinate(self, alive: dict[str, NodeInfo]) -> None:
        served, adoption, s = self.adoption.served, self.adoption, self.settings
        model_id = served.model_id
        assert model_id is not None, "a model is coordinated once its metadata is loaded"
        self.needs_room = False
        current_plan = served.plan
        if current_plan is not None and current_plan.unloaded:  # a request wants it
            current_plan = None
        members = frozenset(alive)
        if self.node_id in alive:  # this node's own stall is newer than its announcement
            alive = {
                **alive,
                self.node_id: dataclasses.replace(alive[self.node_id], stalled_for=self.peers.stalled_for()),
            }
        excluded = faulted(alive, model_id)
        plan_ok = current_plan is not None and set(current_plan.node_ids()) <= members - set(excluded)
        if current_plan is not None and excluded.keys() & set(current_plan.node_ids()) and excluded != self._excluded:
            log.warning(
                "epoch %d: planning again without %s: %s",
                current_plan.epoch,
                ", ".join(sorted(excluded)),
                "; ".join(excluded.values()),
            )
        self._excluded = excluded
        if plan_ok and current_plan is not None and (short := squeezed(current_plan, alive, self._used_by_others())):
            log.warning(
                "epoch %d puts more memory on %s than offered now: planning again",
                current_plan.epoch,
                ", ".join(short),
            )
            plan_ok = False
        restarted = sorted(n for n, t in self._incarnations.items() if n in alive and alive[n].started_at != t)
        if current_plan is not None and plan_ok and restarted:
            log.info(
                "%s restarted since epoch %d was planned: planning again", ", ".join(restarted), current_plan.epoch
            )
            plan_ok = False
        contested = plan_ok and adoption.epochs.must_republish()
        now = time.monotonic()
        # A node that announces a new slowdown has held it for slow_dwell: weigh it now, once.
        paces = {nid: info.slowdown for nid, info in alive.items()}
        repaced = any(pace != self._paces.get(nid, 1.0) for nid, pace in paces.items())
        self._paces = paces
        # Re-plan on a membership change, and now and then with fresh link and compute figures.
        if (
            plan_ok
            and not contested
            and not repaced
            and members == self._planned_for
            and now - self._planned_at < s.link_probe_interval
        ):
            return
        # (a node whose machine took all its memory back offers none: no part of a plan)
        candidates = {nid: info for nid, info in alive.items() if nid not in excluded and info.memory_budget > 0}
        nodes = node_specs(candidates, served.model_id, self._used_by_others())
        links = self.peers.link_specs(members)
        preferred = tuple(current_plan.node_ids()) if current_plan is not None else ()
        strategy = None if s.strategy == "auto" else s.strategy
        held = {nid: layers_of(info.holdings, model_id) for nid, info in alive.items()}
        # After a loss, resume on a plan that forms no new tensor group (one loads every layer on
        # each member before the replay can start); a faster plan follows, make before break.
        resume = (
            strategy is None
            and current_plan is not None
            and current_plan.strategy in ("single", "pipeline")
            and not set(current_plan.node_ids()) <= members
        )
        pinned = pinned_by_setting(served, s, nodes, links)
        try:
            try:
                desired = pinned or self._longest(
                    nodes, preferred=preferred, strategy=strategy, links=links, held=held, grouped=not resume
                )
            except PlanError as forced:
                if strategy is None and not resume:
                    raise
                # A configured strategy is a preference: serving another way beats not serving.
                desired = self._longest(nodes, preferred=preferred, links=links, held=held)
                if strategy is not None and self._forced_note != str(forced):
                    log.warning(
                        "strategy %s is impossible on this mesh (%s); using %s instead",
                        strategy,
                        forced,
                        desired.strategy,
                    )
                    self._forced_note = str(forced)
        except PlanError as exc:
            if self._fits_alone(candidates, links, held):
                # Fits, but not beside the other models: unloaded until a request asks for it.
                self.needs_room = True
                self._planned_for, self._planned_at = members, now
                served.planned()
                return
            if excluded:
                exc = PlanError(f"{exc}; not placed on {', '.join(sorted(excluded))}: {'; '.join(excluded.values())}")
            if served.planned(why_not=str(exc)):
                log.error("no plan of %s fits (epoch %d): %s", served.model_id, adoption.epoch, exc)
                self._event("no-plan", reason=str(exc))
            self._planned_for, self._planned_at = members, now
            if current_plan is not None and not plan_ok:
                adoption.drop()
            return
        served.planned()
        if excluded:
            desired = dataclasses.replace(
                desired,
                reason=f"{desired.reason}; not on {', '.join(sorted(excluded))}: {'; '.join(excluded.values())}",
            )
        if slow := slow_notes(candidates):
            desired = dataclasses.replace(desired, reason=f"{desired.reason}; {slow}")
        desired = self._with_endpoints(desired, alive)
        if current_plan is not None and plan_ok and not contested:
            # The current plan works: move only for a real gain, not within rebalance_dwell.
            current = plan_estimate(
                served.profile,
                nodes,
                current_plan.stages,
                max_context=current_plan.max_context or desired.max_context,
                links=links,
            )
            preferred_now = pinned is not None or (
                strategy is not None and desired.strategy == strategy != current_plan.strategy
            )
            if layout(desired) == layout(current_plan) or not (
                preferred_now or pays_to_move(current_plan, current, desired)
            ):
                if layout(desired) != layout(current_plan):
                    self._held_over(current_plan, current, desired)
                self._planned_for, self._planned_at, self._pending = members, now, None
                return
            if members == self._planned_for and not preferred_now and not repaced and self._pending != layout(desired):
                # Must win twice in a row: one noisy figure cannot tear down a group.
                self._pending, self._planned_at = layout(desired), now
                return
            if now - adoption.changed_at < rebalance_wait(s.rebalance_dwell, adoption.changes, now):
                if repaced:  # weigh the new slowdown again at the next tick
                    self._paces = {}
                return  # else at the next regular weighing
            say_move(current_plan, current, desired, rebalance_wait(s.rebalance_dwell, [*adoption.changes, now], now))
        if contested:
            log.info(
                "another node published a different plan as epoch %d: publishing this mesh's plan again "
                "under a new epoch",
                adoption.epoch,
            )
        self._planned_for, self._planned_at, self._pending = members, now, None
        if resume:  # weigh the fastest plan once the dwell has passed, not a link probe later
            self._planned_at -= s.link_probe_interval - s.rebalance_dwell
        self._incarnations = {n: alive[n].started_at for n in desired.node_ids()}
        self._publish(desired)

    def _held_over(self, current_plan: Plan, current: float, desired: Plan) -> None:
        """Say once per candidate layout why the mesh stays on its plan: the candidate does not pay."""
        if self._held == layout(desired):
            return
        self._held = layout(desired)
        log.info(
            "keeping epoch %d: %s (est. %.2f ms/token) over %s (est. %.2f ms/token; "
            "a move needs %d%% or fewer nodes): %s",
            current_plan.epoch,
            describe(current_plan),
            current * 1e3,
            describe(desired),
            desired.estimate_s * 1e3,
            REPLAN_GAIN * 100,
            desired.reason,
        )

    def unload(self, reason: str) -> None:
        """Hold the model nowhere; a request then waits while the mesh loads it again."""
        model_id = self.adoption.served.model_id
        assert model_id is not None, "a model is unloaded once its metadata is loaded"
        log.info("unloading model %s: %s", model_id, reason)
        self._event("unload", model=model_id, reason=reason)
        self._incarnations, self._pending = {}, None
        self._publish(Plan(model=model_id, strategy=UNLOADED, stages=(), reason=reason))

    def _publish(self, desired: Plan) -> None:
        adoption = self.adoption
        epoch = adoption.epochs.next_epoch()
        desired = desired.with_epoch(epoch)
        log.info(
            "publishing plan epoch %d of %s: %s",
            epoch,
            desired.model,
            describe(desired) if desired.unloaded else f"{describe(desired)} ({desired.reason})",
        )
        adoption.adopt(desired, coordinator=self.node_id, source="self")
        msg = plan_to_pb(desired, self.node_id)
        for peer in self.peers.members.alive_peers().values():
            asyncio.create_task(self._install(peer.target, msg))

    def _longest(self, nodes: list[NodeSpec], **kw: Any) -> Plan:
        """The plan on ``nodes`` for the longest context worth serving (planner.context)."""
        served, s = self.adoption.served, self.settings
        return plan_longest_context(
            lambda ctx: make_plan(
                served.profile, nodes, max_context=ctx, requests=s.kv_requests, kv_bits=s.kv_bits, **kw
            ),
            served.profile.trained_context,
            s.max_context,
        )

    def _fits_alone(
        self,
        candidates: dict[str, NodeInfo],
        links: dict[tuple[str, str], LinkSpec],
        held: dict[str, frozenset[int]],
    ) -> bool:
        """The model would fit ``candidates`` if the other models' plans did not hold memory."""
        if not any(self._used_by_others().values()):
            return False
        try:
            self._longest(node_specs(candidates, self.adoption.served.model_id), links=links, held=held)
        except PlanError:
            return False
        return True

    def estimate_now(self) -> float | None:
        """Seconds per token of the current plan by today's figures."""
        served = self.adoption.served
        if served.plan is None or self.peers.membership is None or served.profile is None:
            return None
        alive = self.peers.alive_infos()
        if not set(served.plan.node_ids()) <= set(alive):
            return None
        try:
            return plan_estimate(
                served.profile,
                node_specs(alive, served.model_id),
                served.plan.stages,
                max_context=served.plan.max_context or served.context,
                links=self.peers.link_specs(frozenset(alive)),
            )
        except (PlanError, ValueError, KeyError):
            return None

    def _with_endpoints(self, plan: Plan, alive: dict[str, NodeInfo]) -> Plan:
        """Each tensor group member's ring address: the one the others reach fastest."""
        if all(len(s.nodes) == 1 for s in plan.stages):
            return plan
        measured = self.peers.measured()
        stages = []
        for stage in plan.stages:
            if len(stage.nodes) > 1:
                hosts = tuple(ring_address(measured, n, stage.nodes) or alive[n].addresses[0] for n in stage.nodes)
                stage = dataclasses.replace(stage, endpoints=hosts)
            stages.append(stage)
        return dataclasses.replace(plan, stages=tuple(stages))

    async def _install(self, target: str, msg: mesh_pb2.Plan) -> None:
        stub = mesh_pb2_grpc.MeshStub(self.peers.channel_to(target))
        try:
            reply = await stub.Install(msg, timeout=self.settings.failure_timeout)
        except grpc.aio.AioRpcError as exc:
            log.info(
                "installing epoch %d at %s failed (%s); heartbeats will carry it", msg.epoch, target, exc.code().name
            )
            return
        if not reply.accepted:
            log.info("%s refused epoch %d: %s", target, msg.epoch, reply.error)
            self.adoption.epochs.refused(msg.epoch, reply.epoch, target)
