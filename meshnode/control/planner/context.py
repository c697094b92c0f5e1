"""How much context a plan gives its model, when the setting leaves it to the mesh
(``max_context = 0``): the context the model was trained for, lowered only as far as the mesh's
memory requires. Pure: no I/O.

A KV cache grows with the context, so the longest context is tried first and halved until a plan
fits (never below :data:`FLOOR`, or the trained context if that is shorter). Agents need long
contexts (OpenCode's system prompt and tools alone are ~5k tokens; Ollama's docs ask 64k for
coding tools); the plan's reason says which context it got and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from meshnode.control.planner.plans import Plan, PlanError

FLOOR = 4096  # the least context "auto" settles for (the old fixed default)
UNKNOWN = 4096  # a model whose config names no context length


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
    """``make(max_context)`` for the longest context that fits: the setting's, or with "auto"
    (``setting`` 0) the trained context halved until a plan fits. Raises the PlanError of the
    last (shortest) context tried."""
    tries = contexts_to_try(trained, setting)
    for i, context in enumerate(tries):
        try:
            plan = make(context)
        except PlanError:
            if i == len(tries) - 1:
                raise
            continue
        if setting > 0:
            return plan
        why = (f"context {context} tokens, as the model was trained for" if context == (trained or UNKNOWN) else
               f"context {context} tokens of the {trained or UNKNOWN} the model was trained for: the longest "
               f"this mesh's memory holds")
        return replace(plan, reason=f"{plan.reason}; {why}" if plan.reason else why)
    raise AssertionError("unreachable")
