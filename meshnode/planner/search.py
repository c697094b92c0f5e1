"""The search over strategies: every candidate placement estimated; the least wins, explained with
its alternatives."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from meshnode.ids import NodeId
from meshnode.planner.cost import (
    DEFAULT_LINK,
    FAST_RTT_S,
    CostModel,
    Units,
    group_size_problem,
    kind_of,
    supports_tensor,
    tensor_parallel_problem,
    tps_text,
    units_summary,
    us_text,
)
from meshnode.planner.memory import fitting_order, memory_plan, why_not
from meshnode.planner.plans import (
    LinkSpec,
    NodeSpec,
    Plan,
    PlanError,
    Stage,
    describe_context,
    human_bytes,
)
from meshnode.values import STRATEGIES, Strategy
from meshnode.weights.kvquant import KV_GROUP_SIZE
from meshnode.weights.profile import ModelProfile

EXACT_SUBSET_NODES = 5  # every subset (pipelines, tensor groups) up to here; every pair and a few natural ones beyond
EXACT_GROUP_NODES = 4  # every partition into groups (hybrid) up to here; chunked orders beyond
_TIE = 1e-9  # estimates this close (relative) are equal: the earlier candidate wins


@dataclass(frozen=True)
class _Cand:
    strategy: Strategy
    units: Units
    by_memory: Plan | None = None  # the memory-driven plan (memory_plan), kept whole with its reason


def _partitions(items: Sequence[NodeId], sizes: set[int]) -> Iterator[list[tuple[NodeId, ...]]]:
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


def _enumerate(cx: CostModel, ranked: list[NodeSpec], allowed: set[Strategy], by_memory: Plan | None) -> list[_Cand]:
    """Every candidate placement, the memory-driven plan first (it wins ties)."""
    n, N = cx.n, len(ranked)
    ids = [x.node_id for x in ranked]  # by budget, largest first, then id
    out: list[_Cand] = []
    seen: set[Units] = set()  # placements (units) listed
    tried: set[tuple[tuple[NodeId, ...], ...]] = set()  # group sequences split

    def add(groups: Sequence[Sequence[NodeId]], by_memory_plan: Plan | None = None) -> None:
        key = tuple(tuple(g) for g in groups)
        if key in tried or not all(cx.group_ok(g) for g in key):
            return
        tried.add(key)
        edges = cx.split(key)
        if edges is None:
            return
        units = tuple((g, edges[i], edges[i + 1]) for i, g in enumerate(key))
        strategy = kind_of(units)
        if strategy in allowed and units not in seen:
            seen.add(units)
            out.append(_Cand(strategy, units))

    if by_memory is not None:
        units = tuple((s.nodes, s.start_layer, s.end_layer) for s in by_memory.stages)
        seen.add(units)
        out.append(_Cand(kind_of(units), units, by_memory))
    by_speed = sorted(ids, key=lambda i: (cx.spb(i), -cx.by_id[i].memory_budget, i))
    if "single" in allowed:
        for i in ids:
            add([(i,)])
    if "pipeline" in allowed and N >= 2 and n >= 2:
        if N <= EXACT_SUBSET_NODES:
            subsets = [c for k in range(2, min(N, n) + 1) for c in itertools.combinations(ids, k)]
        else:  # every pair, and the first k by budget, by speed and by their links
            by_link = sorted(ids, key=lambda i: (statistics.median(cx.hop(i, j)[0] for j in ids if j != i), i))
            subsets = list(itertools.combinations(ids, 2))
            subsets += [tuple(base[:k]) for k in range(3, min(N, n) + 1) for base in (ids, by_speed, by_link)]
        split_need = cx.costs.stage(0, n) + cx.costs.tied
        for subset in subsets:
            members = [cx.by_id[i] for i in subset]
            if sum(x.memory_budget for x in members) < split_need:
                continue
            orders: list[Sequence[NodeId]] = []
            if len(subset) <= 3:
                orders = list(itertools.permutations(subset))
            else:
                found = fitting_order(cx.costs, members)
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
            combos = (
                itertools.combinations(ids, g)
                if N <= EXACT_SUBSET_NODES
                else [tuple(ids[:g]), tuple(sorted(by_speed[:g], key=ids.index))]
            )
            for combo in combos:
                add([combo])
    if "hybrid" in allowed and N >= 3 and n >= 2:
        if N <= EXACT_GROUP_NODES:
            for k in range(3, N + 1):
                for subset in itertools.combinations(ids, k):
                    for blocks in _partitions(subset, sizes | {1}):
                        if len(blocks) < 2 or all(len(b) == 1 for b in blocks) or len(blocks) > n:
                            continue
                        for grouping in itertools.permutations(blocks):
                            add(grouping)
        else:  # beyond the exact search: consecutive chunks of g of the nodes by budget and by speed
            for g in sorted(sizes):
                if g >= N:
                    continue
                for base in (ids, by_speed):
                    blocks = [tuple(base[i : i + g]) for i in range(0, N - N % g, g)]
                    blocks += [(x,) for x in base[N - N % g :]]
                    blocks = [b for blk in blocks for b in ([blk] if cx.group_ok(blk) else [(x,) for x in blk])]
                    if len(blocks) >= 2 and any(len(b) > 1 for b in blocks):
                        add(blocks)
                        add(blocks[::-1])
    return out


def _grouped_problems(cx: CostModel, ranked: list[NodeSpec], strategy: Strategy) -> list[str]:
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
            return [
                f"hybrid: no group size from 2 to {N - 1} is possible: "
                + "; ".join(group_size_problem(p, g) or "" for g in range(2, N)).replace("tensor: ", "")
            ]
        moe = (
            f" ({p.name!r} is a mixture of experts: its groups need links under {us_text(cx.fast_rtt)} RTT)"
            if cx.moe
            else ""
        )
        return [
            f"hybrid: no pipeline of tensor groups of {', '.join(map(str, sizes))} nodes fits the nodes' "
            f"memory {describe_context(cx.ctx, p.kv_requests, p.kv_bits)}{moe}"
        ]
    if N < 2:
        return [f"tensor: needs at least two nodes; there is only {ids[0]}"]
    out = []
    for g in range(2, N + 1):
        problem = group_size_problem(p, g)
        if problem:
            out.append(problem)
            continue
        if cx.moe and not any(cx.fast(c) for c in itertools.combinations(ids, g)):
            out.append(
                f"tensor over {g} nodes: {p.name!r} is a mixture of experts and no {g} nodes are joined by "
                f"links under {us_text(cx.fast_rtt)} RTT"
            )
            continue
        need, weakest = cx.mem(0, n, g), ranked[g - 1]
        if need > weakest.memory_budget:
            out.append(
                f"tensor over {g} nodes: each member needs {human_bytes(need)} "
                f"{describe_context(cx.ctx, p.kv_requests, p.kv_bits)}; the "
                f"{g} largest budgets include {weakest.node_id} with {human_bytes(weakest.memory_budget)} "
                f"(short by {human_bytes(need - weakest.memory_budget)})"
            )
        else:
            out.append(f"tensor over {g} nodes: no group of {g} fits")
    return out


def plan(
    profile: ModelProfile,
    nodes: Sequence[NodeSpec],
    *,
    max_context: int,
    strategy: Strategy | None = None,
    preferred: Sequence[str] = (),
    links: Mapping[tuple[str, str], LinkSpec] | None = None,
    link_latency_s: float | None = None,
    fast_rtt_s: float = FAST_RTT_S,
    held: Mapping[str, frozenset[int]] | None = None,
    requests: int = 1,
    kv_bits: int = 0,
    grouped: bool = True,
) -> Plan:
    """The placement with the least estimated time per token for ``max_context`` tokens of KV.
    ``preferred``: the current plan's nodes; ``held``: each node's layers on disk, so stages land
    where their bytes are; ``grouped`` False: no tensor group (one forms and loads every layer on
    each member before it serves, too slow to resume on after a loss)."""
    if requests != profile.kv_requests:
        profile = profile.for_requests(requests)
    if kv_bits != profile.kv_bits:
        profile = profile.for_kv_bits(kv_bits)
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

    cx = CostModel(profile, nodes, max_context, links, link_latency_s, fast_rtt_s)
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
    if not grouped:
        allowed -= {"tensor", "hybrid"}
    if profile.split_problem:  # no stages: one node, or a tensor group over all layers
        if strategy in ("pipeline", "hybrid"):
            raise PlanError([f"{strategy}: {profile.split_problem}"])
        allowed -= {"pipeline", "hybrid"}
    by_memory = None
    if allowed & {"single", "pipeline"}:
        by_memory = memory_plan(
            profile, cx.costs, ranked, ids, max_context, "single" if "pipeline" not in allowed else strategy, pref
        )
    cands = _enumerate(cx, ranked, allowed, by_memory)
    if not cands:
        if strategy in ("tensor", "hybrid"):
            raise PlanError(_grouped_problems(cx, ranked, strategy))
        if profile.split_problem:
            need, largest = cx.costs.stage(0, profile.num_layers), ranked[0]
            reasons = [
                f"it cannot be split across nodes ({profile.split_problem}), and no single node holds its "
                f"{human_bytes(need)} {describe_context(max_context, profile.kv_requests, profile.kv_bits)}: "
                f"the largest, "
                f"{largest.node_id}, offers {human_bytes(largest.memory_budget)}"
            ]
        else:
            reasons = why_not(profile, cx.costs, ranked, max_context, strategy)
        if (
            strategy is None
            and not profile.kv_bits
            and supports_tensor(profile)
            and any(group_size_problem(profile, g) is None for g in range(2, len(ranked) + 1))
        ):
            reasons += _grouped_problems(cx, ranked, "tensor")
        raise PlanError(reasons)
    estimates = [cx.estimate(c.units) for c in cands]
    low = min(estimates)
    pick = next(i for i, t in enumerate(estimates) if t <= low * (1 + _TIE))
    chosen, est = cands[pick], estimates[pick]
    alternatives = _alternatives(cx, ranked, cands, estimates, pick, allowed)
    reason = (
        _why_chosen(cx, chosen, est, alternatives)
        + kv_note(profile, kv_bits)
        + (f"; {profile.weights_note}" if profile.weights_note else "")
    )
    if chosen.by_memory is not None:
        return replace(
            chosen.by_memory, reason=reason, estimate_s=est, alternatives=alternatives, kv_bits=profile.kv_bits
        )
    stages = tuple(Stage(s, e, ids_, cx.mem(s, e, len(ids_))) for ids_, s, e in chosen.units)
    return Plan(
        model=profile.name,
        strategy=chosen.strategy,
        stages=stages,
        reason=reason,
        max_context=max_context,
        estimate_s=est,
        alternatives=alternatives,
        kv_bits=profile.kv_bits,
    )


def kv_note(profile: ModelProfile, asked: int) -> str:
    """What the plan's reason says of a quantized KV cache ("" when none was asked for)."""
    if profile.kv_bits:
        n = profile.num_layers
        plain = sum(profile.kv_bytes_per_token[i] for i in range(n)) * profile.kv_requests
        quant = sum(profile.kv_token_bytes(i) for i in range(n)) * profile.kv_requests
        return (
            f"; KV cache quantized to {profile.kv_bits} bits in groups of {KV_GROUP_SIZE} (mlx-lm's "
            f"QuantizedKVCache): {human_bytes(quant)} per token instead of {human_bytes(plain)}"
        )
    if asked:
        return f"; KV cache not quantized: {profile.kv_quant_problem}"
    return ""


