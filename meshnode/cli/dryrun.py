"""``meshnode plan``: the planner's dry run over a cluster described in a TOML file or read from a
live node's ``/v1/mesh``, and the plan as a person reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnode.ids import NodeId

if TYPE_CHECKING:
    from meshnode.planner import LinkSpec, NodeSpec, Plan


def _bandwidth(value: Any) -> float:
    """Bytes per second from 1e9, "1GB/s", "800MiB/s"."""
    from meshnode.config import parse_size

    if isinstance(value, str):
        value = value.strip()
        value = value[:-2] if value.lower().endswith("/s") else value
    return float(parse_size(value))


def load_cluster(path: Path) -> tuple[list[NodeSpec], dict[tuple[str, str], LinkSpec]]:
    """(nodes, links) from a cluster file: ``[[node]]`` id, memory, layer_ms?, collective_us?, compute?;
    ``[[link]]`` a, b, rtt_us, bandwidth, jitter_us? (p90 - p10 of its round trips). Raises
    ValueError saying what is wrong."""
    import tomllib

    from meshnode.config import parse_size
    from meshnode.planner import LinkSpec, NodeSpec

    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    nodes, links = [], {}
    for i, raw in enumerate(data.get("node") or []):
        try:
            layer_ms, coll_us = raw.get("layer_ms"), raw.get("collective_us")
            nodes.append(
                NodeSpec(
                    node_id=NodeId(str(raw["id"])),
                    memory_budget=parse_size(raw["memory"]),
                    compute=float(raw.get("compute", 1.0)),
                    layer_seconds=float(layer_ms) / 1e3 if layer_ms else None,
                    collective_s=float(coll_us) / 1e6 if coll_us else None,
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{path}: node {i + 1} needs id and memory (and numbers for layer_ms, collective_us, compute): {exc}"
            ) from None
    for i, raw in enumerate(data.get("link") or []):
        try:
            links[(str(raw["a"]), str(raw["b"]))] = LinkSpec(
                float(raw["rtt_us"]) / 1e6, _bandwidth(raw["bandwidth"]), jitter_s=float(raw.get("jitter_us", 0)) / 1e6
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: link {i + 1} needs a, b, rtt_us and bandwidth: {exc}") from None
    if not nodes:
        raise ValueError(f"{path}: no [[node]] tables")
    return nodes, links


def cluster_from_mesh(data: dict[str, Any]) -> tuple[list[NodeSpec], dict[tuple[str, str], LinkSpec]]:
    """(nodes, links) from a node's GET /v1/mesh: each node's budget and measured layer time, and
    for each pair its fastest measured path (least p95 round trip)."""
    from meshnode.planner import LinkSpec, NodeSpec

    nodes: list[NodeSpec] = []
    links: dict[tuple[str, str], LinkSpec] = {}
    for raw in data.get("nodes") or []:
        layer, coll = float(raw.get("layer_seconds") or 0), float(raw.get("collective_seconds") or 0)
        nodes.append(
            NodeSpec(
                node_id=NodeId(str(raw["node_id"])),
                memory_budget=int(raw.get("memory_budget") or 0),
                compute=float(raw.get("compute") or 1.0),
                layer_seconds=layer if layer > 0 else None,
                collective_s=coll if coll > 0 else None,
            )
        )
        for link in raw.get("links") or []:
            try:
                a, b = sorted((str(raw["node_id"]), str(link["peer"])))
                key = (a, b)
                rtt, rpc = float(link["rtt_us"]) / 1e6, float(link.get("rpc_rtt_us") or 0) / 1e6
                jitter = float(link.get("jitter_us") or 0) / 1e6
                spec = LinkSpec(rtt, float(link["bandwidth"]), max(rpc - rtt, 0.0), jitter)
            except (KeyError, TypeError, ValueError):
                continue
            if key not in links or spec.tail_rtt_s < links[key].tail_rtt_s:
                links[key] = spec
    return nodes, links


def format_links(links: Mapping[tuple[str, str], LinkSpec]) -> list[str]:
    """One line per link the plan was costed with: median and p95 round trip, bandwidth."""
    return [
        f"  {a}-{b}  round trip {spec.rtt_s * 1e3:.2f} ms, p95 {spec.tail_rtt_s * 1e3:.2f} ms, "
        f"{spec.bandwidth_Bps / 1e6:,.0f} MB/s"
        for (a, b), spec in sorted(links.items())
    ]


def format_plan(
    result: Plan, nodes: Sequence[NodeSpec], links: Mapping[tuple[str, str], LinkSpec] | None = None
) -> str:
    from meshnode.planner import human_bytes

    budgets = {x.node_id: x.memory_budget for x in nodes}
    est = f"est. {result.tokens_per_s:.3g} tok/s ({result.estimate_s * 1e3:.3g} ms/token)" if result.estimate_s else ""
    kv = f", {result.kv_bits}-bit KV cache" if result.kv_bits else ""
    lines = [f"plan         {result.strategy}, {est}, max context {result.max_context}{kv}"]
    for s in result.stages:
        each = " each" if len(s.nodes) > 1 else ""
        lines.append(
            f"  layers {s.start_layer}-{s.end_layer - 1}  on {'+'.join(s.nodes)}  {human_bytes(s.bytes)}{each}"
        )
    lines.append(
        "memory       "
        + ", ".join(
            f"{n} {human_bytes(s.bytes)} of {human_bytes(budgets.get(n, 0))}" for s in result.stages for n in s.nodes
        )
    )
    lines.append(f"why          {result.reason}")
    if links:
        lines += ["links (costed at p95)", *format_links(links)]
    if result.alternatives:
        lines.append("alternatives")
        for a in result.alternatives:
            if a.get("feasible"):
                memory = ", ".join(f"{n} {human_bytes(b)}" for n, b in (a.get("memory") or {}).items())
                lines.append(
                    f"  {a['strategy']:<9} {a['tokens_per_s']:.3g} tok/s  {a['stages']}  ({memory}): {a['why']}"
                )
            else:
                lines.append(f"  {a['strategy']:<9} impossible: {a['why']}")
    return "\n".join(lines)
