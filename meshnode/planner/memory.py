"""Memory-driven placement: the fewest nodes that hold the model (if any k nodes fit, the k largest
budgets do), their order, and the layer split. Exact dynamic programmes; pure."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from meshnode.ids import NodeId
from meshnode.planner.plans import NodeSpec, Plan, Stage, describe_context, human_bytes
from meshnode.values import Strategy
from meshnode.weights.profile import ModelProfile

EXACT_MAX_NODES = 12  # subset DP over 2**k stage orders up to here
_PREFERRED_WORK = 2**14  # subsets tried for `preferred` before settling for the largest: this / 2**k


class LayerCosts:
    """Stage sizes in O(1) from prefix sums of per-layer weights + KV."""

    def __init__(self, profile: ModelProfile, max_context: int):
        p = profile
        self.n = n = p.num_layers
        self.prefix = [0, *itertools.accumulate(p.layer_bytes[i] + p.kv_bytes(i, max_context) for i in range(n))]
        self.head = p.embed_bytes  # added when start == 0
        self.tail = p.norm_bytes + p.head_bytes + p.mtp_bytes  # added when end == n
        # the embedding the last stage needs when it does not start at 0: the tied LM head, or the MTP head's copy
        self.tied = p.embed_bytes if p.tied_embeddings else p.mtp_embed_bytes  # added when end == n and start != 0

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
        """Whether this order fits, each stage taking all it can while leaving one layer per later
        stage. Sound always; exact when no fewer nodes fit."""
        start, k = 0, len(budgets)
        for i, b in enumerate(budgets):
            end = self.reach(start, b, self.n - (k - 1 - i))
            if end == start:
                return False
            start = end
        return start == self.n


def _subset_reach(costs: LayerCosts, budgets: Sequence[int]) -> list[int]:
    """f[mask]: the furthest layer the nodes in mask cover from layer 0 in their best order, each
    holding one layer or more and leaving one per node outside mask (-1: none). The furthest reach
    loses nothing while no smaller set fits (else a node could be dropped)."""
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


def _fits(costs: LayerCosts, nodes: Sequence[NodeSpec]) -> bool:
    budgets = [x.memory_budget for x in nodes]
    if len(nodes) <= EXACT_MAX_NODES:
        return _subset_reach(costs, budgets)[-1] == costs.n
    return any(costs.greedy([x.memory_budget for x in order]) for order in _natural_orders(nodes))


def _natural_orders(nodes: Sequence[NodeSpec]) -> list[tuple[NodeSpec, ...]]:
    """Beyond the exact search: the given order, reversed, and every choice of first and last node."""
    base = tuple(nodes)
    out = [base, tuple(reversed(base))]
    for first, last in itertools.permutations(base, 2):
        out.append((first, *[x for x in base if x is not first and x is not last], last))
    return out


def fitting_order(costs: LayerCosts, nodes: Sequence[NodeSpec]) -> tuple[NodeSpec, ...] | None:
    """A fitting stage order: the given one if it fits, else one along the best subset reaches."""
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
            done[mask] = any(
                not mask & (1 << i) and done[mask | 1 << i] and f[mask] < step(mask, i) == f[mask | 1 << i]
                for i in range(k)
            )
    if not done[0]:  # cannot happen: f[full] == n is itself such a chain
        return None
    order: list[NodeSpec] = []
    mask = 0
    while mask != full:
        i = next(
            i
            for i in range(k)
            if not mask & (1 << i) and done[mask | 1 << i] and f[mask] < step(mask, i) == f[mask | 1 << i]
        )
        order.append(base[i])
        mask |= 1 << i
    return tuple(order)


def split_layers(costs: LayerCosts, budgets: Sequence[int]) -> list[int] | None:
    """Boundaries [0, b1, ..., n] minimising the largest fraction of a budget used, then
    sum(bytes**2 / budget)."""
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


def _candidates(ranked: list[NodeSpec], k: int, preferred: dict[str, int]) -> Iterator[list[NodeSpec]]:
    """k-subsets, most preferred nodes first, then the top k by budget; each in stage order."""
    top = ranked[:k]
    top_pref = sum(1 for x in top if x.node_id in preferred)
    pref_idx = [i for i, x in enumerate(ranked) if x.node_id in preferred]
    other_idx = [i for i, x in enumerate(ranked) if x.node_id not in preferred]
    tried, limit = 0, max(8, _PREFERRED_WORK >> k)
    for j in range(min(k, len(pref_idx)), top_pref, -1):
        if k - j > len(other_idx):
            continue
        combos = sorted(
            tuple(sorted(p + q))
            for p in itertools.combinations(pref_idx, j)
            for q in itertools.combinations(other_idx, k - j)
        )
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


def memory_plan(
    profile: ModelProfile,
    costs: LayerCosts,
    ranked: list[NodeSpec],
    ids: list[NodeId],
    max_context: int,
    strategy: Strategy | None,
    pref: dict[str, int],
) -> Plan | None:
    """The memory-driven plan: the fewest nodes, split by memory. It comes first among the
    candidates, so it wins every tie."""
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
            order = fitting_order(costs, subset)
            if order is None:
                continue
            edges = split_layers(costs, [x.memory_budget for x in order])
            if edges is None:  # cannot happen: the order fits
                continue
            stages = tuple(
                Stage(edges[i], edges[i + 1], (order[i].node_id,), costs.stage(edges[i], edges[i + 1]))
                for i in range(k)
            )
            return Plan(
                model=profile.name,
                strategy="single" if k == 1 else "pipeline",
                stages=stages,
                reason=_reason(profile, costs, stages, order, ranked, max_context, strategy, pref),
                max_context=max_context,
            )
    return None


def _reason(
    profile: ModelProfile,
    costs: LayerCosts,
    stages: tuple[Stage, ...],
    order: Sequence[NodeSpec],
    ranked: list[NodeSpec],
    ctx: int,
    strategy: Strategy | None,
    pref: dict[str, int],
) -> str:
    need = costs.stage(0, costs.n)
    context = describe_context(ctx, profile.kv_requests, profile.kv_bits)
    if len(stages) == 1:
        node = order[0]
        return (
            f"fits on {node.node_id} alone: {human_bytes(need)} of its {human_bytes(node.memory_budget)} "
            f"{context} (one machine beats two)"
        )
    k = len(stages)
    if strategy == "pipeline" and ranked[0].memory_budget >= need:
        why = "pipeline forced"
    elif k == 2:
        why = f"no single node holds {human_bytes(need)} {context}"
    else:
        why = f"no {k - 1} nodes hold {human_bytes(need)} {context}"
    kept = [x.node_id for x in order if x.node_id in pref]
    keep = f"; keeps {', '.join(kept)} from the current plan" if kept else ""
    parts = ", ".join(
        f"{s.nodes[0]} layers {s.start_layer}-{s.end_layer - 1} ({human_bytes(s.bytes)} of "
        f"{human_bytes(x.memory_budget)})"
        for s, x in zip(stages, order)
    )
    return f"needs {k} nodes ({why}); layers split by memory: {parts}{keep}"


def why_not(
    profile: ModelProfile, costs: LayerCosts, ranked: list[NodeSpec], ctx: int, strategy: Strategy | None
) -> list[str]:
    n = costs.n
    need = costs.stage(0, n)
    offered = sum(x.memory_budget for x in ranked)
    largest = ranked[0]
    # "the 3 nodes offer 24.0 GiB together" / "node a offers 8.0 GiB"
    offer = f"node {largest.node_id} offers" if len(ranked) == 1 else f"the {len(ranked)} nodes offer"
    together = "" if len(ranked) == 1 else " together"
    context = describe_context(ctx, profile.kv_requests, profile.kv_bits)
    if strategy == "single":
        return [
            f"strategy 'single': model needs {human_bytes(need)} {context}; the largest node ({largest.node_id}) "
            f"offers {human_bytes(largest.memory_budget)} (short by {human_bytes(need - largest.memory_budget)})"
        ]
    reasons: list[str] = []
    if strategy == "pipeline" and len(ranked) < 2:
        reasons.append(f"a pipeline needs at least two nodes; there is only {largest.node_id}")
    if strategy == "pipeline" and n < 2:
        reasons.append(f"a pipeline needs at least two layers; model {profile.name!r} has {n}")
    split_need = need + costs.tied
    if need > offered:
        reasons.append(
            f"model needs {human_bytes(need)} {context}; {offer} {human_bytes(offered)}{together} "
            f"(short by {human_bytes(need - offered)})"
        )
    elif (
        split_need > offered and len(ranked) > 1 and n > 1 and (strategy == "pipeline" or largest.memory_budget < need)
    ):
        reasons.append(
            f"model needs {human_bytes(split_need)} {context} when split over nodes (its "
            f"{'tied embedding' if profile.tied_embeddings else 'embedding, for its MTP head,'} "
            f"is held by the first and the last stage); {offer} {human_bytes(offered)}{together} "
            f"(short by {human_bytes(split_need - offered)})"
        )
    # The stage holding layer i needs at least stage(i, i + 1) (embedding, head at the ends).
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
        more = (
            ""
            if not others
            else f" (so does layer {others[0]})"
            if len(others) == 1
            else f" (so do layers {_ranges(others)})"
        )
        reasons.append(
            f"{what} alone needs {human_bytes(alone[worst])} {context}, more than any node's budget "
            f"(largest: {largest.node_id}, {human_bytes(largest.memory_budget)}){more}"
        )
    if not reasons:
        reasons.append(
            f"model needs {human_bytes(need)} {context} and {offer} {human_bytes(offered)}{together}, but "
            f"layers are placed whole and no contiguous split of its {n} layers fits their budgets "
            f"(largest: {largest.node_id}, {human_bytes(largest.memory_budget)})"
        )
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
        costs = LayerCosts(profile, c)
        need = costs.stage(0, n)
        return any(
            _fits(costs, ranked[:k])
            for k in range(1, min(len(ranked), n) + 1)
            if sum(x.memory_budget for x in ranked[:k]) >= (need if k == 1 else need + costs.tied)
        )

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