def _alternatives(
    cx: CostModel, ranked: list[NodeSpec], cands: list[_Cand], estimates: list[float], pick: int, allowed: set[Strategy]
) -> tuple[dict[str, Any], ...]:
    """Each other strategy's best plan (or why none), and the chosen one's runner-up."""
    chosen, est = cands[pick], estimates[pick]
    out = []
    for strategy in STRATEGIES:
        idx = [i for i, c in enumerate(cands) if c.strategy == strategy and i != pick]
        if idx:
            i = min(idx, key=lambda j: (estimates[j], j))
            units, t = cands[i].units, estimates[i]
            memory = {node: cx.mem(s, e, len(ids_)) for ids_, s, e in units for node in ids_}
            why = (
                f"slower: {tps_text(t)} vs {tps_text(est)}"
                if t > est * (1 + _TIE)
                else "as fast by the estimate; the chosen one came first (fewer nodes, current plan, budgets)"
            )
            out.append(
                {
                    "strategy": strategy,
                    "stages": units_summary(units),
                    "estimate_s": t,
                    "tokens_per_s": 1.0 / t if t > 0 else 0.0,
                    "memory": memory,
                    "feasible": True,
                    "why": why,
                }
            )
        elif strategy != chosen.strategy:
            if strategy not in allowed:
                why = "not considered: another strategy was forced"
            elif strategy == "single":
                why = why_not(cx.p, cx.costs, ranked, cx.ctx, "single")[0]
            elif strategy == "pipeline":
                why = "; ".join(why_not(cx.p, cx.costs, ranked, cx.ctx, "pipeline"))
            else:
                why = "; ".join(_grouped_problems(cx, ranked, strategy))
            out.append(
                {
                    "strategy": strategy,
                    "stages": "",
                    "estimate_s": None,
                    "tokens_per_s": None,
                    "memory": {},
                    "feasible": False,
                    "why": why,
                }
            )
    return tuple(out)


