"""``GET /v1/mesh``: this node's view of the mesh, the plans of its models, and what happened lately."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshnode import blas
from meshnode.control.lanes import Lane
from meshnode.control.peers import Peers
from meshnode.control.plane import ControlPlane
from meshnode.metrics import EventLog, NodeMetrics, Progress
from meshnode.nodeinfo import NodeInfo
from meshnode.serving.served import ServedModel, plan_status
from meshnode.version import PROTOCOL, describe
from meshnode.weights.holdings import holdings_to_json


def model_state(served: ServedModel) -> str:
    if served.loaded():
        return "ready"
    if served.on_demand():
        return "on demand"
    if served.plan is None and served.unplaced_because():
        return "does not fit"
    return "loading"


def peer_view(peers: Peers, nid: str, info: NodeInfo, me: bool, coordinator: bool) -> dict[str, Any]:
    """One node of ``nodes``, as ``peers`` (this node's Peers) know it."""
    return {
        "node_id": nid,
        "address": info.addresses[0] if info.addresses else "",
        "addresses": list(info.addresses),
        "http_port": info.http_port,
        "grpc_port": info.grpc_port,
        "memory_budget": info.memory_budget,
        "total_memory": info.total_memory,
        "compute": info.compute,
        "version": info.version,
        "protocol": info.protocol,
        "tensor_port": info.tensor_port,
        "layer_seconds": info.layer_seconds,
        "collective_seconds": info.collective_seconds,
        "holdings": holdings_to_json(info.holdings),
        "faults": [{"model": m, "count": n, "error": e} for m, n, e in info.faults],
        "stalled_for": round(peers.stalled_for() if me else info.stalled_for, 1),
        "slowdown": info.slowdown,
        "slow_since": info.slow_since or None,
        "data_address": None if me else peers.links.best_address(nid),
        "links": peers.links_of(nid),
        "role": "coordinator" if coordinator else "member",
    }


def drafter_view(served: ServedModel) -> str | None:
    """Which drafter serves the model's requests from this node, and why (None: no plan serves)."""
    plan = served.serving_plan()
    if plan is None or plan.unloaded:
        return None
    placement = served.placement_for(plan)
    choice = getattr(placement, "drafter", None)
    return choice.describe() if choice is not None else f"chosen by the head, {getattr(placement, 'head', '?')}"


def plan_view(lane: Lane) -> dict[str, Any]:
    """A lane's plan and readiness: the first model's at the top of the document, each model's in ``models``."""
    served = lane.served
    return {
        "epoch": lane.adoption.epoch,
        "ready_epoch": served.ready_epoch,
        "healthy": served.serving_ready(),
        "plan_error": served.plan_error or None,
        "plan": plan_status(served.plan, lane.coordinator.estimate_now()),
        "drafter": drafter_view(served),
    }


def mesh_status(
    control: ControlPlane, events: EventLog, progress: Progress, metrics: NodeMetrics, measuring: str | None
) -> dict[str, Any]:
    """The ``/v1/mesh`` document; ``measuring``: what the node times now (requests run slower meanwhile)."""
    peers, coordinator, node_id = control.peers, control.coordinator_id, control.node_id
    nodes = [
        peer_view(peers, nid, info, nid == node_id, nid == coordinator)
        for nid, info in sorted(peers.alive_infos().items())
    ]
    primary = control.lanes.primary
    return {
        "node_id": node_id,
        "version": describe(),
        "protocol": PROTOCOL,
        "blas": blas.in_use(),
        "model": primary.served.model_id,
        "coordinator": coordinator,
        "unreachable": peers.reach.report(),
        "heartbeat_bytes": {"sent": control.heartbeats.sent_bytes, "received": control.heartbeats.received_bytes},
        "nodes": nodes,
        **plan_view(primary),
        "models": [
            {
                "model": lane.model_id,
                "state": model_state(lane.served),
                "offered_here": lane.offered,
                "use": dataclasses.asdict(control.use_of(lane)),
                **plan_view(lane),
            }
            for lane in control.lanes
            if lane.model_id is not None
        ],
        "events": events.recent(),
        "progress": progress.current,
        "measuring": measuring,
        "metrics": metrics.summary(),
    }
