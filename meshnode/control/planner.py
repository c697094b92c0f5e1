"""The planner: which nodes hold which layers. Pure: no I/O, no clock, no randomness.

Input: the model's profile, the live nodes with their memory budgets and measured speed, the
links between them, the max context.
Output: a :class:`Plan`, or a :class:`PlanError` whose reasons say what is missing.

Rules, in order:

1. Use the fewest nodes that fit: one machine beats two, since every hop costs a network
   round trip per token. The search is exact: if any k nodes can hold the model, then so can
   the k nodes with the largest budgets (swap each node of a fitting placement for a larger
   one in the same position), so the least k is found by testing the top-k nodes in every
   stage order at once (a dynamic programme over subsets, exact up to ``EXACT_MAX_NODES``
   stages; beyond that a few natural orders are tried).
2. Among the subsets of that size that fit, prefer the most nodes of ``preferred`` (the
   current plan's, so that a re-plan reloads as little as possible), then the largest budgets
   (ties by node id). Stage order: the preferred nodes in their given order, then by budget,
   largest first (it holds the embedding), then node id; another order only if that one does
   not fit.
3. Split the layers contiguously in proportion to memory, never exceeding a budget: first
   minimise the largest fraction of a budget any stage uses, then, among the splits that reach
   that, minimise sum(bytes_i**2 / budget_i), whose optimum gives each node bytes in proportion
   to its budget. Both are exact dynamic programmes over the layer boundaries. A stage's bytes
   are its layers' weights, their KV cache for ``max_context`` tokens (capped by a layer's
   sliding window), the embedding on the first stage and the final norm and head on the last
   (plus the embedding again on the last when tied and it is not also the first).

Those rules give the *memory-driven* plan. Since tensor parallelism it is one candidate among
many, all estimated in seconds per decoded token; the least estimate wins, and the memory-driven
plan wins every tie (estimates within a relative 1e-9), so with equal nodes and equal links the
rules above still decide.

Strategies: ``single`` (one node), ``pipeline`` (stages of one node each), ``tensor`` (one group
of g >= 2 nodes holding every layer, mlx-lm's ``model.shard``), ``hybrid`` (a pipeline whose
stages are groups, at least one of g >= 2: e.g. 3 nodes where 3 does not divide the heads, a
pair plus a stage). ``strategy=`` forces one; PlanError says why it is impossible.

Cost model (seconds per token; decode is memory-bound, so compute scales with weight bytes):

* A node's seconds per weight byte: ``layer_seconds / average layer bytes`` when measured (one
  decode step of an average layer of this model), else ``1 / (DEFAULT_BYTES_PER_S * compute)``.
* A unit (a stage on a group of g nodes; g = 1 for a pipeline stage) holding layers [s, e):
  ``slowest member's s/B * bytes(s, e) / g`` (members run in lockstep), plus, per layer, two ring
  all-reduces of one activation (``hidden_size * dtype`` bytes = M), each
  ``2 (g - 1) (one-way + M / (g * bandwidth)) + C`` over the group's worst link (one-way = the
  network's RTT / 2), where C is what an all-reduce costs beyond the wire (``collective_s``, the
  slowest member's: each node times a few layers split two ways over a loopback ring and C =
  (split - whole / 2) / 2, which also carries the per-operation costs sharding does not halve;
  ~0.1 ms on a Linux CPU box, 10x the wire's round trip), plus once per token rank 0 handing the
  input to the others (one-way + M / bandwidth + C: a pipe and a control socket). The last
  unit also runs the head (``head_bytes``, or the tied embedding), unsharded, on every member.
  The embedding lookup and the KV reads are left out (one row; small at decode lengths).
* A pipeline of k >= 2 units: k - 1 hops of M bytes between consecutive ranks 0, plus the sampled
  token going back from the last to the first (the first embeds the next token): k one-way trips.
* Links: ``links[(a, b)]`` (either order); an unmeasured pair is assumed ``DEFAULT_LINK`` (1 ms RTT,
  100 MB/s) and the reason says so; a link's ``overhead_s`` (the RPC stack's round trip, which a
  ring collective does not pay) adds half of itself to each pipeline hop; ``link_latency_s``
  replaces every one-way latency (benchmarks that inject latency per message). Every estimate is linear in that latency, which is how
  :func:`crossover_latency` finds where tensor stops paying.

Memory of a group member holding layers [s, e): 1/g of the layers' weights and KV cache, all of
their norms (and MoE routers: replicated by ``shard``), and the embedding / norm / head whole
(mlx-lm's ``shard`` leaves ``embed_tokens`` and ``lm_head`` unsharded). Each member must fit.

Legality: a group of g nodes needs a family whose mlx-lm class has ``shard`` with the rules here
(:data:`TENSOR_FAMILIES`; not mixtral), and g dividing heads, kv heads and the (expert)
intermediate size. A mixture-of-experts model's group must have every pairwise link faster than
``fast_rtt_s`` (200 µs RTT): experts never spread over a slow link; pipeline stages keep whole
layers, so a layer's experts stay on one node.

Search: exact for home labs, heuristic beyond. Single: every node. Pipelines: every subset of up
to ``EXACT_SUBSET_NODES`` nodes (all stage orders up to 3 stages; else the memory order, fastest
first and its reverse), the top-k by budget and by speed beyond; split by the least time within
budgets (the memory split above when the stage nodes are equally fast: time then does not depend
on it). Tensor: every g-subset (top-g by budget and by speed beyond). Hybrid: every partition of
every subset into legal groups in every order up to ``EXACT_GROUP_NODES`` nodes; beyond, the
nodes by budget and by speed cut into consecutive groups of g, in both directions.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from meshnode.data.profile import ModelProfile

__all__ = ["DEFAULT_LINK", "FAST_RTT_S", "STRATEGIES", "TENSOR_FAMILIES", "LinkSpec", "NodeSpec", "Plan", "PlanError",
           "Stage", "crossover_latency", "estimate", "group_size_problem", "plan", "supports_tensor", "tensor_parallel_problem"]

STRATEGIES = ("single", "pipeline", "tensor", "hybrid")
EXACT_MAX_NODES = 12  # subset DP over 2**k stage orders up to here
_PREFERRED_WORK = 2**14  # subsets tried for `preferred` before settling for the largest: this / 2**k


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    memory_budget: int  # bytes offered for weights + KV cache
    compute: float = 1.0  # relative speed, higher is faster: used only when layer_seconds is unknown
    address: str = ""
    layer_seconds: float | None = None  # measured decode step of one average layer (None/0: unknown)
    collective_s: float | None = None  # what one all-reduce adds beyond the wire, measured (None/0: not counted)


@dataclass(frozen=True)
class LinkSpec:
    """A measured link between two nodes (symmetric)."""

    rtt_s: float  # round trip of a small message on the network (what a ring collective pays)
    bandwidth_Bps: float  # bytes per second
    overhead_s: float = 0.0  # what the RPC stack adds to a round trip (a pipeline hop pays it too)


@dataclass(frozen=True)
class Stage:
    start_layer: int
    end_layer: int  # exclusive
    nodes: tuple[str, ...]  # one node for a pipeline stage
    bytes: int = 0  # memory the stage needs on its node
    endpoints: tuple[str, ...] = ()  # tensor group: the address each member's ring uses, by rank (the node fills it)

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer


@dataclass(frozen=True)
class Plan:
    model: str
    strategy: str  # "single" | "pipeline" | "tensor" | "hybrid"
    stages: tuple[Stage, ...]
    epoch: int = 0
    reason: str = ""
    max_context: int = 0
    estimate_s: float = 0.0  # estimated seconds per decoded token (0: not estimated)
    alternatives: tuple[dict, ...] = ()  # the best plan of each other strategy, or why it has none

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.estimate_s if self.estimate_s > 0 else 0.0

    def node_ids(self) -> list[str]:
        """Every node of the plan, in stage order."""
        return [n for s in self.stages for n in s.nodes]

    def stage_of(self, node_id: str) -> Stage | None:
        return next((s for s in self.stages if node_id in s.nodes), None)

    def with_epoch(self, epoch: int) -> "Plan":
        return replace(self, epoch=epoch)

    def check(self, num_layers: int) -> None:
        """Raise ValueError unless the stages tile [0, num_layers) with distinct nodes."""
        edge = 0
        for s in self.stages:
            if s.start_layer != edge or s.end_layer <= s.start_layer or not s.nodes:
                raise ValueError(f"plan epoch {self.epoch}: stages do not tile the model's layers")
            edge = s.end_layer
        if edge != num_layers:
            raise ValueError(f"plan epoch {self.epoch} covers {edge} of {num_layers} layers")
        ids = self.node_ids()
        if len(set(ids)) != len(ids):
            raise ValueError(f"plan epoch {self.epoch} names a node twice")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "strategy": self.strategy, "epoch": self.epoch, "reason": self.reason,
                "max_context": self.max_context, "estimate_s": self.estimate_s,
                "alternatives": [dict(a) for a in self.alternatives],
                "stages": [{"start_layer": s.start_layer, "end_layer": s.end_layer, "nodes": list(s.nodes),
                            "bytes": s.bytes, **({"endpoints": list(s.endpoints)} if s.endpoints else {})}
                           for s in self.stages]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        stages = tuple(Stage(int(s["start_layer"]), int(s["end_layer"]), tuple(str(n) for n in s["nodes"]),
                             int(s.get("bytes", 0)), tuple(str(a) for a in s.get("endpoints") or ()))
                       for s in d["stages"])
        return cls(model=str(d["model"]), strategy=str(d["strategy"]), stages=stages, epoch=int(d.get("epoch", 0)),
                   reason=str(d.get("reason", "")), max_context=int(d.get("max_context", 0)),
                   estimate_s=float(d.get("estimate_s", 0.0) or 0.0),
                   alternatives=tuple(dict(a) for a in d.get("alternatives") or () if isinstance(a, dict)))


class PlanError(Exception):
    """No plan fits; ``reasons`` says why, one sentence each."""

    def __init__(self, reasons: Sequence[str] | str):
        self.reasons = [reasons] if isinstance(reasons, str) else list(reasons)
        super().__init__("; ".join(self.reasons))


def human_bytes(n: float) -> str:
    """31.2 GiB, 512.0 MiB, 300 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _context(ctx: int, requests: int = 1) -> str:
    each = f" for each of {requests} requests at once" if requests > 1 else ""
    return f"for {ctx} token{'s' if ctx != 1 else ''} of context{each}"


