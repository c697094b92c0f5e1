"""Conversions between the control plane's dataclasses and protos/mesh.proto messages."""

from __future__ import annotations

import ipaddress
import json
import math
from typing import Any

from meshnode.ids import NodeId
from meshnode.nodeinfo import MAX_FAULT_TEXT, NodeInfo
from meshnode.planner.plans import UNLOADED, Plan, Stage, as_plan_strategy
from meshnode.proto import mesh_pb2
from meshnode.weights.holdings import holdings_from_pb, holdings_to_pb
from meshnode.weights.kvquant import KV_BITS

MAX_ID_LEN = 128
MAX_FAULTS = 64  # model faults read from one node's info
MAX_SLOWDOWN = 1000.0  # a node announcing more is read as not slowed (a bad figure)


def node_to_pb(info: NodeInfo) -> mesh_pb2.NodeInfo:
    return mesh_pb2.NodeInfo(
        node_id=info.node_id,
        addresses=list(info.addresses),
        http_port=info.http_port,
        grpc_port=info.grpc_port,
        memory_budget=info.memory_budget,
        total_memory=info.total_memory,
        compute=info.compute,
        version=info.version,
        cluster_id=info.cluster_id,
        models=list(info.models),
        started_at=info.started_at,
        tensor_port=info.tensor_port,
        layer_seconds=info.layer_seconds,
        collective_seconds=info.collective_seconds,
        holdings=holdings_to_pb(info.holdings),
        faults=[mesh_pb2.ModelFault(model_id=m, count=n, error=e) for m, n, e in info.faults],
        stalled_for=info.stalled_for,
        slowdown=info.slowdown,
        slow_since=info.slow_since,
        protocol=info.protocol,
    )


def node_from_pb(msg: mesh_pb2.NodeInfo) -> NodeInfo:
    if not msg.node_id or len(msg.node_id) > MAX_ID_LEN:
        raise ValueError("node info without a valid node id")
    if not (0 < msg.grpc_port < 65536) or msg.http_port >= 65536:
        raise ValueError(f"node {msg.node_id!r} announces invalid ports")
    return NodeInfo(
        node_id=NodeId(msg.node_id),
        addresses=tuple(msg.addresses),
        http_port=msg.http_port,
        grpc_port=msg.grpc_port,
        memory_budget=msg.memory_budget,
        total_memory=msg.total_memory,
        compute=msg.compute,
        version=msg.version,
        cluster_id=msg.cluster_id,
        models=tuple(msg.models),
        started_at=msg.started_at,
        tensor_port=msg.tensor_port if msg.tensor_port < 65536 else 0,
        layer_seconds=msg.layer_seconds if 0 <= msg.layer_seconds < 3600 else 0.0,
        collective_seconds=msg.collective_seconds if 0 <= msg.collective_seconds < 60 else 0.0,
        holdings=holdings_from_pb(msg.holdings),
        faults=tuple(
            (f.model_id, f.count, f.error[:MAX_FAULT_TEXT])
            for f in msg.faults[:MAX_FAULTS]
            if f.model_id and len(f.model_id) <= MAX_ID_LEN
        ),
        stalled_for=msg.stalled_for if 0 <= msg.stalled_for < 1e9 else 0.0,
        slowdown=msg.slowdown if 1 <= msg.slowdown <= MAX_SLOWDOWN else 1.0,
        slow_since=msg.slow_since if msg.slowdown > 1 and 0 <= msg.slow_since < 1e11 else 0.0,
        protocol=msg.protocol,
    )


def plan_to_pb(plan: Plan, coordinator: str) -> mesh_pb2.Plan:
    return mesh_pb2.Plan(
        epoch=plan.epoch,
        model=plan.model,
        strategy=plan.strategy,
        stages=[
            mesh_pb2.Stage(
                start_layer=s.start_layer,
                end_layer=s.end_layer,
                nodes=list(s.nodes),
                bytes=s.bytes,
                endpoints=list(s.endpoints),
            )
            for s in plan.stages
        ],
        reason=plan.reason,
        coordinator=coordinator,
        max_context=plan.max_context,
        kv_bits=plan.kv_bits,
        estimate_s=plan.estimate_s,
        alternatives=json.dumps(list(plan.alternatives)) if plan.alternatives else "",
    )


MAX_ALTERNATIVES_JSON = 64 * 1024


def _alternatives_from_json(text: str) -> tuple[dict[str, Any], ...]:
    """The plan's alternatives as a peer sent them: informational, so anything malformed is dropped."""
    if not text or len(text) > MAX_ALTERNATIVES_JSON:
        return ()
    try:
        data = json.loads(text)
    except ValueError:
        return ()
    if not isinstance(data, list):
        return ()
    return tuple(a for a in data[:16] if isinstance(a, dict))


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def plan_from_pb(msg: mesh_pb2.Plan, num_layers: int) -> Plan:
    """Decode and check a plan: stages must tile [0, num_layers) with one node each."""
    stages = tuple(
        Stage(
            start_layer=s.start_layer,
            end_layer=s.end_layer,
            nodes=tuple(NodeId(n) for n in s.nodes),
            bytes=s.bytes,
            endpoints=tuple(s.endpoints),
        )
        for s in msg.stages
    )
    edge = 0
    for s in stages:
        if s.start_layer != edge or s.end_layer <= s.start_layer or not s.nodes:
            raise ValueError(f"plan epoch {msg.epoch}: stages do not tile the model's layers")
        if len(set(s.nodes)) != len(s.nodes) or any(not n or len(n) > MAX_ID_LEN for n in s.nodes):
            raise ValueError(f"plan epoch {msg.epoch}: a stage names invalid or repeated nodes")
        if s.endpoints and (len(s.endpoints) != len(s.nodes) or any(not _is_address(a) for a in s.endpoints)):
            raise ValueError(f"plan epoch {msg.epoch}: a stage's endpoints do not match its nodes")
        edge = s.end_layer
    if msg.strategy == UNLOADED and stages:
        raise ValueError(f"plan epoch {msg.epoch}: an unloaded model's plan names stages")
    if edge != num_layers and not (msg.strategy == UNLOADED and not stages):
        raise ValueError(f"plan epoch {msg.epoch} covers {edge} of {num_layers} layers")
    if msg.kv_bits and msg.kv_bits not in KV_BITS:
        raise ValueError(f"plan epoch {msg.epoch}: kv_bits {msg.kv_bits} is not 0 or one of {KV_BITS}")
    try:
        strategy = as_plan_strategy(msg.strategy)
    except ValueError as exc:
        raise ValueError(f"plan epoch {msg.epoch}: {exc}") from None
    estimate = msg.estimate_s if math.isfinite(msg.estimate_s) and msg.estimate_s >= 0 else 0.0
    return Plan(
        model=msg.model,
        strategy=strategy,
        stages=stages,
        epoch=msg.epoch,
        reason=msg.reason,
        max_context=msg.max_context,
        kv_bits=msg.kv_bits,
        estimate_s=estimate,
        alternatives=_alternatives_from_json(msg.alternatives),
    )
