"""The planner: which nodes hold which layers. Pure: no I/O, no clock, no randomness.

Layout: ``plans`` (the types in and out), ``memory`` (rules 1-3: the memory-driven placement),
``cost`` (the cost model below), ``search`` (the strategies, their estimates and explanations).

Input: the model's profile, the live nodes with their memory budgets and measured speed, the
links between them, the max context.
Output: a :class:`Plan`, or a :class:`PlanError` whose reasons say what is missing.

Memory rules, in order (the *memory-driven* plan):

1. The fewest nodes that fit: every hop costs a round trip per token. Exact: if any k nodes fit,
   the k largest budgets do, so the top-k are tried in every stage order (a dynamic programme
   over subsets up to ``EXACT_MAX_NODES``; beyond, a few natural orders).
2. Among those, the most nodes of ``preferred`` (the current plan's, so a re-plan reloads
   little), then the largest budgets, then node id. Stage order: preferred nodes first, then by
   budget, largest first (it holds the embedding).
3. Contiguous layers in proportion to memory, within budgets: minimise the largest fraction of a
   budget used, then sum(bytes_i**2 / budget_i). A stage's bytes are its layers' weights and KV
   cache for ``max_context`` (capped by a sliding window), the embedding on the first stage and
   the norm and head (or tied embedding) on the last.

Every candidate plan is estimated in seconds per decoded token; the least wins, the memory-driven
plan every tie (within a relative 1e-9). Strategies: ``single``, ``pipeline`` (one node per stage),
``tensor`` (one group of g >= 2 nodes, mlx-lm's ``model.shard``), ``hybrid`` (a pipeline of groups).
``strategy=`` forces one; PlanError says why it is impossible.

Cost model (decode is memory-bound, so compute scales with weight bytes):

* A node's seconds per weight byte: measured ``layer_seconds / average layer bytes``, else
  ``1 / (DEFAULT_BYTES_PER_S * compute)``.
* A unit of g nodes holding layers [s, e): the slowest member's ``s/B * bytes / g``, plus per layer
  two ring all-reduces of one activation (M bytes), each ``2 (g - 1) (one-way + M / (g * bandwidth))
  + C`` over the group's worst link, C being the measured ``collective_s``; plus rank 0 handing each
  token's input to the others. The last unit runs the head unsharded on every member.
* A pipeline of k units: k one-way trips (k - 1 hops of M bytes and the sampled token back).
* Links: unmeasured pairs get ``DEFAULT_LINK``; ``overhead_s`` (the RPC stack's round trip) adds half
  of itself to each pipeline hop; ``link_latency_s`` replaces every one-way latency. Estimates are
  linear in latency, which :func:`crossover_latency` uses.

A group member holds 1/g of its layers' weights and KV, their norms and routers whole, and the
embedding, norm and head whole. A group needs a family in :data:`TENSOR_FAMILIES` and g dividing
heads, kv heads and intermediate size; a mixture-of-experts group needs every link under
``fast_rtt_s``.

Search: exact up to ``EXACT_SUBSET_NODES`` / ``EXACT_GROUP_NODES`` nodes, top-k by budget and by
speed beyond. Speeds within ``SAME_SPEED`` count as equal when splitting, so like machines share
layers evenly.
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
