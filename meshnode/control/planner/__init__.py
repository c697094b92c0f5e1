"""The planner: which nodes hold which layers. Pure: no I/O, no clock, no randomness.

In: the model's profile, the live nodes (memory budget, measured speed), the links, the max context.
Out: a :class:`Plan`, or a :class:`PlanError` saying what is missing. The memory-driven plan takes
the fewest nodes that fit (every hop costs a round trip per token), preferring the current plan's,
and splits contiguous layers in proportion to memory. Every candidate (``single``, ``pipeline``,
``tensor``, ``hybrid``) is estimated in seconds per decoded token (formulas: ``cost.CostModel``); the
least wins, the memory-driven plan every tie.
"""

from meshnode.control.planner.cost import (
                                           DEFAULT_LINK,
                                           FAST_RTT_S,
                                           TENSOR_FAMILIES,
                                           group_size_problem,
                                           supports_tensor,
                                           tensor_parallel_problem,
)
from meshnode.control.planner.plans import STRATEGIES, LinkSpec, NodeSpec, Plan, PlanError, Stage, human_bytes
from meshnode.control.planner.search import bytes_to_fetch, crossover_latency, estimate, plan

__all__ = ["DEFAULT_LINK", "FAST_RTT_S", "STRATEGIES", "TENSOR_FAMILIES", "LinkSpec", "NodeSpec", "Plan", "PlanError",
           "Stage", "bytes_to_fetch", "crossover_latency", "estimate", "group_size_problem", "human_bytes", "plan",
           "supports_tensor", "tensor_parallel_problem"]
