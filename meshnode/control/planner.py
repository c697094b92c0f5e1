"""The planner: which nodes hold which layers. Pure: no I/O, no clock, no randomness.

Input: the model's profile, the live nodes with their memory budgets, the max context.
Output: a :class:`Plan` or a :class:`PlanError` that says what is missing.

Rules, in order:
1. Use the fewest nodes that fit: one machine is faster than two, since every hop costs a
   network round trip per token.
2. Among subsets of that size, prefer the nodes of the current plan (no needless reloads), then
   the nodes with the largest budgets.
3. Split the layers contiguously so that every node uses the same fraction of its budget as
   nearly as possible (layers in proportion to memory), never exceeding any budget. The split
   minimises the largest fraction used (exact dynamic programme over the layer boundaries).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from meshnode.data.profile import ModelProfile

STRATEGIES = ("single", "pipeline")
_EXACT_ORDERS_UP_TO = 4  # try every stage order for this many nodes; a few sensible ones beyond


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    memory_budget: int
    compute: float = 1.0


@dataclass(frozen=True)
class Stage:
    start_layer: int
    end_layer: int  # exclusive
    nodes: tuple[str, ...]
    bytes: int = 0


@dataclass(frozen=True)
class Plan:
    model: str
    strategy: str
    stages: tuple[Stage, ...]
    epoch: int = 0
    reason: str = ""
    max_context: int = 0

    def node_ids(self) -> list[str]:
        return [n for s in self.stages for n in s.nodes]

    def stage_of(self, node_id: str) -> Stage | None:
        return next((s for s in self.stages if node_id in s.nodes), None)

    def with_epoch(self, epoch: int) -> "Plan":
        return replace(self, epoch=epoch)

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "model": self.model, "strategy": self.strategy, "reason": self.reason,
                "max_context": self.max_context,
                "stages": [{"start_layer": s.start_layer, "end_layer": s.end_layer, "nodes": list(s.nodes),
                            "bytes": s.bytes} for s in self.stages]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        stages = tuple(Stage(int(s["start_layer"]), int(s["end_layer"]), tuple(s["nodes"]), int(s.get("bytes", 0)))
                       for s in d["stages"])
        return cls(model=d["model"], strategy=d["strategy"], stages=stages, epoch=int(d.get("epoch", 0)),
                   reason=d.get("reason", ""), max_context=int(d.get("max_context", 0)))


class PlanError(Exception):
    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


class _Costs:
    """O(1) stage sizes from prefix sums."""

    def __init__(self, profile: ModelProfile, max_context: int):
        self.p = profile
        self.n = profile.num_layers
        per_layer = [profile.layer_bytes[i] + profile.kv_bytes(i, max_context) for i in range(self.n)]
        self.prefix = [0, *itertools.accumulate(per_layer)]

    def stage(self, start: int, end: int) -> int:
        p = self.p
        total = self.prefix[end] - self.prefix[start]
        if start == 0:
            total += p.embed_bytes
        if end == self.n:
            total += p.norm_bytes + p.head_bytes + (p.embed_bytes if p.tied_embeddings and start != 0 else 0)
        return total


def _greedy_fits(costs: _Costs, budgets: Sequence[int]) -> bool:
    """Exact feasibility for a fixed stage order: each stage takes as many layers as fit."""
    start, k = 0, len(budgets)
    for i, budget in enumerate(budgets):
        if i == k - 1:
            return costs.stage(start, costs.n) <= budget
        end = start
        while end < costs.n - (k - 1 - i) and costs.stage(start, end + 1) <= budget:
            end += 1
        if end == start:
            return False
        start = end
    return False


def _balanced_split(costs: _Costs, budgets: Sequence[int]) -> list[int] | None:
    """Boundaries minimising the largest fraction of a budget used (None if nothing fits)."""
    n, k = costs.n, len(budgets)
    inf = float("inf")
    # best[i][e]: min over splits of layers [0, e) into stages 0..i of the max fraction used.
    best = [[inf] * (n + 1) for _ in range(k)]
    back = [[0] * (n + 1) for _ in range(k)]
    for e in range(1, n + 1):
        best[0][e] = costs.stage(0, e) / budgets[0]
    for i in range(1, k):
        for e in range(i + 1, n + 1):
            for s in range(i, e):
                v = max(best[i - 1][s], costs.stage(s, e) / budgets[i])
                if v < best[i][e]:
                    best[i][e], back[i][e] = v, s
    if best[k - 1][n] > 1.0:
        return None
    edges = [n]
    for i in range(k - 1, 0, -1):
        edges.append(back[i][edges[-1]])
    return [0, *reversed(edges)]


def _orders(nodes: Sequence[NodeSpec]) -> list[tuple[NodeSpec, ...]]:
    base = tuple(nodes)  # already sorted: largest budget first
    if len(base) <= _EXACT_ORDERS_UP_TO:
        perms = list(itertools.permutations(base))
        return [base, *[p for p in perms if p != base]]
    # Beyond that: the stage order matters mostly at the ends (embedding first, head last).
    out = [base, tuple(reversed(base))]
    for first, last in itertools.permutations(base, 2):
        middle = [x for x in base if x is not first and x is not last]
        out.append((first, *middle, last))
    return out


def _subsets(nodes: Sequence[NodeSpec], k: int, preferred: set[str]):
    combos = list(itertools.combinations(nodes, k))
    # Stable: the current plan's nodes first, then by the (budget-sorted) combination order.
    return sorted(combos, key=lambda c: -sum(1 for n in c if n.node_id in preferred))


def plan(
    profile: ModelProfile,
    nodes: Sequence[NodeSpec],
    *,
    max_context: int,
    strategy: str | None = None,
    preferred: Sequence[str] = (),
) -> Plan:
    if strategy is not None and strategy not in STRATEGIES:
        raise PlanError([f"unknown strategy {strategy!r}; this planner knows {', '.join(STRATEGIES)}"])
    if not nodes:
        raise PlanError(["no nodes to place the model on"])
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise PlanError([f"duplicate node ids: {', '.join(dup)}"])
    bad = [n.node_id for n in nodes if n.memory_budget <= 0]
    if bad:
        raise PlanError([f"nodes without a memory budget: {', '.join(sorted(bad))}"])
    if max_context <= 0 or profile.num_layers <= 0:
        raise PlanError(["max_context and the number of layers must be positive"])

    costs = _Costs(profile, max_context)
    ordered = sorted(nodes, key=lambda n: (-n.memory_budget, n.node_id))
    need = costs.stage(0, profile.num_layers)
    offered = sum(n.memory_budget for n in nodes)
    sizes = range(1, min(len(ordered), profile.num_layers) + 1)
    if strategy == "single":
        sizes = range(1, 2)
    elif strategy == "pipeline":
        sizes = range(2, min(len(ordered), profile.num_layers) + 1)
    pref = set(preferred)
    for k in sizes:
        for subset in _subsets(ordered, k, pref):
            for order in _orders(subset):
                budgets = [n.memory_budget for n in order]
                if not _greedy_fits(costs, budgets):
                    continue
                edges = _balanced_split(costs, budgets)
                assert edges is not None  # greedy said it fits
                stages = tuple(
                    Stage(edges[i], edges[i + 1], (order[i].node_id,), costs.stage(edges[i], edges[i + 1]))
                    for i in range(k)
                )
                return Plan(model=profile.name, strategy="single" if k == 1 else "pipeline", stages=stages,
                            reason=_reason(profile, stages, order, need, max_context), max_context=max_context)
    raise PlanError(_why_not(profile, costs, ordered, need, offered, max_context, strategy))


def _reason(profile: ModelProfile, stages, order, need: int, ctx: int) -> str:
    if len(stages) == 1:
        return (f"fits on {stages[0].nodes[0]} alone ({gib(need)} for {ctx} tokens of context; "
                f"one machine beats two)")
    parts = ", ".join(f"{s.nodes[0]} layers {s.start_layer}-{s.end_layer - 1} ({gib(s.bytes)} of "
                      f"{gib(n.memory_budget)})" for s, n in zip(stages, order))
    return f"needs {len(stages)} nodes for {gib(need)}: layers split by memory: {parts}"


def _why_not(profile, costs, ordered, need, offered, ctx, strategy) -> list[str]:
    reasons = []
    if strategy == "single":
        reasons.append(f"the model needs {gib(need)} for {ctx} tokens of context; the largest node "
                       f"({ordered[0].node_id}) offers {gib(ordered[0].memory_budget)}")
    elif strategy == "pipeline" and len(ordered) < 2:
        reasons.append("a pipeline needs at least two nodes")
    if need > offered:
        reasons.append(f"the model needs {gib(need)} for {ctx} tokens of context; the {len(ordered)} node(s) "
                       f"offer {gib(offered)} together (short by {gib(need - offered)})")
    biggest = max(costs.stage(i, i + 1) for i in range(profile.num_layers))
    if biggest > ordered[0].memory_budget:
        reasons.append(f"a single layer needs up to {gib(biggest)}, more than any node's budget "
                       f"(largest {gib(ordered[0].memory_budget)})")
    if not reasons:
        reasons.append(f"the model needs {gib(need)} and the nodes offer {gib(offered)}, but no contiguous split "
                       f"of its {profile.num_layers} layers fits their budgets (layers are placed whole)")
    return reasons
