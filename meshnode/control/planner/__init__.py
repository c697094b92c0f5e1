"""The planner: which nodes hold which layers. Pure: no I/O, no clock, no randomness.

``plans`` holds the types, ``memory`` the memory-driven placement, ``cost`` the cost model,
``search`` the strategies. In: the model's profile, the live nodes (memory budget, measured speed),
the links, the max context. Out: a :class:`Plan`, or a :class:`PlanError` saying what is missing.

Memory-driven plan: (1) the fewest nodes that fit, since every hop costs a round trip per token
(if any k nodes fit, the k largest budgets do); (2) among those, the most ``preferred`` nodes (a
re-plan reloads little), then the largest budgets; the largest budget first (it holds the embedding);
(3) contiguous layers in proportion to memory, minimising the largest fraction of a budget used.
A stage's bytes are its layers' weights and KV for ``max_context``, plus embedding or head at the ends.

Every candidate (``single``, ``pipeline``, ``tensor``: one group of g >= 2 nodes via mlx-lm's
``model.shard``, ``hybrid``: a pipeline of groups) is estimated in seconds per decoded token; the
least wins, the memory-driven plan every tie. Decode is memory-bound, so compute scales with weight
bytes; a group adds two ring all-reduces per layer over its worst link; a pipeline of k units adds
k one-way trips. Estimates are linear in link latency, which :func:`crossover_latency` uses.
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
