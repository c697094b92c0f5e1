"""The cost model: seconds per decoded token of a placement, and which tensor groups a model allows."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from meshnode.ids import NodeId
from meshnode.planner.memory import LayerCosts, split_layers
from meshnode.planner.plans import LinkSpec, NodeSpec
from meshnode.values import Strategy
from meshnode.weights.profile import ModelProfile
from meshnode.weights.weightfiles import ITEMSIZE

# A plan as the estimates see it: each unit's node ids (several: a tensor group) and its layers [start, end).
Units = tuple[tuple[tuple[NodeId, ...], int, int], ...]
# A unit's (group size, memory budget, seconds per layer, collective seconds, slowest member's speed)
UnitSpec = tuple[int, int, float, float, float]

DEFAULT_LINK = LinkSpec(rtt_s=1e-3, bandwidth_Bps=100e6)  # an unmeasured link: a conservative LAN
DEFAULT_BYTES_PER_S = 100e9  # weight bytes/s of a compute-1.0 node (decode is memory-bound)
FAST_RTT_S = 200e-6  # a link below this RTT may carry MoE expert traffic (Thunderbolt, not TCP)
TOKEN_BYTES = 8  # the sampled token the last stage returns to the first
# Relative speed difference under which nodes split layers as equals: like machines measure a few
# percent apart, and an uneven split would leave stages waiting on the longest one.
SAME_SPEED = 0.10
# Families whose mlx-lm ``shard(group)`` needs only heads, kv heads and intermediate sizes divisible
# by the group size (checked against mlx-lm in tests/test_tensor.py).
TENSOR_FAMILIES = frozenset(
    {
        "llama",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "deepseek_v3",
        "deepseek_v32",
        "kimi_k25",
        "glm4_moe",
        "glm4_moe_lite",
        "gpt_oss",
    }
)


def tensor_parallel_problem(profile: ModelProfile) -> str | None:
    """None when mlx-lm can shard this model over a tensor group; else why not."""
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
    dims = [
        (profile.num_heads, f"{profile.num_heads} heads"),
        (profile.num_kv_heads, f"{profile.num_kv_heads} kv heads"),
        (profile.intermediate_size, f"the intermediate size {profile.intermediate_size}"),
    ]
    if profile.moe_intermediate_size:
        dims.append((profile.moe_intermediate_size, f"the expert intermediate size {profile.moe_intermediate_size}"))
    bad = [text for v, text in dims if v > 0 and v % g]
    if profile.num_heads <= 0 or profile.num_kv_heads <= 0:
        bad.append("an unknown number of heads")
    if bad:
        return f"tensor: {g} does not divide {', '.join(bad)}"
    q = profile.quant_group_size
    # A quantized layer split by its inputs (o_proj, down_proj) keeps whole quantization groups per member.
    inputs = [
        (profile.num_heads * profile.head_dim, "the attention output"),
        (profile.intermediate_size, "the intermediate size"),
        (profile.moe_intermediate_size, "the expert size"),
    ]
    split = [f"{what} {v} / {g}" for v, what in inputs if q and v and (v // g) % q]
    if split:
        return f"tensor: {', '.join(split)} is not a whole number of {q}-weight quantization groups"
    return None


def us_text(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 0.999e-3 else f"{seconds * 1e3:.3g} ms"


def tps_text(estimate: float) -> str:
    return f"{1.0 / estimate:.3g} tok/s" if estimate > 0 else "∞ tok/s"


def units_summary(units: Units) -> str:
    """'0-11@a+b | 12-23@c'."""
    return " | ".join(f"{s}-{e - 1}@{'+'.join(ids)}" for ids, s, e in units)


def kind_of(units: Units) -> Strategy:
    grouped = any(len(ids) > 1 for ids, _, _ in units)
    if len(units) == 1:
        return "tensor" if grouped else "single"
    return "hybrid" if grouped else "pipeline"


class CostModel:
    """Everything the estimates need, precomputed. A unit of g nodes on layers [s, e) costs its
    slowest member's ``s/B * bytes / g`` plus two ring all-reduces per layer, each
    ``2 (g - 1) (one-way + M / (g * bandwidth)) + collective_s``; k pipeline units add k one-way trips."""

    def __init__(
        self,
        profile: ModelProfile,
        nodes: Sequence[NodeSpec],
        max_context: int,
        links: Mapping[tuple[str, str], LinkSpec] | None,
        link_latency_s: float | None,
        fast_rtt_s: float,
    ):
        p = self.p = profile
        self.n = n = p.num_layers
        self.ctx = max_context
        self.costs = LayerCosts(p, max_context)
        self.by_id = {x.node_id: x for x in nodes}
        self.W = [0, *itertools.accumulate(p.layer_bytes)]
        self.avg = max(self.W[-1] / n, 1.0) if n else 1.0
        self.head_w = p.head_bytes or (p.embed_bytes if p.tied_embeddings else 0)
        item = ITEMSIZE.get(p.dtype, 2)
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

    def spb(self, node_id: NodeId) -> float:
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
        one_way = self.lat if self.lat is not None else spec.tail_rtt_s / 2
        return max(one_way, 0.0), max(spec.bandwidth_Bps, 1.0), known

    def hop(self, a: str, b: str) -> tuple[float, float]:
        """(seconds one way, bandwidth B/s) of a pipeline hop, RPC stack included."""
        one_way, bw, _ = self.link(a, b)
        spec = self.links.get((a, b))
        return one_way + (spec.overhead_s / 2 if spec is not None else 0.0), bw

    def worst(self, ids: Sequence[NodeId]) -> tuple[float, float]:
        pairs = [self.link(a, b) for a, b in itertools.combinations(ids, 2)]
        return max(p[0] for p in pairs), min(p[1] for p in pairs)

    def fast(self, ids: Sequence[NodeId]) -> bool:
        """Whether every link of the group is of the kind that may carry expert traffic: by its
        median, since this asks what the link is, not what its slow moments cost."""
        return all(self._median_rtt(a, b) < self.fast_rtt for a, b in itertools.combinations(ids, 2))

    def _median_rtt(self, a: str, b: str) -> float:
        if self.lat is not None:
            return 2 * self.lat
        return (self.links.get((a, b)) or DEFAULT_LINK).rtt_s

    def group_ok(self, ids: Sequence[NodeId]) -> bool:
        g = len(ids)
        return g == 1 or (group_size_problem(self.p, g) is None and (not self.moe or self.fast(ids)))

    def mem(self, s: int, e: int, g: int) -> int:
        """Bytes per member of a g-node group on layers [s, e): 1/g of the sharded weights and KV;
        norms, routers, embedding and head whole."""
        if g == 1:
            return self.costs.stage(s, e)
        ends = self.costs.stage(s, e) - (self.costs.prefix[e] - self.costs.prefix[s])
        repl = self.R[e] - self.R[s]
        sharded = self.W[e] - self.W[s] - repl
        kv = self.KV[e] - self.KV[s]
        return -(-sharded // g) + repl + -(-kv // g) + ends

    def machinery(self, ids: Sequence[NodeId]) -> float:
        """One all-reduce's own cost in this group (its slowest member's measurement)."""
        return max(self.by_id[i].collective_s or 0.0 for i in ids)

    def coll(self, ids: Sequence[NodeId]) -> float:
        """Collectives per layer per token in a group: 2 ring all-reduces of one activation."""
        g = len(ids)
        if g == 1:
            return 0.0
        one_way, bw = self.worst(ids)
        return 2 * (2 * (g - 1) * (one_way + self.msg / (g * bw)) + self.machinery(ids))

    def unit_spec(self, ids: Sequence[NodeId]) -> UnitSpec:
        slowest = max(self.spb(i) for i in ids)
        return len(ids), min(self.by_id[i].memory_budget for i in ids), slowest / len(ids), self.coll(ids), slowest

    def estimate(self, units: Units) -> float:
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

    def unknown_links(self, units: Units) -> list[str]:
        """Links the estimate of this plan assumed (unmeasured)."""
        pairs: set[tuple[str, str]] = set()
        for ids, _, _ in units:
            pairs.update(itertools.combinations(ids, 2))
        heads = [ids[0] for ids, _, _ in units]
        pairs.update(zip(heads, heads[1:]))
        if len(heads) > 1:
            pairs.add((heads[-1], heads[0]))
        return sorted(f"{a}-{b}" for a, b in pairs if not self.link(a, b)[2])

    def split(self, groups: Sequence[Sequence[NodeId]]) -> list[int] | None:
        """Layer boundaries for these units in order: least estimated time within budgets, then the
        least largest fraction of a budget; equal speeds split by memory."""
        n, k = self.n, len(groups)
        if k > n or k == 0:
            return None
        specs = _same_speeds([self.unit_spec(ids) for ids in groups])
        if all(sp[0] == 1 for sp in specs) and len({sp[2] for sp in specs}) == 1:
            return split_layers(self.costs, [sp[1] for sp in specs])
        const = len({(sp[0], sp[2], sp[3], sp[4]) for sp in specs}) == 1
        inf = (float("inf"), float("inf"))
        W, head_w = self.W, self.head_w

        def cost(i: int, s: int, e: int) -> tuple[float, float] | None:
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


def _same_speeds(specs: list[UnitSpec]) -> list[UnitSpec]:
    """``unit_spec`` tuples with speeds within SAME_SPEED of each other replaced by their mean."""
    order = sorted({sp[4] for sp in specs})
    snapped: dict[float, float] = {}
    run: list[float] = []
    for value in [*order, None]:
        if value is None or (run and value > run[0] * (1.0 + SAME_SPEED)):
            mean = sum(run) / len(run)
            snapped.update((r, mean) for r in run)
            run = []
        if value is not None:
            run.append(value)
    return [(g, budget, snapped[slowest] / g, coll, snapped[slowest]) for g, budget, _, coll, slowest in specs]
