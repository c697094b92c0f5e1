"""The simulated home lab of benchmarks/homelab.py: its table of hosts, and the pure arithmetic of
its figures (percentiles, regret, layouts, the planner's inputs), apart from the namespaces so
tests/test_homelab_bench.py can check it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshnode.planner import LinkSpec, NodeSpec

# The chosen plan's p95 inter-token time may be this much over the best measured (issue 19).
REGRET_TARGET = 0.10
WIRE_RTT_S = 100e-6  # a bare veth round trip on this VM, for the planner's own timing
WIRE_BPS = 1e9


@dataclass(frozen=True)
class Host:
    name: str
    budget: float  # memory offered, as a fraction of the model's bytes (weights + KV at the lab's context)
    quota: float  # CPU it may use, as a fraction of one core: its speed against the others
    delay_ms: float  # each way, on every frame to and from it (0: wired, no relay)
    jitter_ms: float  # +- uniform, drawn anew every 10 ms (Wi-Fi)
    stands_for: str


# The lab: ten machines, wired and Wi-Fi; the first 3 and the first 6 are the smaller labs.
LAB: tuple[Host, ...] = (
    Host("studio", 0.60, 0.80, 0.0, 0.0, "Mac Studio, wired"),
    Host("mini-a", 0.50, 0.55, 0.0, 0.0, "Mac mini, wired"),
    Host("mbp16", 0.65, 0.70, 3.0, 2.0, "MacBook Pro 16, Wi-Fi"),
    Host("mini-b", 0.50, 0.55, 0.0, 0.0, "Mac mini, wired"),
    Host("mbp14", 0.45, 0.50, 4.0, 3.0, "MacBook Pro 14, Wi-Fi"),
    Host("imac", 0.40, 0.45, 1.0, 0.3, "iMac, powerline"),
    Host("air-a", 0.30, 0.35, 6.0, 4.0, "MacBook Air, Wi-Fi"),
    Host("mini-c", 0.35, 0.50, 0.0, 0.0, "old Mac mini, wired"),
    Host("air-b", 0.30, 0.30, 8.0, 6.0, "MacBook Air, far Wi-Fi"),
    Host("old-mbp", 0.30, 0.25, 10.0, 8.0, "old MacBook Pro, far Wi-Fi"),
)


def node_id(host: Host) -> str:
    """The node id a host's node runs under (harness.netns names hosts ``node-<name>``)."""
    return f"node-{host.name}"


def period_us(quota: float) -> int:
    """The CFS period that gives ``quota`` as 1 ms slices (the kernel's smallest quota): the
    shortest stall a throttled node sees, so a step waits ~1/quota as long, not a 100 ms period."""
    return max(1000, round(1000 / quota))


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q`` (0-100) percentile by linear interpolation between order statistics (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def gaps(times: Sequence[float]) -> list[float]:
    """Inter-token times: the gaps between consecutive content events of one stream."""
    return [b - a for a, b in zip(times, times[1:])]


def regret(chosen_p95: float, measured_p95: Sequence[float]) -> float:
    """How much slower the chosen plan's p95 inter-token time is than the best measured, as a
    fraction (0.0: the chosen plan was the best)."""
    best = min([chosen_p95, *measured_p95])
    return chosen_p95 / best - 1.0


def layout_of(plan: dict) -> str:
    """A /v1/mesh plan's stages in the planner's layout text, as its alternatives list theirs."""
    return " | ".join(f"{s['start_layer']}-{s['end_layer'] - 1}@{'+'.join(s['nodes'])}" for s in plan["stages"])


def alternatives(plan: dict) -> list[dict]:
    """The alternatives a /v1/mesh plan lists that the planner found a placement for."""
    return [a for a in plan.get("alternatives") or () if a.get("feasible") and a.get("stages")]


def scaled_figures(figures: dict, quota: float) -> dict:
    """A host's compute.json: this machine's figures (all taken at full speed, one core) over its
    quota, as a machine that much slower measures of itself."""
    return {k: v / quota if isinstance(v, (int, float)) else v for k, v in figures.items()}


def planner_inputs(
    hosts: Sequence[Host], total_bytes: int, layer_s: float, collective_s: float
) -> tuple[list[NodeSpec], dict[tuple[str, str], LinkSpec]]:
    """The nodes and links the planner would be given for ``hosts`` (from the table, not measured):
    for timing the planner on its own. A link's one-way delay is the two ends' delays added."""
    nodes = [
        NodeSpec(node_id(h), int(total_bytes * h.budget), layer_seconds=layer_s / h.quota, collective_s=collective_s)
        for h in hosts
    ]
    links = {}
    for a in hosts:
        for b in hosts:
            if a is not b:
                rtt = WIRE_RTT_S + 2 * (a.delay_ms + b.delay_ms) / 1e3
                jitter = 2 * (a.jitter_ms + b.jitter_ms) / 1e3 * 0.8  # p90 - p10 of a uniform draw, roughly
                links[(node_id(a), node_id(b))] = LinkSpec(rtt_s=rtt, bandwidth_Bps=WIRE_BPS, jitter_s=jitter)
    return nodes, links


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (a layout's ``|`` escaped in its cell)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def to_force(served: dict, now: dict, complete: dict | None = None) -> list[dict]:
    """The plans to force against the served one: the alternatives it lists (weighed when it was
    made, often before any link was measured) and, weighed with the links measured since, the
    planner's choice and its alternatives, and ``complete``'s choice (the planner over every small
    subset of the nodes); each once, the served plan left out."""
    best = {"strategy": now["strategy"], "stages": layout_of(now), "estimate_s": now["estimate_s"]}
    fresh = [best, *alternatives(now)]
    extra = [{"strategy": complete["strategy"], "stages": layout_of(complete)}] if complete else []
    out: dict[str, dict] = {}
    for source, alts in (("listed", alternatives(served)), ("now", fresh), ("every subset", extra)):
        for a in alts:
            if a["stages"] != layout_of(served):
                row = out.setdefault(a["stages"], {"strategy": a["strategy"], "layout": a["stages"], "sources": []})
                row["sources"].append(source)
                if source == "listed":
                    row["listed_estimate_ms"] = a["estimate_s"] * 1e3
    return list(out.values())
