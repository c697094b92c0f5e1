"""The planner: which nodes hold which layers. Pure: no I/O, no clock, no randomness.

Layout: ``plans`` (the types in and out), ``memory`` (rules 1-3: the memory-driven placement),
``cost`` (the cost model below), ``search`` (the strategies, their estimates and explanations).

Input: the model's profile, the live nodes with their memory budgets and measured speed, the
links between them, the max context.
Output: a :class:`Plan`, or a :class:`PlanError` whose reasons say what is missing.

Rules, in order:

1. Use the fewest nodes that fit: one machine beats two, since every hop costs a network
   round trip per token. The search is exact: if any k nodes can hold the model, then so can
   the k nodes with the largest budgets (swap each node of a fitting placement for a larger
   one in the same position), so the least k is found by testing the top-k nodes in every
   stage order at once (a dynamic programme over subsets, exact up to ``EXACT_MAX_NODES``
   stages; beyond that a few natural orders are tried).
2. Among the subsets of that size that fit, prefer the most nodes of ``preferred`` (the
   current plan's, so that a re-plan reloads as little as possible), then the largest budgets
   (ties by node id). Stage order: the preferred nodes in their given order, then by budget,
   largest first (it holds the embedding), then node id; another order only if that one does
   not fit.
3. Split the layers contiguously in proportion to memory, never exceeding a budget: first
   minimise the largest fraction of a budget any stage uses, then, among the splits that reach
   that, minimise sum(bytes_i**2 / budget_i), whose optimum gives each node bytes in proportion
   to its budget. Both are exact dynamic programmes over the layer boundaries. A stage's bytes
   are its layers' weights, their KV cache for ``max_context`` tokens (capped by a layer's
   sliding window), the embedding on the first stage and the final norm and head on the last
   (plus the embedding again on the last when tied and it is not also the first).

Those rules give the *memory-driven* plan. Since tensor parallelism it is one candidate among
many, all estimated in seconds per decoded token; the least estimate wins, and the memory-driven
plan wins every tie (estimates within a relative 1e-9), so with equal nodes and equal links the
rules above still decide.

Strategies: ``single`` (one node), ``pipeline`` (stages of one node each), ``tensor`` (one group
of g >= 2 nodes holding every layer, mlx-lm's ``model.shard``), ``hybrid`` (a pipeline whose
stages are groups, at least one of g >= 2: e.g. 3 nodes where 3 does not divide the heads, a
pair plus a stage). ``strategy=`` forces one; PlanError says why it is impossible.

Cost model (seconds per token; decode is memory-bound, so compute scales with weight bytes):

* A node's seconds per weight byte: ``layer_seconds / average layer bytes`` when measured (one
  decode step of an average layer of this model), else ``1 / (DEFAULT_BYTES_PER_S * compute)``.
* A unit (a stage on a group of g nodes; g = 1 for a pipeline stage) holding layers [s, e):
  ``slowest member's s/B * bytes(s, e) / g`` (members run in lockstep), plus, per layer, two ring
  all-reduces of one activation (``hidden_size * dtype`` bytes = M), each
  ``2 (g - 1) (one-way + M / (g * bandwidth)) + C`` over the group's worst link (one-way = the
  network's RTT / 2), where C is what an all-reduce costs beyond the wire (``collective_s``, the
  slowest member's: each node times a few layers split two ways over a loopback ring and C =
  (split - whole / 2) / 2, which also carries the per-operation costs sharding does not halve;
  ~0.1 ms on a Linux CPU box, 10x the wire's round trip), plus once per token rank 0 handing the
  input to the others (one-way + M / bandwidth + C: a pipe and a control socket). The last
  unit also runs the head (``head_bytes``, or the tied embedding), unsharded, on every member.
  The embedding lookup and the KV reads are left out (one row; small at decode lengths).
* A pipeline of k >= 2 units: k - 1 hops of M bytes between consecutive ranks 0, plus the sampled
  token going back from the last to the first (the first embeds the next token): k one-way trips.
* Links: ``links[(a, b)]`` (either order); an unmeasured pair is assumed ``DEFAULT_LINK`` (1 ms RTT,
  100 MB/s) and the reason says so; a link's ``overhead_s`` (the RPC stack's round trip, which a
  ring collective does not pay) adds half of itself to each pipeline hop; ``link_latency_s``
  replaces every one-way latency (benchmarks that inject latency per message). Every estimate is
  linear in that latency, which is how :func:`crossover_latency` finds where tensor stops paying.

Memory of a group member holding layers [s, e): 1/g of the layers' weights and KV cache, all of
their norms (and MoE routers: replicated by ``shard``), and the embedding / norm / head whole
(mlx-lm's ``shard`` leaves ``embed_tokens`` and ``lm_head`` unsharded). Each member must fit.

Legality: a group of g nodes needs a family whose mlx-lm class has ``shard`` with the rules here
(:data:`TENSOR_FAMILIES`; not mixtral), and g dividing heads, kv heads and the (expert)
intermediate size. A mixture-of-experts model's group must have every pairwise link faster than
``fast_rtt_s`` (200 µs RTT): experts never spread over a slow link; pipeline stages keep whole
layers, so a layer's experts stay on one node.

Search: exact for home labs, heuristic beyond. Single: every node. Pipelines: every subset of up
to ``EXACT_SUBSET_NODES`` nodes (all stage orders up to 3 stages; else the memory order, fastest
first and its reverse), the top-k by budget and by speed beyond; split by the least time within
budgets (the memory split above when the stage nodes are equally fast: time then does not depend
on it; speeds measured within ``SAME_SPEED``, 10 %, of each other count as equal for the split,
so two like machines share the layers evenly instead of the one that measured faster taking all
its memory holds). Tensor: every g-subset (top-g by budget and by speed beyond). Hybrid: every
partition of every subset into legal groups in every order up to ``EXACT_GROUP_NODES`` nodes;
beyond, the nodes by budget and by speed cut into consecutive groups of g, in both directions.
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