def _why_chosen(cx: CostModel, chosen: _Cand, est: float, alternatives: tuple[dict[str, Any], ...]) -> str:
    rivals = [
        f"{a['strategy']} {tps_text(a['estimate_s'])}"
        for a in alternatives
        if a["feasible"] and a["strategy"] != chosen.strategy
    ]
    versus = f" vs {', '.join(rivals)}" if rivals else ""
    notes = []
    grouped = [ids for ids, _, _ in chosen.units if len(ids) > 1]
    for ids in grouped:
        one_way, bw = cx.worst(ids)
        notes.append(f"group {'+'.join(ids)} link {us_text(2 * one_way)} RTT at p95, {bw / 1e6:.0f} MB/s")
    unknown = cx.unknown_links(chosen.units)
    if unknown and cx.lat is None:
        notes.append(
            f"unmeasured link{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} assumed "
            f"{us_text(DEFAULT_LINK.rtt_s)} RTT, {DEFAULT_LINK.bandwidth_Bps / 1e6:.0f} MB/s"
        )
    if cx.lat is not None:
        notes.append(f"link latency set to {us_text(cx.lat)} one way")
    tail = "".join(f"; {x}" for x in notes)
    if chosen.by_memory is not None:
        return f"{chosen.by_memory.reason}; est. {tps_text(est)}{versus}{tail}"
    return f"{chosen.strategy} over {units_summary(chosen.units)}: {tps_text(est)} est.{versus}{tail}"


