"""A plan pinned by the ``plan_layout`` setting: the stages an operator (or a benchmark) names, costed
and checked like any other, instead of the search's choice."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from meshnode.ids import NodeId
from meshnode.planner.cost import FAST_RTT_S, CostModel, group_size_problem, kind_of, tps_text, units_summary
from meshnode.planner.plans import LinkSpec, NodeSpec, Plan, PlanError, Stage, human_bytes
from meshnode.values import layout_units
from meshnode.weights.profile import ModelProfile


def pinned_plan(
    profile: ModelProfile,
    nodes: Sequence[NodeSpec],
    layout: str,
    *,
    max_context: int,
    links: Mapping[tuple[str, str], LinkSpec] | None = None,
    requests: int = 1,
    kv_bits: int = 0,
) -> Plan:
    """The plan of ``layout`` ("0-3@a | 4-7@b+c", as a plan's alternatives list their stages) on
    ``nodes``, with its estimate; PlanError where a node is missing, a stage does not fit its
    budget, a group size is impossible or the stages do not tile the model's layers."""
    if requests != profile.kv_requests:
        profile = profile.for_requests(requests)
    if kv_bits != profile.kv_bits:
        profile = profile.for_kv_bits(kv_bits)
    try:
        units = tuple((tuple(NodeId(i) for i in ids), s, e) for ids, s, e in layout_units(layout))
    except ValueError as exc:
        raise PlanError(f"plan_layout: {exc}") from None
    cx = CostModel(profile, nodes, max_context, links, None, FAST_RTT_S)
    problems = []
    edges = [0, *(e for _, _, e in units)]
    if [s for _, s, _ in units] != edges[:-1] or edges != sorted(set(edges)) or edges[-1] != cx.n:
        problems.append(f"plan_layout {layout!r} does not tile the model's {cx.n} layers")
    named = [i for ids, _, _ in units for i in ids]
    if len(set(named)) != len(named):
        problems.append(f"plan_layout {layout!r} names a node twice")
    if missing := sorted(set(named) - set(cx.by_id)):
        problems.append(f"plan_layout names {', '.join(missing)}, not among the nodes planned over")
    for ids, s, e in units if not problems else ():
        if problem := group_size_problem(profile, len(ids)):
            problems.append(problem)
        elif not cx.group_ok(ids):  # a mixture of experts' group needs fast links
            problems.append(f"group {'+'.join(ids)}: its links are too slow for {profile.name!r}'s experts")
        need = cx.mem(s, e, len(ids))
        problems += [
            f"{i} offers {human_bytes(cx.by_id[i].memory_budget)}, layers {s}-{e - 1} need {human_bytes(need)}"
            for i in ids
            if need > cx.by_id[i].memory_budget
        ]
    if problems:
        raise PlanError(problems)
    est = cx.estimate(units)
    return Plan(
        model=profile.name,
        strategy=kind_of(units),
        stages=tuple(Stage(s, e, ids, cx.mem(s, e, len(ids))) for ids, s, e in units),
        reason=f"pinned by plan_layout: {kind_of(units)} over {units_summary(units)}: {tps_text(est)} est.",
        max_context=max_context,
        estimate_s=est,
        kv_bits=profile.kv_bits,
    )
