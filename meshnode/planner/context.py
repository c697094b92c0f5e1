"""The context a plan gives its model when ``max_context = 0``: the trained one, halved only as the
mesh's memory requires (not below :data:`FLOOR`). Pure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from meshnode.planner.plans import Plan, PlanError

FLOOR = 4096  # the least context "auto" settles for
UNKNOWN = 4096  # a model whose config names no context length
# Context that serves coding agents: more only where it costs no speed.
ENOUGH = 65536
SLOWER = 1.1  # how much slower per token a longer context's plan may be


def contexts_to_try(trained: int, setting: int) -> list[int]:
    """The contexts a plan may get, longest first: the setting alone when it names one."""
    if setting > 0:
        return [setting]
    top = trained or UNKNOWN
    floor = min(FLOOR, top)
    out = [top]
    while out[-1] // 2 >= floor:
        out.append(out[-1] // 2)
    if out[-1] != floor:
        out.append(floor)
    return out


def plan_longest_context(make: Callable[[int], Plan], trained: int, setting: int) -> Plan:
    """``make(max_context)`` for the set context, or with 0 the longest that fits; from :data:`ENOUGH`
    up, the longest within :data:`SLOWER` of the fastest (more KV may need another hop). Raises the
    shortest context's PlanError."""
    tries = contexts_to_try(trained, setting)
    fits: list[tuple[int, Plan]] = []  # longest first
    for i, context in enumerate(tries):
        if fits and context < ENOUGH:
            break
        try:
            plan = make(context)
        except PlanError:
            if i == len(tries) - 1 and not fits:
                raise
            continue
        if setting > 0:
            return plan
        fits.append((context, plan))
    top = trained or UNKNOWN
    fastest = min((p.estimate_s for _, p in fits if p.estimate_s > 0), default=0.0)
    context, plan = next(((c, p) for c, p in fits if not fastest or p.estimate_s <= fastest * SLOWER), fits[0])
    longest, longest_plan = fits[0]
    if context == top:
        why = f"context {context} tokens, as the model was trained for"
    elif context == longest:
        why = f"context {context} tokens of the {top} the model was trained for: the longest this mesh's memory holds"
    else:
        why = (
            f"context {context} tokens of the {top} the model was trained for: {longest} would take "
            f"{_nodes(longest_plan)} node(s) instead of {_nodes(plan)} and about "
            f"{longest_plan.estimate_s / plan.estimate_s:.2f}x the time per token, and {ENOUGH} already serve "
            f"coding agents"
        )
    return replace(plan, reason=f"{plan.reason}; {why}" if plan.reason else why)


def _nodes(plan: Plan) -> int:
    return len(plan.node_ids())