def bytes_to_fetch(profile: ModelProfile, plan_: Plan, held: Mapping[str, frozenset[int]]) -> dict[str, int]:
    """Layer weight bytes each node of ``plan_`` lacks on disk (what it must fetch first)."""
    out: dict[str, int] = {}
    for st in plan_.stages:
        for node_id in st.nodes:
            have = held.get(node_id, frozenset())
            out[node_id] = out.get(node_id, 0) + sum(
                profile.layer_bytes[i] for i in range(st.start_layer, st.end_layer) if i not in have
            )
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
    """Seconds per decoded token of a placement by today's figures (``inf``: a node is missing)."""
    known = {x.node_id for x in nodes}
    if any(n not in known for s in stages for n in s.nodes):
        return float("inf")
    cx = CostModel(profile, nodes, max_context, links, None, fast_rtt_s)
    return cx.estimate(tuple((tuple(s.nodes), s.start_layer, s.end_layer) for s in stages))


def crossover_latency(
    profile: ModelProfile,
    nodes: Sequence[NodeSpec],
    *,
    max_context: int,
    links: Mapping[tuple[str, str], LinkSpec] | None = None,
    fast_rtt_s: float = FAST_RTT_S,
) -> float:
    """The one-way latency above which tensor-group plans stop beating the others (where the two
    families' lower envelopes meet). 0.0: groups never win; ``inf``: nothing else fits."""
    plain = _enumerate_for(profile, nodes, max_context, links, fast_rtt_s, {"single", "pipeline"})
    grouped = _enumerate_for(profile, nodes, max_context, links, fast_rtt_s, {"tensor", "hybrid"})
    if not grouped:
        return 0.0
    if not plain:
        return fast_rtt_s / 2 if profile.num_experts else float("inf")

    def envelope(lines: list[tuple[float, float]], lam: float) -> float:
        return min(a + b * lam for a, b in lines)

    if envelope(grouped, 0.0) >= envelope(plain, 0.0):
        return 0.0
    points = sorted(
        {(ao - at) / (bt - bo) for at, bt in grouped for ao, bo in plain if bt != bo and (ao - at) / (bt - bo) > 0}
    )
    cross = next(
        (
            lam
            for lam in points
            if envelope(grouped, lam) >= envelope(plain, lam) - 1e-12 * max(1.0, envelope(plain, lam))
        ),
        float("inf"),
    )
    return min(cross, fast_rtt_s / 2) if profile.num_experts else cross


def _enumerate_for(
    profile: ModelProfile,
    nodes: Sequence[NodeSpec],
    max_context: int,
    links: Mapping[tuple[str, str], LinkSpec] | None,
    fast_rtt_s: float,
    allowed: set[Strategy],
) -> list[tuple[float, float]]:
    """(a, b) of estimate = a + b * one-way latency for every candidate of these strategies."""
    at0 = CostModel(profile, nodes, max_context, links, 0.0, fast_rtt_s)  # all links fast: MoE groups allowed
    at1 = CostModel(profile, nodes, max_context, links, 1.0, fast_rtt_s)
    ranked = sorted(nodes, key=lambda x: (-x.memory_budget, x.node_id))
    ids = [x.node_id for x in nodes]
    piped = allowed & {"single", "pipeline"}
    by_memory = memory_plan(profile, at0.costs, ranked, ids, max_context, None, {}) if piped else None
    estimates = [(at0.estimate(c.units), c) for c in _enumerate(at0, ranked, allowed, by_memory)]
    return [(a, at1.estimate(c.units) - a) for a, c in estimates if c.strategy in allowed]
