"""The planner: which nodes hold which layers. Pure: no I/O, no clock, no randomness.

From the model's profile, the live nodes, the links and the context it makes the :class:`Plan` with
the fewest seconds per token (``cost.CostModel``), or a :class:`PlanError` naming what is missing.
Ties go to the memory-driven plan: the fewest nodes that fit (each hop costs a round trip per token),
the current plan's first, contiguous layers split by memory.
"""

from meshnode.planner.cost import (
    DEFAULT_LINK,
    FAST_RTT_S,
    TENSOR_FAMILIES,
    group_size_problem,
    supports_tensor,
    tensor_parallel_problem,
)
from meshnode.planner.plans import LinkSpec, NodeSpec, Plan, PlanError, Stage, human_bytes
from meshnode.planner.search import bytes_to_fetch, crossover_latency, estimate, plan
from meshnode.values import STRATEGIES, Strategy

__all__ = [
    "DEFAULT_LINK",
    "FAST_RTT_S",
    "STRATEGIES",
    "Strategy",
    "TENSOR_FAMILIES",
    "LinkSpec",
    "NodeSpec",
    "Plan",
    "PlanError",
    "Stage",
    "bytes_to_fetch",
    "crossover_latency",
    "estimate",
    "group_size_problem",
    "human_bytes",
    "plan",
    "supports_tensor",
    "tensor_parallel_problem",
]