class _Costs:
    """Stage sizes in O(1) from prefix sums of per-layer weights + KV."""

    def __init__(self, profile: ModelProfile, max_context: int):
        p = profile
        self.n = n = p.num_layers
        self.prefix = [0, *itertools.accumulate(p.layer_bytes[i] + p.kv_bytes(i, max_context) for i in range(n))]
        self.head = p.embed_bytes  # added when start == 0
        self.tail = p.norm_bytes + p.head_bytes  # added when end == n
        self.tied = p.embed_bytes if p.tied_embeddings else 0  # added when end == n and start != 0

    def stage(self, start: int, end: int) -> int:
        total = self.prefix[end] - self.prefix[start]
        if start == 0:
            total += self.head
        if end == self.n:
            total += self.tail + (self.tied if start != 0 else 0)
        return total

    def reach(self, start: int, budget: int, cap: int) -> int:
        """The furthest end <= cap with stage(start, end) <= budget, or start if none."""
        lo, hi = start, cap  # stage() grows with end: binary search
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.stage(start, mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def greedy(self, budgets: Sequence[int]) -> bool:
        """Whether this stage order fits, each stage taking as many layers as it can while leaving
        one for each later stage. Sound always; exact when no fewer nodes fit (see _order)."""
        start, k = 0, len(budgets)
        for i, b in enumerate(budgets):
            end = self.reach(start, b, self.n - (k - 1 - i))
            if end == start:
                return False
            start = end
        return start == self.n


def _subset_reach(costs: _Costs, budgets: Sequence[int]) -> list[int]:
    """f[mask]: the furthest layer the nodes in mask can cover from layer 0, each holding at least
    one layer and leaving one for each node not in mask, in the best order (-1: none).

    Taking the furthest reach at each step loses nothing while no smaller set of nodes fits: were
    a greedy boundary to overtake a fitting split's next boundary and get stuck, dropping the node
    in between would leave a fitting split with fewer nodes.
    """
    k, n = len(budgets), costs.n
    f = [-1] * (1 << k)
    f[0] = 0
    for mask in range(1, 1 << k):
        cap = n - (k - bin(mask).count("1"))
        best = -1
        for i in range(k):
            bit = 1 << i
            if mask & bit:
                s = f[mask ^ bit]
                if 0 <= s < cap:
                    e = costs.reach(s, budgets[i], cap)
                    if e > s and e > best:
                        best = e
        f[mask] = best
    return f


def _fits(costs: _Costs, nodes: Sequence[NodeSpec]) -> bool:
    budgets = [x.memory_budget for x in nodes]
    if len(nodes) <= EXACT_MAX_NODES:
        return _subset_reach(costs, budgets)[-1] == costs.n
    return any(costs.greedy([x.memory_budget for x in order]) for order in _natural_orders(nodes))


def _natural_orders(nodes: Sequence[NodeSpec]) -> list[tuple[NodeSpec, ...]]:
    """For clusters beyond the exact search: the given order, reversed, and every choice of the
    first and last node (where the embedding and head go) with the rest in between."""
    base = tuple(nodes)
    out = [base, tuple(reversed(base))]
    for first, last in itertools.permutations(base, 2):
        out.append((first, *[x for x in base if x is not first and x is not last], last))
    return out


def _order(costs: _Costs, nodes: Sequence[NodeSpec]) -> tuple[NodeSpec, ...] | None:
    """A stage order of these nodes that fits: the given order if it does, else the first (in
    lexicographic order over the given one) along a chain of the subset programme's best reaches."""
    base = tuple(nodes)
    if costs.greedy([x.memory_budget for x in base]):
        return base
    if len(base) > EXACT_MAX_NODES:
        return next((o for o in _natural_orders(base) if costs.greedy([x.memory_budget for x in o])), None)
    k, n = len(base), costs.n
    budgets = [x.memory_budget for x in base]
    f = _subset_reach(costs, budgets)
    full = (1 << k) - 1
    if f[full] != n:
        return None

    def step(mask: int, i: int) -> int:  # where node i ends when it follows the nodes in mask
        return costs.reach(f[mask], budgets[i], n - (k - bin(mask).count("1") - 1))

    # done[mask]: from the best reach of mask, best reaches lead on to every node.
    done = [False] * (1 << k)
    done[full] = True
    for mask in range(full - 1, -1, -1):
        if f[mask] >= 0:
            done[mask] = any(not mask & (1 << i) and done[mask | 1 << i] and f[mask] < step(mask, i) == f[mask | 1 << i]
                             for i in range(k))
    if not done[0]:  # cannot happen: f[full] == n is itself such a chain
        return None
    order: list[NodeSpec] = []
    mask = 0
    while mask != full:
        i = next(i for i in range(k) if not mask & (1 << i) and done[mask | 1 << i]
                 and f[mask] < step(mask, i) == f[mask | 1 << i])
        order.append(base[i])
        mask |= 1 << i
    return tuple(order)


def _split(costs: _Costs, budgets: Sequence[int]) -> list[int] | None:
    """Layer boundaries [0, b1, ..., n] for stages with these budgets, in this order: the split
    that minimises the largest fraction of a budget used, then sum(bytes**2 / budget)."""
    n, k = costs.n, len(budgets)
    inf = float("inf")
    # Pass 1: best1[i][e] = least max fraction over splits of layers [0, e) into stages 0..i.
    best1 = [[inf] * (n + 1) for _ in range(k)]
    for e in range(1, n - k + 2):
        c = costs.stage(0, e)
        if c <= budgets[0]:
            best1[0][e] = c / budgets[0]
    for i in range(1, k):
        b = budgets[i]
        prev, row = best1[i - 1], best1[i]
        for e in range(i + 1, n - (k - 1 - i) + 1):
            m = inf
            for s in range(i, e):
                if prev[s] < m:
                    c = costs.stage(s, e)
                    if c <= b:
                        v = max(prev[s], c / b)
                        if v < m:
                            m = v
            row[e] = m
    limit = best1[k - 1][n]
    if limit == inf:
        return None
    # Pass 2: least sum(bytes**2 / budget) over splits whose every fraction stays within `limit`.
    best2 = [[inf] * (n + 1) for _ in range(k)]
    back = [[0] * (n + 1) for _ in range(k)]
    for e in range(1, n - k + 2):
        c = costs.stage(0, e)
        if c <= budgets[0] and c / budgets[0] <= limit:
            best2[0][e] = c * c / budgets[0]
    for i in range(1, k):
        b = budgets[i]
        prev, row, brow = best2[i - 1], best2[i], back[i]
        for e in range(i + 1, n - (k - 1 - i) + 1):
            m, arg = inf, 0
            for s in range(i, e):
                if prev[s] < inf:
                    c = costs.stage(s, e)
                    if c <= b and c / b <= limit:
                        v = prev[s] + c * c / b
                        if v < m:
                            m, arg = v, s
            row[e], brow[e] = m, arg
    if best2[k - 1][n] == inf:  # cannot happen: pass 1's split qualifies
        return None
    edges = [n]
    for i in range(k - 1, 0, -1):
        edges.append(back[i][edges[-1]])
    return [0, *reversed(edges)]


def _candidates(ranked: list[NodeSpec], k: int, preferred: dict[str, int]):
    """k-subsets in order of preference: the top k by budget, preceded by those holding more
    preferred nodes (most first; then the larger budgets). Each comes in stage order."""
    top = ranked[:k]
    top_pref = sum(1 for x in top if x.node_id in preferred)
    pref_idx = [i for i, x in enumerate(ranked) if x.node_id in preferred]
    other_idx = [i for i, x in enumerate(ranked) if x.node_id not in preferred]
    tried, limit = 0, max(8, _PREFERRED_WORK >> k)
    for j in range(min(k, len(pref_idx)), top_pref, -1):
        if k - j > len(other_idx):
            continue
        combos = sorted(tuple(sorted(p + q)) for p in itertools.combinations(pref_idx, j)
                        for q in itertools.combinations(other_idx, k - j))
        for combo in combos:
            if tried >= limit:
                break
            tried += 1
            yield _stage_order([ranked[i] for i in combo], preferred)
    yield _stage_order(top, preferred)


def _stage_order(subset: Sequence[NodeSpec], preferred: dict[str, int]) -> list[NodeSpec]:
    pref = sorted((x for x in subset if x.node_id in preferred), key=lambda x: preferred[x.node_id])
    rest = [x for x in subset if x.node_id not in preferred]  # already by budget, then id
    return pref + rest


def _memory_plan(profile: ModelProfile, costs: _Costs, ranked: list[NodeSpec], ids: list[str], max_context: int,
                 strategy: str | None, pref: dict[str, int]) -> Plan | None:
    """The memory-driven single/pipeline plan: the fewest nodes, split by memory (rules 1-3 above).
    It comes first among the candidates, so it wins every tie of the estimates."""
    n = profile.num_layers
    low = 2 if strategy == "pipeline" else 1
    high = 1 if strategy == "single" else min(len(ranked), n)
    # A lower bound on the bytes of any split into k >= 2 stages: a tied embedding is held twice.
    split_need = costs.stage(0, n) + costs.tied
    for k in range(low, high + 1):
        top = ranked[:k]
        if sum(x.memory_budget for x in top) < (costs.stage(0, n) if k == 1 else split_need):
            continue
        if not _fits(costs, top):
            continue
        for subset in _candidates(ranked, k, pref):
            if sum(x.memory_budget for x in subset) < (costs.stage(0, n) if k == 1 else split_need):
                continue
            order = _order(costs, subset)
            if order is None:
                continue
            edges = _split(costs, [x.memory_budget for x in order])
            if edges is None:  # cannot happen: the order fits
                continue
            stages = tuple(Stage(edges[i], edges[i + 1], (order[i].node_id,), costs.stage(edges[i], edges[i + 1]))
                           for i in range(k))
            return Plan(model=profile.name, strategy="single" if k == 1 else "pipeline", stages=stages,
                        reason=_reason(profile, costs, stages, order, ranked, max_context, strategy, pref),
                        max_context=max_context)
    return None


def _reason(profile, costs: _Costs, stages, order, ranked, ctx: int, strategy, pref) -> str:
    need = costs.stage(0, costs.n)
    if len(stages) == 1:
        node = order[0]
        return (f"fits on {node.node_id} alone: {human_bytes(need)} of its {human_bytes(node.memory_budget)} "
                f"{_context(ctx, profile.kv_requests)} (one machine beats two)")
    k = len(stages)
    if strategy == "pipeline" and ranked[0].memory_budget >= need:
        why = "pipeline forced"
    elif k == 2:
        why = f"no single node holds {human_bytes(need)} {_context(ctx, profile.kv_requests)}"
    else:
        why = f"no {k - 1} nodes hold {human_bytes(need)} {_context(ctx, profile.kv_requests)}"
    kept = [x.node_id for x in order if x.node_id in pref]
    keep = f"; keeps {', '.join(kept)} from the current plan" if kept else ""
    parts = ", ".join(f"{s.nodes[0]} layers {s.start_layer}-{s.end_layer - 1} ({human_bytes(s.bytes)} of "
                      f"{human_bytes(x.memory_budget)})" for s, x in zip(stages, order))
    return f"needs {k} nodes ({why}); layers split by memory: {parts}{keep}"


def _why_not(profile: ModelProfile, costs: _Costs, ranked: list[NodeSpec], ctx: int, strategy) -> list[str]:
    n = costs.n
    need = costs.stage(0, n)
    offered = sum(x.memory_budget for x in ranked)
    largest = ranked[0]
    # "the 3 nodes offer 24.0 GiB together" / "node a offers 8.0 GiB"
    offer = f"node {largest.node_id} offers" if len(ranked) == 1 else f"the {len(ranked)} nodes offer"
    together = "" if len(ranked) == 1 else " together"
    context = _context(ctx, profile.kv_requests)
    if strategy == "single":
        return [f"strategy 'single': model needs {human_bytes(need)} {context}; the largest node ({largest.node_id}) "
                f"offers {human_bytes(largest.memory_budget)} (short by {human_bytes(need - largest.memory_budget)})"]
    reasons: list[str] = []
    if strategy == "pipeline" and len(ranked) < 2:
        reasons.append(f"a pipeline needs at least two nodes; there is only {largest.node_id}")
    if strategy == "pipeline" and n < 2:
        reasons.append(f"a pipeline needs at least two layers; model {profile.name!r} has {n}")
    split_need = need + costs.tied
    if need > offered:
        reasons.append(f"model needs {human_bytes(need)} {context}; {offer} {human_bytes(offered)}{together} "
                       f"(short by {human_bytes(need - offered)})")
    elif split_need > offered and len(ranked) > 1 and n > 1 and (strategy == "pipeline"
                                                                 or largest.memory_budget < need):
        reasons.append(f"model needs {human_bytes(split_need)} {context} when split over nodes (its tied embedding "
                       f"is held by the first and the last stage); {offer} {human_bytes(offered)}{together} "
                       f"(short by {human_bytes(split_need - offered)})")
    # The stage holding layer i needs at least stage(i, i + 1): the embedding comes with layer 0,
    # the norm and head with the last layer.
    alone = [costs.stage(i, i + 1) for i in range(n)]
    too_big = [i for i in range(n) if alone[i] > largest.memory_budget]
    if too_big and not (n == 1 and reasons):
        worst = max(too_big, key=lambda i: alone[i])
        what = f"layer {worst}"
        if n > 1 and worst == 0:
            what += " with the embedding"
        elif n > 1 and worst == n - 1:
            what += " with the final norm and head"
        others = [i for i in too_big if i != worst]
        more = ("" if not others else f" (so does layer {others[0]})" if len(others) == 1
                else f" (so do layers {_ranges(others)})")
        reasons.append(f"{what} alone needs {human_bytes(alone[worst])} {context}, more than any node's budget "
                       f"(largest: {largest.node_id}, {human_bytes(largest.memory_budget)}){more}")
    if not reasons:
        reasons.append(f"model needs {human_bytes(need)} {context} and {offer} {human_bytes(offered)}{together}, but "
                       f"layers are placed whole and no contiguous split of its {n} layers fits their budgets "
                       f"(largest: {largest.node_id}, {human_bytes(largest.memory_budget)})")
    if strategy is None:
        fit = _max_context_that_fits(profile, ranked, ctx)
        if fit:
            reasons.append(f"it would fit with max_context {fit}")
    return reasons


def _ranges(layers: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out = []
    for _, group in itertools.groupby(enumerate(layers), key=lambda t: t[1] - t[0]):
        run = [x for _, x in group]
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(out)


def _max_context_that_fits(profile: ModelProfile, ranked: list[NodeSpec], ctx: int) -> int:
    """The largest context below ctx at which some node set fits (0: none), by bisection."""
    if len(ranked) > EXACT_MAX_NODES or not any(profile.kv_bytes_per_token):
        return 0
    n = profile.num_layers

    def fits(c: int) -> bool:
        costs = _Costs(profile, c)
        need = costs.stage(0, n)
        return any(_fits(costs, ranked[:k]) for k in range(1, min(len(ranked), n) + 1)
                   if sum(x.memory_budget for x in ranked[:k]) >= (need if k == 1 else need + costs.tied))

    if not fits(1):
        return 0
    lo, hi = 1, ctx - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---- time per token: the cost model, and the search over strategies ----

DEFAULT_LINK = LinkSpec(rtt_s=1e-3, bandwidth_Bps=100e6)  # an unmeasured link: a conservative LAN
DEFAULT_BYTES_PER_S = 100e9  # weight bytes a node of compute 1.0 streams per second (decode is memory-bound)
FAST_RTT_S = 200e-6  # a link below this RTT may carry a MoE layer's expert traffic (Thunderbolt, not TCP)
TOKEN_BYTES = 8  # the sampled token the last stage returns to the first
# Families whose mlx-lm model class has ``shard(group)`` and whose sharding needs only heads, kv heads and
# (expert, shared expert) intermediate sizes divisible by the group size, checked token for token against
# mlx-lm in tests/test_tensor.py. mlx-lm has shard() for a few more (minimax, qwen3_5, ...): they stay
# pipeline-only until they pass there.
TENSOR_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"})
EXACT_SUBSET_NODES = 5  # every subset (pipelines, tensor groups) up to here; a few natural ones beyond
EXACT_GROUP_NODES = 4  # every partition into groups (hybrid) up to here; chunked orders beyond
_TIE = 1e-9  # estimates this close (relative) are equal: the earlier candidate wins
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def tensor_parallel_problem(profile: ModelProfile) -> str | None:
    """None when mlx-lm can shard this model over a tensor group; else why not (one sentence)."""
    if profile.model_type in TENSOR_FAMILIES:
        return None
    return f"tensor: {profile.model_type or 'this model'} has no tensor-parallel implementation in mlx-lm"


def supports_tensor(profile: ModelProfile) -> bool:
    return tensor_parallel_problem(profile) is None


def group_size_problem(profile: ModelProfile, g: int) -> str | None:
    """None when a tensor group of g nodes may hold this model's layers; else why not."""
    if g <= 1:
        return None
    family = tensor_parallel_problem(profile)
    if family:
        return family
    dims = [(profile.num_heads, f"{profile.num_heads} heads"), (profile.num_kv_heads, f"{profile.num_kv_heads} kv heads"),
            (profile.intermediate_size, f"the intermediate size {profile.intermediate_size}")]
    if profile.moe_intermediate_size:
        dims.append((profile.moe_intermediate_size, f"the expert intermediate size {profile.moe_intermediate_size}"))
    bad = [text for v, text in dims if v > 0 and v % g]
    if profile.num_heads <= 0 or profile.num_kv_heads <= 0:
        bad.append("an unknown number of heads")
    if bad:
        return f"tensor: {g} does not divide {', '.join(bad)}"
    q = profile.quant_group_size
    # A quantized layer split by its inputs (o_proj, down_proj) keeps whole quantization groups per member.
    inputs = [(profile.num_heads * profile.head_dim, "the attention output"),
              (profile.intermediate_size, "the intermediate size"), (profile.moe_intermediate_size, "the expert size")]
    split = [f"{what} {v} / {g}" for v, what in inputs if q and v and (v // g) % q]
    if split:
        return f"tensor: {', '.join(split)} is not a whole number of {q}-weight quantization groups"
    return None


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 0.999e-3 else f"{seconds * 1e3:.3g} ms"


def _tps(estimate: float) -> str:
    return f"{1.0 / estimate:.3g} tok/s" if estimate > 0 else "∞ tok/s"


def _summary(units) -> str:
    """'0-11@a+b | 12-23@c'."""
    return " | ".join(f"{s}-{e - 1}@{'+'.join(ids)}" for ids, s, e in units)


def _kind(units) -> str:
    grouped = any(len(ids) > 1 for ids, _, _ in units)
    if len(units) == 1:
        return "tensor" if grouped else "single"
    return "hybrid" if grouped else "pipeline"


class _Cx:
    """Everything the estimates need, precomputed: see the module docstring for the model."""

    def __init__(self, profile: ModelProfile, nodes: Sequence[NodeSpec], max_context: int,
                 links: Mapping[tuple[str, str], LinkSpec] | None, link_latency_s: float | None, fast_rtt_s: float):
        p = self.p = profile
        self.n = n = p.num_layers
        self.ctx = max_context
        self.costs = _Costs(p, max_context)
        self.by_id = {x.node_id: x for x in nodes}
        self.W = [0, *itertools.accumulate(p.layer_bytes)]
        self.avg = max(self.W[-1] / n, 1.0) if n else 1.0
        self.head_w = p.head_bytes or (p.embed_bytes if p.tied_embeddings else 0)
        item = _ITEMSIZE.get(p.dtype, 2)
        self.msg = max(p.hidden_size, 1) * item  # one token's activation
        per_layer_repl = 2 * p.hidden_size * item + (p.hidden_size * p.num_experts * item if p.num_experts else 0)
        self.R = [0, *itertools.accumulate(min(b, per_layer_repl) for b in p.layer_bytes)]
        self.KV = [0, *itertools.accumulate(p.kv_bytes(i, max_context) for i in range(n))]
        self.links: dict[tuple[str, str], LinkSpec] = {}
        for (a, b), spec in (links or {}).items():
            self.links[(a, b)] = self.links[(b, a)] = spec
        self.lat = link_latency_s
        self.fast_rtt = fast_rtt_s
        self.moe = p.num_experts > 0

    def spb(self, node_id: str) -> float:
        """Seconds per byte of layer weights on this node in a decode step."""
        x = self.by_id[node_id]
        if x.layer_seconds and x.layer_seconds > 0:
            return x.layer_seconds / self.avg
        return 1.0 / (DEFAULT_BYTES_PER_S * (x.compute if x.compute > 0 else 1.0))

    def link(self, a: str, b: str) -> tuple[float, float, bool]:
        """(one-way latency s, bandwidth B/s, measured?)."""
        spec = self.links.get((a, b))
        known = spec is not None
        spec = spec or DEFAULT_LINK
        one_way = self.lat if self.lat is not None else spec.rtt_s / 2
        return max(one_way, 0.0), max(spec.bandwidth_Bps, 1.0), known

    def hop(self, a: str, b: str) -> tuple[float, float]:
        """(seconds one way, bandwidth B/s) of a pipeline hop: the network plus the RPC stack."""
        one_way, bw, _ = self.link(a, b)
        spec = self.links.get((a, b))
        return one_way + (spec.overhead_s / 2 if spec is not None else 0.0), bw

    def worst(self, ids: Sequence[str]) -> tuple[float, float]:
        pairs = [self.link(a, b) for a, b in itertools.combinations(ids, 2)]
        return max(p[0] for p in pairs), min(p[1] for p in pairs)

    def fast(self, ids: Sequence[str]) -> bool:
        return all(2 * self.link(a, b)[0] < self.fast_rtt for a, b in itertools.combinations(ids, 2))

    def group_ok(self, ids: Sequence[str]) -> bool:
        g = len(ids)
        return g == 1 or (group_size_problem(self.p, g) is None and (not self.moe or self.fast(ids)))

    def mem(self, s: int, e: int, g: int) -> int:
        """Bytes each member of a g-node group holding layers [s, e) needs: 1/g of the layers' sharded
        weights and KV, all of their norms (and MoE routers), the embedding and head whole."""
        if g == 1:
            return self.costs.stage(s, e)
        ends = self.costs.stage(s, e) - (self.costs.prefix[e] - self.costs.prefix[s])
        repl = self.R[e] - self.R[s]
        sharded = self.W[e] - self.W[s] - repl
        kv = self.KV[e] - self.KV[s]
        return -(-sharded // g) + repl + -(-kv // g) + ends

    def machinery(self, ids: Sequence[str]) -> float:
        """One all-reduce's own cost in this group (its slowest member's measurement)."""
        return max(self.by_id[i].collective_s or 0.0 for i in ids)

    def coll(self, ids: Sequence[str]) -> float:
        """Collectives per layer per token in a group: 2 ring all-reduces of one activation."""
        g = len(ids)
        if g == 1:
            return 0.0
        one_way, bw = self.worst(ids)
        return 2 * (2 * (g - 1) * (one_way + self.msg / (g * bw)) + self.machinery(ids))

    def unit_spec(self, ids: Sequence[str]):
        slowest = max(self.spb(i) for i in ids)
        return len(ids), min(self.by_id[i].memory_budget for i in ids), slowest / len(ids), self.coll(ids), slowest

    def estimate(self, units) -> float:
        """Seconds per decoded token of a plan given as ((node ids, start, end), ...)."""
        total = 0.0
        for ids, s, e in units:
            g, _, rate, coll, slowest = self.unit_spec(ids)
            total += rate * (self.W[e] - self.W[s]) + coll * (e - s)
            if e == self.n:
                total += slowest * self.head_w  # lm_head is not sharded: every member computes it
            if g > 1:  # rank 0 hands the step's input to the other members
                one_way, bw = self.worst(ids)
                total += one_way + self.msg / bw + self.machinery(ids)
        for (a, _, _), (b, _, _) in zip(units, units[1:]):
            one_way, bw = self.hop(a[0], b[0])
            total += one_way + self.msg / bw
        if len(units) > 1:
            one_way, bw = self.hop(units[-1][0][0], units[0][0][0])
            total += one_way + TOKEN_BYTES / bw
        return total

    def unknown_links(self, units) -> list[str]:
        """Links the estimate of this plan assumed (unmeasured)."""
        pairs = set()
        for ids, _, _ in units:
            pairs.update(itertools.combinations(ids, 2))
        heads = [ids[0] for ids, _, _ in units]
        pairs.update(zip(heads, heads[1:]))
        if len(heads) > 1:
            pairs.add((heads[-1], heads[0]))
        return sorted(f"{a}-{b}" for a, b in pairs if not self.link(a, b)[2])

    def split(self, groups: Sequence[Sequence[str]]) -> list[int] | None:
        """Layer boundaries for these units in this order: the least estimated time within every
        member's budget, then the least largest fraction of a budget. Equal-speed single nodes get
        the memory-proportional split of :func:`_split` (time does not depend on it)."""
        n, k = self.n, len(groups)
        if k > n or k == 0:
            return None
        specs = [self.unit_spec(ids) for ids in groups]
        if all(sp[0] == 1 for sp in specs) and len({sp[2] for sp in specs}) == 1:
            return _split(self.costs, [sp[1] for sp in specs])
        const = len({(sp[0], sp[2], sp[3], sp[4]) for sp in specs}) == 1
        inf = (float("inf"), float("inf"))
        W, head_w = self.W, self.head_w

        def cost(i: int, s: int, e: int):
            g, budget, rate, coll, slowest = specs[i]
            m = self.mem(s, e, g)
            if m > budget:
                return None
            t = 0.0 if const else rate * (W[e] - W[s]) + coll * (e - s) + (slowest * head_w if e == n else 0.0)
            return t, m / budget

        best = [[inf] * (n + 1) for _ in range(k)]
        back = [[0] * (n + 1) for _ in range(k)]
        for e in range(1, n - k + 2):
            c = cost(0, 0, e)
            if c is not None:
                best[0][e] = c
        for i in range(1, k):
            prev, row, brow = best[i - 1], best[i], back[i]
            for e in range(i + 1, n - (k - 1 - i) + 1):
                m, arg = inf, 0
                for s in range(i, e):
                    if prev[s][0] == inf[0]:
                        continue
                    c = cost(i, s, e)
                    if c is None:
                        continue
                    v = (prev[s][0] + c[0], max(prev[s][1], c[1]))
                    if v < m:
                        m, arg = v, s
                row[e], brow[e] = m, arg
        if best[k - 1][n][0] == inf[0]:
            return None
        edges = [n]
        for i in range(k - 1, 0, -1):
            edges.append(back[i][edges[-1]])
        return [0, *reversed(edges)]


@dataclass(frozen=True)
class _Cand:
    strategy: str
    units: tuple  # ((node ids, start, end), ...)
    legacy: Plan | None = None


def _partitions(items: Sequence[str], sizes: set[int]):
    """Every partition of items into blocks whose sizes are in ``sizes`` (blocks keep item order)."""
    if not items:
        yield []
        return
    first, rest = items[0], list(items[1:])
    for r in range(len(rest) + 1):
        if r + 1 not in sizes:
            continue
        for combo in itertools.combinations(rest, r):
            left = [x for x in rest if x not in combo]
            for tail in _partitions(left, sizes):
                yield [(first, *combo), *tail]


def _enumerate(cx: _Cx, ranked: list[NodeSpec], allowed: set[str], legacy: Plan | None) -> list[_Cand]:
    """Every candidate placement, the memory-driven plan first (it wins ties)."""
    n, N = cx.n, len(ranked)
    ids = [x.node_id for x in ranked]  # by budget, largest first, then id
    out: list[_Cand] = []
    seen: set = set()  # placements (units) listed
    tried: set = set()  # group sequences split

    def add(groups: Sequence[Sequence[str]], legacy_plan: Plan | None = None) -> None:
        groups = [tuple(g) for g in groups]
        key = tuple(groups)
        if key in tried or not all(cx.group_ok(g) for g in groups):
            return
        tried.add(key)
        edges = cx.split(groups)
        if edges is None:
            return
        units = tuple((g, edges[i], edges[i + 1]) for i, g in enumerate(groups))
        strategy = _kind(units)
        if strategy in allowed and units not in seen:
            seen.add(units)
            out.append(_Cand(strategy, units))

    if legacy is not None:
        units = tuple((s.nodes, s.start_layer, s.end_layer) for s in legacy.stages)
        seen.add(units)
        out.append(_Cand(legacy.strategy, units, legacy))
    by_speed = sorted(ids, key=lambda i: (cx.spb(i), -cx.by_id[i].memory_budget, i))
    if "single" in allowed:
        for i in ids:
            add([(i,)])
    if "pipeline" in allowed and N >= 2 and n >= 2:
        if N <= EXACT_SUBSET_NODES:
            subsets = [c for k in range(2, min(N, n) + 1) for c in itertools.combinations(ids, k)]
        else:
            subsets = [tuple(base[:k]) for k in range(2, min(N, n) + 1) for base in (ids, by_speed)]
        split_need = cx.costs.stage(0, n) + cx.costs.tied
        for subset in subsets:
            members = [cx.by_id[i] for i in subset]
            if sum(x.memory_budget for x in members) < split_need:
                continue
            orders: list[Sequence[str]] = []
            if len(subset) <= 3:
                orders = list(itertools.permutations(subset))
            else:
                found = _order(cx.costs, members)
                if found is not None:
                    orders.append([x.node_id for x in found])
                fastest = sorted(subset, key=by_speed.index)
                orders += [fastest, fastest[::-1]]
            for order in orders:
                add([(i,) for i in order])
    grouped = allowed & {"tensor", "hybrid"}
    if not grouped or not supports_tensor(cx.p) or N < 2:
        return out
    sizes = {g for g in range(2, N + 1) if group_size_problem(cx.p, g) is None}
    if not sizes:
        return out
    if "tensor" in allowed:
        for g in sorted(sizes):
            combos = (itertools.combinations(ids, g) if N <= EXACT_SUBSET_NODES
                      else [tuple(ids[:g]), tuple(sorted(by_speed[:g], key=ids.index))])
            for combo in combos:
                add([combo])
    if "hybrid" in allowed and N >= 3 and n >= 2:
        if N <= EXACT_GROUP_NODES:
            for k in range(3, N + 1):
                for subset in itertools.combinations(ids, k):
                    for blocks in _partitions(subset, sizes | {1}):
                        if len(blocks) < 2 or all(len(b) == 1 for b in blocks) or len(blocks) > n:
                            continue
                        for order in itertools.permutations(blocks):
                            add(order)
        else:  # beyond the exact search: consecutive chunks of g of the nodes by budget and by speed
            for g in sorted(sizes):
                if g >= N:
                    continue
                for base in (ids, by_speed):
                    blocks = [tuple(base[i:i + g]) for i in range(0, N - N % g, g)]
                    blocks += [(x,) for x in base[N - N % g:]]
                    blocks = [b for blk in blocks for b in ([blk] if cx.group_ok(blk) else [(x,) for x in blk])]
                    if len(blocks) >= 2 and any(len(b) > 1 for b in blocks):
                        add(blocks)
                        add(blocks[::-1])
    return out


def _grouped_problems(cx: _Cx, ranked: list[NodeSpec], strategy: str) -> list[str]:
    """Why no tensor (or hybrid) plan: one sentence per obstacle."""
    p, N, n = cx.p, len(ranked), cx.n
    family = tensor_parallel_problem(p)
    if family:
        return [family if strategy == "tensor" else family.replace("tensor:", "hybrid:", 1)]
    ids = [x.node_id for x in ranked]
    if strategy == "hybrid":
        if N < 3:
            return [f"hybrid: needs at least three nodes (a tensor group and another stage); there are {N}"]
        if n < 2:
            return [f"hybrid: needs at least two layers; model {p.name!r} has {n}"]
        sizes = [g for g in range(2, N) if group_size_problem(p, g) is None]
        if not sizes:
            return [f"hybrid: no group size from 2 to {N - 1} is possible: "
                    + "; ".join(group_size_problem(p, g) or "" for g in range(2, N)).replace("tensor: ", "")]
        moe = (f" ({p.name!r} is a mixture of experts: its groups need links under {_us(cx.fast_rtt)} RTT)"
               if cx.moe else "")
        return [f"hybrid: no pipeline of tensor groups of {', '.join(map(str, sizes))} nodes fits the nodes' "
                f"memory {_context(cx.ctx, p.kv_requests)}{moe}"]
    if N < 2:
        return [f"tensor: needs at least two nodes; there is only {ids[0]}"]
    out = []
    for g in range(2, N + 1):
        problem = group_size_problem(p, g)
        if problem:
            out.append(problem)
            continue
        if cx.moe and not any(cx.fast(c) for c in itertools.combinations(ids, g)):
            out.append(f"tensor over {g} nodes: {p.name!r} is a mixture of experts and no {g} nodes are joined by "
                       f"links under {_us(cx.fast_rtt)} RTT")
            continue
        need, weakest = cx.mem(0, n, g), ranked[g - 1]
        if need > weakest.memory_budget:
            out.append(f"tensor over {g} nodes: each member needs {human_bytes(need)} "
                       f"{_context(cx.ctx, p.kv_requests)}; the "
                       f"{g} largest budgets include {weakest.node_id} with {human_bytes(weakest.memory_budget)} "
                       f"(short by {human_bytes(need - weakest.memory_budget)})")
        else:
            out.append(f"tensor over {g} nodes: no group of {g} fits")
    return out


def plan(
    profile: ModelProfile,
    nodes: Sequence[NodeSpec],
    *,
    max_context: int,
    strategy: str | None = None,
    preferred: Sequence[str] = (),
    links: Mapping[tuple[str, str], LinkSpec] | None = None,
    link_latency_s: float | None = None,
    fast_rtt_s: float = FAST_RTT_S,
    held: Mapping[str, frozenset[int]] | None = None,
    requests: int = 1,
) -> Plan:
    """The placement of ``profile`` on ``nodes`` with the least estimated time per token that fits
    ``max_context`` tokens of KV cache. ``strategy`` forces one of :data:`STRATEGIES`. Ties go to
    the memory-driven plan (the fewest nodes; ``preferred`` node ids, the current plan's in stage
    order, win among equally small ones). ``links`` maps (a, b) to a measured :class:`LinkSpec`
    (either order; a missing pair is assumed :data:`DEFAULT_LINK`); ``link_latency_s`` replaces
    every link's one-way latency (benchmarks that inject latency per message). ``held`` maps node
    ids to the layers their disks hold: after ``preferred``, nodes holding layers are preferred,
    in the order of the first layer they hold, so stages land where their bytes already are and
    the least is fetched (:func:`bytes_to_fetch`). ``requests``: how many requests each stage holds
    KV cache for at once (:meth:`ModelProfile.for_requests`)."""
    if requests != profile.kv_requests:
        profile = profile.for_requests(requests)
    if strategy is not None and strategy not in STRATEGIES:
        raise PlanError([f"unknown strategy {strategy!r}; this planner knows {', '.join(STRATEGIES)}"])
    if not nodes:
        raise PlanError(["no nodes to place the model on"])
    ids = [x.node_id for x in nodes]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise PlanError([f"duplicate node ids: {', '.join(dup)}"])
    bad = sorted(x.node_id for x in nodes if not x.memory_budget > 0)
    if bad:
        raise PlanError([f"nodes without a positive memory budget: {', '.join(bad)}"])
    if profile.num_layers <= 0:
        raise PlanError([f"model {profile.name!r} has no layers"])
    if max_context <= 0:
        raise PlanError([f"max_context must be positive, not {max_context}"])

    cx = _Cx(profile, nodes, max_context, links, link_latency_s, fast_rtt_s)
    ranked = sorted(nodes, key=lambda x: (-x.memory_budget, x.node_id))
    pref: dict[str, int] = {}
    for node_id in preferred:
        if node_id in ids and node_id not in pref:
            pref[node_id] = len(pref)
    holds = {n: frozenset((held or {}).get(n, ())) for n in ids}
    holders = [n for n in ids if holds[n]] if len(set(holds.values())) > 1 else []  # all alike: no preference
    budget = {x.node_id: x.memory_budget for x in nodes}
    for node_id in sorted(holders, key=lambda n: (min(holds[n]), -len(holds[n]), -budget[n], n)):
        if node_id not in pref:
            pref[node_id] = len(pref)
    allowed = set(STRATEGIES) if strategy is None else {strategy}
    if profile.split_problem:  # layers cannot be cut into stages: one node, or a tensor group over all layers
        if strategy in ("pipeline", "hybrid"):
            raise PlanError([f"{strategy}: {profile.split_problem}"])
        allowed -= {"pipeline", "hybrid"}
    legacy = None
    if allowed & {"single", "pipeline"}:
        legacy = _memory_plan(profile, cx.costs, ranked, ids, max_context,
                              "single" if "pipeline" not in allowed else strategy, pref)
    cands = _enumerate(cx, ranked, allowed, legacy)
    if not cands:
        if strategy in ("tensor", "hybrid"):
            raise PlanError(_grouped_problems(cx, ranked, strategy))
        if profile.split_problem:
            need, largest = cx.costs.stage(0, profile.num_layers), ranked[0]
            reasons = [f"it cannot be split across nodes ({profile.split_problem}), and no single node holds its "
                       f"{human_bytes(need)} {_context(max_context, profile.kv_requests)}: the largest, "
                       f"{largest.node_id}, offers {human_bytes(largest.memory_budget)}"]
        else:
            reasons = _why_not(profile, cx.costs, ranked, max_context, strategy)
        if strategy is None and supports_tensor(profile) and any(
                group_size_problem(profile, g) is None for g in range(2, len(ranked) + 1)):
            reasons += _grouped_problems(cx, ranked, "tensor")
        raise PlanError(reasons)
    estimates = [cx.estimate(c.units) for c in cands]
    low = min(estimates)
    pick = next(i for i, t in enumerate(estimates) if t <= low * (1 + _TIE))
    chosen, est = cands[pick], estimates[pick]
    alternatives = _alternatives(cx, ranked, cands, estimates, pick, allowed)
    reason = _why_chosen(cx, chosen, est, alternatives)
    if chosen.legacy is not None:
        return replace(chosen.legacy, reason=reason, estimate_s=est, alternatives=alternatives)
    stages = tuple(Stage(s, e, ids_, cx.mem(s, e, len(ids_))) for ids_, s, e in chosen.units)
    return Plan(model=profile.name, strategy=chosen.strategy, stages=stages, reason=reason,
                max_context=max_context, estimate_s=est, alternatives=alternatives)


def _alternatives(cx: _Cx, ranked, cands: list[_Cand], estimates: list[float], pick: int,
                  allowed: set[str]) -> tuple[dict, ...]:
    """The best plan of every other strategy (or why it has none), and the runner-up of the chosen one."""
    chosen, est = cands[pick], estimates[pick]
    out = []
    for strategy in STRATEGIES:
        idx = [i for i, c in enumerate(cands) if c.strategy == strategy and i != pick]
        if idx:
            i = min(idx, key=lambda j: (estimates[j], j))
            units, t = cands[i].units, estimates[i]
            memory = {node: cx.mem(s, e, len(ids_)) for ids_, s, e in units for node in ids_}
            why = (f"slower: {_tps(t)} vs {_tps(est)}" if t > est * (1 + _TIE)
                   else "as fast by the estimate; the chosen one came first (fewer nodes, current plan, budgets)")
            out.append({"strategy": strategy, "stages": _summary(units), "estimate_s": t,
                        "tokens_per_s": 1.0 / t if t > 0 else 0.0, "memory": memory, "feasible": True,
                        "why": why})
        elif strategy != chosen.strategy:
            if strategy not in allowed:
                why = "not considered: another strategy was forced"
            elif strategy == "single":
                why = _why_not(cx.p, cx.costs, ranked, cx.ctx, "single")[0]
            elif strategy == "pipeline":
                why = "; ".join(_why_not(cx.p, cx.costs, ranked, cx.ctx, "pipeline"))
            else:
                why = "; ".join(_grouped_problems(cx, ranked, strategy))
            out.append({"strategy": strategy, "stages": "", "estimate_s": None, "tokens_per_s": None,
                        "memory": {}, "feasible": False, "why": why})
    return tuple(out)


def _why_chosen(cx: _Cx, chosen: _Cand, est: float, alternatives: tuple[dict, ...]) -> str:
    rivals = [f"{a['strategy']} {_tps(a['estimate_s'])}" for a in alternatives
              if a["feasible"] and a["strategy"] != chosen.strategy]
    versus = f" vs {', '.join(rivals)}" if rivals else ""
    notes = []
    grouped = [ids for ids, _, _ in chosen.units if len(ids) > 1]
    for ids in grouped:
        one_way, bw = cx.worst(ids)
        notes.append(f"group {'+'.join(ids)} link {_us(2 * one_way)} RTT, {bw / 1e6:.0f} MB/s")
    unknown = cx.unknown_links(chosen.units)
    if unknown and cx.lat is None:
        notes.append(f"unmeasured link{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} assumed "
                     f"{_us(DEFAULT_LINK.rtt_s)} RTT, {DEFAULT_LINK.bandwidth_Bps / 1e6:.0f} MB/s")
    if cx.lat is not None:
        notes.append(f"link latency set to {_us(cx.lat)} one way")
    tail = "".join(f"; {x}" for x in notes)
    if chosen.legacy is not None:
        return f"{chosen.legacy.reason}; est. {_tps(est)}{versus}{tail}"
    return f"{chosen.strategy} over {_summary(chosen.units)}: {_tps(est)} est.{versus}{tail}"


def bytes_to_fetch(profile: ModelProfile, plan_: Plan, held: Mapping[str, frozenset[int]]) -> dict[str, int]:
    """Layer weight bytes each node of ``plan_`` lacks on disk (what it must fetch first)."""
    out: dict[str, int] = {}
    for st in plan_.stages:
        for node_id in st.nodes:
            have = held.get(node_id, frozenset())
            out[node_id] = out.get(node_id, 0) + sum(profile.layer_bytes[i] for i in range(st.start_layer,
                                                                                           st.end_layer)
                                                     if i not in have)
    return out


def estimate(
    profile: ModelProfile,
    nodes: Sequence[NodeSpec],
    stages: Sequence[Stage],
    *,
    max_context: int,
    links: Mapping[tuple[str, str], LinkSpec] | None = None,
    fast_rtt_s: float = FAST_RTT_S,
) -> float:
    """Seconds per decoded token of an existing placement under today's figures (the same model
    :func:`plan` uses), so a current plan and a new one can be compared fairly. ``inf`` when a
    stage names a node not in ``nodes``."""
    known = {x.node_id for x in nodes}
    if any(n not in known for s in stages for n in s.nodes):
        return float("inf")
    cx = _Cx(profile, nodes, max_context, links, None, fast_rtt_s)
    return cx.estimate(tuple((tuple(s.nodes), s.start_layer, s.end_layer) for s in stages))


def crossover_latency(
    profile: ModelProfile,
    nodes: Sequence[NodeSpec],
    *,
    max_context: int,
    links: Mapping[tuple[str, str], LinkSpec] | None = None,
    fast_rtt_s: float = FAST_RTT_S,
) -> float:
    """The one-way per-message latency (every link's, as ``plan(link_latency_s=...)`` sets it) at
    which plans with tensor groups (tensor, hybrid) stop beating those without (single, pipeline):
    below it :func:`plan` picks a grouped plan, above it not. 0.0 when grouped plans never win (or
    none fits); ``inf`` when nothing else fits. Every estimate is linear in that latency, so this is
    where the lower envelopes of the two families of lines meet."""
    plain = _enumerate_for(profile, nodes, max_context, links, fast_rtt_s, {"single", "pipeline"})
    grouped = _enumerate_for(profile, nodes, max_context, links, fast_rtt_s, {"tensor", "hybrid"})
    if not grouped:
        return 0.0
    if not plain:
        return fast_rtt_s / 2 if profile.num_experts else float("inf")

    def envelope(lines, lam):
        return min(a + b * lam for a, b in lines)

    if envelope(grouped, 0.0) >= envelope(plain, 0.0):
        return 0.0
    points = sorted({(ao - at) / (bt - bo) for at, bt in grouped for ao, bo in plain
                     if bt != bo and (ao - at) / (bt - bo) > 0})
    cross = next((lam for lam in points
                  if envelope(grouped, lam) >= envelope(plain, lam) - 1e-12 * max(1.0, envelope(plain, lam))),
                 float("inf"))
    return min(cross, fast_rtt_s / 2) if profile.num_experts else cross


def _enumerate_for(profile, nodes, max_context, links, fast_rtt_s, allowed) -> list[tuple[float, float]]:
    """(a, b) of estimate = a + b * one-way latency for every candidate of these strategies."""
    at0 = _Cx(profile, nodes, max_context, links, 0.0, fast_rtt_s)  # all links fast: MoE groups allowed
    at1 = _Cx(profile, nodes, max_context, links, 1.0, fast_rtt_s)
    ranked = sorted(nodes, key=lambda x: (-x.memory_budget, x.node_id))
    ids = [x.node_id for x in nodes]
    legacy = None
    if allowed & {"single", "pipeline"}:
        legacy = _memory_plan(profile, at0.costs, ranked, ids, max_context, None, {})
    out = []
    for c in _enumerate(at0, ranked, allowed, legacy):
        if c.strategy in allowed:
            a = at0.estimate(c.units)
            out.append((a, at1.estimate(c.units) - a))
    return out
