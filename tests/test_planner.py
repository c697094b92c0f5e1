"""The pure planner over many made-up clusters (hypothesis), checked against brute force."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnode.planner import NodeSpec, Plan, PlanError, Stage, plan
from meshnode.weights.profile import ModelProfile

GiB = 2**30
# MESHNODE_PLANNER_EXAMPLES=5000 for a deeper search than the default run's.
EXAMPLES = int(os.environ.get("MESHNODE_PLANNER_EXAMPLES", "250"))
PROPS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def profile(layer_bytes, embed=100, head=100, norm=1, tied=False, kv=1, windows=None, name="m"):
    n = len(layer_bytes)
    kv = (kv,) * n if isinstance(kv, int) else tuple(kv)
    return ModelProfile(
        name=name,
        model_type="llama",
        num_layers=n,
        layer_bytes=tuple(layer_bytes),
        embed_bytes=embed,
        head_bytes=0 if tied else head,
        norm_bytes=norm,
        tied_embeddings=tied,
        kv_bytes_per_token=kv,
        sliding_window=tuple(windows) if windows else (None,) * n,
        hidden_size=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        intermediate_size=16,
        num_experts=0,
        vocab_size=10,
        dtype="float32",
    )


# ---- an independent model of what a stage costs, and brute force over every placement ----


def stage_cost(p: ModelProfile, start: int, end: int, ctx: int) -> int:
    """Written from the spec, not from the planner or ModelProfile.stage_bytes."""
    total = 0
    for i in range(start, end):
        w = p.sliding_window[i]
        total += p.layer_bytes[i] + p.kv_bytes_per_token[i] * (ctx if w is None else min(ctx, w))
    if start == 0:
        total += p.embed_bytes
    if end == p.num_layers:
        total += p.norm_bytes + p.head_bytes
        if p.tied_embeddings and start > 0:
            total += p.embed_bytes
    return total


def order_fits(p, order, ctx) -> bool:
    k, n = len(order), p.num_layers
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        if all(stage_cost(p, edges[i], edges[i + 1], ctx) <= order[i].memory_budget for i in range(k)):
            return True
    return False


def subset_fits(p, subset, ctx) -> bool:
    return any(order_fits(p, order, ctx) for order in itertools.permutations(subset))


def fitting_subsets(p, nodes, ctx, min_k=1, max_k=None):
    """(k, [subsets of size k that fit]) for the least k >= min_k with any; (None, []) if none."""
    max_k = len(nodes) if max_k is None else max_k
    for k in range(min_k, max_k + 1):
        found = [c for c in itertools.combinations(nodes, k) if subset_fits(p, c, ctx)]
        if found:
            return k, found
    return None, []


def best_max_fraction(p, order, ctx) -> Fraction:
    k, n = len(order), p.num_layers
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        costs = [stage_cost(p, edges[i], edges[i + 1], ctx) for i in range(k)]
        if all(c <= x.memory_budget for c, x in zip(costs, order)):
            v = max(Fraction(c, x.memory_budget) for c, x in zip(costs, order))
            best = v if best is None else min(best, v)
    return best


def check_valid(p, nodes, result, ctx):
    budgets = {x.node_id: x.memory_budget for x in nodes}
    edges = [(s.start_layer, s.end_layer) for s in result.stages]
    assert edges[0][0] == 0 and edges[-1][1] == p.num_layers
    assert all(a[1] == b[0] for a, b in zip(edges, edges[1:]))
    assert all(a < b for a, b in edges)
    covered = [i for a, b in edges for i in range(a, b)]
    assert covered == list(range(p.num_layers))  # every layer exactly once, in order
    for s in result.stages:
        assert len(s.nodes) == 1 and s.nodes[0] in budgets
        assert s.bytes == stage_cost(p, s.start_layer, s.end_layer, ctx) <= budgets[s.nodes[0]]
    used = result.node_ids()
    assert len(set(used)) == len(used)
    assert result.strategy == ("single" if len(used) == 1 else "pipeline")
    assert result.max_context == ctx and result.model == p.name and result.reason
    result.check(p.num_layers)


def explains_failure(exc: PlanError) -> bool:
    text = str(exc)
    return bool(exc.reasons) and any(
        s in text for s in ("short by", "alone needs", "no contiguous split", "at least two")
    )


# ---- made-up models and clusters ----


@st.composite
def models(draw, max_layers=8):
    n = draw(st.integers(1, max_layers))
    layers = draw(st.lists(st.integers(1, 400), min_size=n, max_size=n))
    kv = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    windows = draw(st.lists(st.none() | st.integers(1, 16), min_size=n, max_size=n))
    return profile(
        layers,
        embed=draw(st.integers(0, 300)),
        head=draw(st.integers(0, 300)),
        norm=draw(st.integers(0, 20)),
        tied=draw(st.booleans()),
        kv=kv,
        windows=windows,
        name=draw(st.sampled_from(["m", "llama-7b"])),
    )


@st.composite
def clusters(draw, p, ctx, max_nodes=5):
    """Budgets scaled to the model so that fits, near-fits and misfits all come up; ties too."""
    total = p.total_bytes(ctx)
    m = draw(st.sampled_from(range(1, max_nodes + 1)))
    spread = draw(st.sampled_from(range(1, m + 1)))  # about how many nodes the model should need
    pct = draw(st.lists(st.integers(max(2, 50 // spread), 150 // spread + 20), min_size=m, max_size=m))
    ids = draw(st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=len(pct), max_size=len(pct), unique=True))
    return [NodeSpec(i, max(1, total * q // 100)) for i, q in zip(ids, pct)]


@st.composite
def cases(draw, max_nodes=5, max_layers=8):
    p = draw(models(max_layers))
    ctx = draw(st.integers(1, 64))
    nodes = draw(clusters(p, ctx, max_nodes))
    return p, nodes, ctx


# ---- properties ----


@PROPS
@given(cases(), st.data())
def test_plans_are_valid_minimal_deterministic_and_errors_are_true(case, data):
    p, nodes, ctx = case
    k, fitting = fitting_subsets(p, nodes, ctx)
    try:
        result = plan(p, nodes, max_context=ctx)
    except PlanError as exc:
        assert k is None, f"planner missed a fit with {k} nodes: {exc}"
        assert explains_failure(exc), str(exc)
        return
    check_valid(p, nodes, result, ctx)
    assert len(result.stages) == k  # the fewest nodes
    # Largest budgets first (ties by id): the top k always fit when any k do.
    ranked = sorted(nodes, key=lambda x: (-x.memory_budget, x.node_id))
    assert set(result.node_ids()) == {x.node_id for x in ranked[:k]}
    # The split is the least-loaded one for that stage order.
    by_id = {x.node_id: x for x in nodes}
    order = [by_id[s.nodes[0]] for s in result.stages]
    used = max(Fraction(s.bytes, by_id[s.nodes[0]].memory_budget) for s in result.stages)
    assert used == best_max_fraction(p, order, ctx)
    # Deterministic, whatever order the nodes are listed in.
    shuffled = data.draw(st.permutations(nodes))
    assert plan(p, shuffled, max_context=ctx) == result
    assert plan(p, nodes, max_context=ctx) == result


@PROPS
@given(cases(), st.data())
def test_preferred_nodes_win_among_equally_small_placements(case, data):
    p, nodes, ctx = case
    ids = [x.node_id for x in nodes]
    preferred = data.draw(st.lists(st.sampled_from(ids + ["gone"]), unique=True, max_size=len(ids) + 1))
    k, fitting = fitting_subsets(p, nodes, ctx)
    try:
        result = plan(p, nodes, max_context=ctx, preferred=preferred)
    except PlanError:
        assert k is None
        return
    check_valid(p, nodes, result, ctx)
    assert len(result.stages) == k
    best = max(sum(1 for x in c if x.node_id in preferred) for c in fitting)
    assert sum(1 for n in result.node_ids() if n in preferred) == best
    # Preferred nodes keep their given order when that order fits.
    kept = [n for n in result.node_ids() if n in preferred]
    by_id = {x.node_id: x for x in nodes}
    natural = [n for n in preferred if n in kept]
    if kept != natural:
        rest = [n for n in result.node_ids() if n not in preferred]
        assert not order_fits(
            p, [by_id[n] for n in natural + sorted(rest, key=lambda n: (-by_id[n].memory_budget, n))], ctx
        )
    assert plan(p, data.draw(st.permutations(nodes)), max_context=ctx, preferred=preferred) == result


@PROPS
@given(cases(), st.sampled_from(["single", "pipeline"]))
def test_forced_strategies(case, strategy):
    p, nodes, ctx = case
    if strategy == "single":
        k, _ = fitting_subsets(p, nodes, ctx, 1, 1)
    else:
        k, _ = fitting_subsets(p, nodes, ctx, 2)
    try:
        result = plan(p, nodes, max_context=ctx, strategy=strategy)
    except PlanError as exc:
        assert k is None, f"planner missed a {strategy} fit with {k} nodes: {exc}"
        assert explains_failure(exc) or "single" in str(exc), str(exc)
        return
    check_valid(p, nodes, result, ctx)
    assert result.strategy == strategy and len(result.stages) == k


@settings(max_examples=max(1, EXAMPLES // 4), deadline=None)
@given(cases(max_nodes=7, max_layers=12))
def test_larger_clusters_stay_valid_and_minimal_by_budget(case):
    """Up to 7 nodes and 12 layers: the minimal k is checked on the top-k nodes only."""
    p, nodes, ctx = case
    ranked = sorted(nodes, key=lambda x: (-x.memory_budget, x.node_id))
    least = next((k for k in range(1, len(ranked) + 1) if subset_fits(p, ranked[:k], ctx)), None)
    try:
        result = plan(p, nodes, max_context=ctx)
    except PlanError as exc:
        assert least is None, str(exc)
        return
    check_valid(p, nodes, result, ctx)
    assert len(result.stages) == least


@PROPS
@given(st.integers(1, 40), st.integers(1, 1000), st.lists(st.integers(1, 10**6), min_size=1, max_size=6))
def test_uniform_layers_follow_budgets(n, layer, raw_budgets):
    """Equal layers, nothing else: each node's share is within half a layer of proportional; no
    single move of a layer between two stages would load the nodes more evenly."""
    p = profile([layer] * n, embed=0, head=0, norm=0, kv=0)
    nodes = [NodeSpec(f"n{i}", b) for i, b in enumerate(raw_budgets)]
    try:
        result = plan(p, nodes, max_context=1)
    except PlanError:
        assert sum(b // layer for b in sorted(raw_budgets)[::-1][:n]) < n or n < 1
        return
    by_id = {x.node_id: x.memory_budget for x in nodes}
    counts = [(s.num_layers, by_id[s.nodes[0]]) for s in result.stages]
    peak = max(Fraction(c * layer, b) for c, b in counts)
    cap = {i: int(peak * b / layer) for i, (_, b) in enumerate(counts)}
    for (_i, (li, bi)), (j, (lj, bj)) in itertools.permutations(enumerate(counts), 2):
        if li >= 2 and lj + 1 <= cap[j]:
            assert (2 * li - 1) * bj <= (2 * lj + 1) * bi, counts  # moving one from i to j is no better
    # the peak load cannot drop by moving one layer from a fullest stage to any other
    fullest = [i for i, (li, bi) in enumerate(counts) if Fraction(li * layer, bi) == peak]
    if len(fullest) == 1 and counts[fullest[0]][0] >= 2:
        i = fullest[0]
        assert all(Fraction((lj + 1) * layer, bj) >= peak for j, (lj, bj) in enumerate(counts) if j != i)


# ---- examples ----


def test_one_machine_beats_two():
    p = profile([100] * 8)
    result = plan(p, [NodeSpec("small", 10**6 - 1), NodeSpec("big", 10**6)], max_context=4)
    assert result.strategy == "single" and result.node_ids() == ["big"]
    assert result.stages == (Stage(0, 8, ("big",), p.total_bytes(4)),)
    assert "fits on big alone" in result.reason


def test_layers_follow_budgets():
    p = profile([100] * 30, embed=0, head=0, norm=0, kv=0)
    result = plan(p, [NodeSpec("a", 1000), NodeSpec("b", 1100), NodeSpec("c", 1200)], max_context=1)
    counts = {s.nodes[0]: s.num_layers for s in result.stages}
    # 3000 bytes needed, no two nodes suffice; each fills about 91 % of its budget.
    assert counts == {"a": 9, "b": 10, "c": 11}
    assert result.node_ids() == ["c", "b", "a"]  # largest budget first
    assert result.reason.startswith("needs 3 nodes (no 2 nodes hold")

    p = profile([GiB // 8] * 60, embed=0, head=0, norm=0, kv=0)
    result = plan(p, [NodeSpec("s", 1 * GiB + 1), NodeSpec("m", 2 * GiB + 1), NodeSpec("l", 5 * GiB)], max_context=1)
    assert {s.nodes[0]: s.num_layers for s in result.stages} == {"l": 38, "m": 15, "s": 7}


def test_embedding_and_head_weigh_on_the_end_stages():
    p = profile([100] * 10, embed=400, head=400, norm=0, kv=0)
    result = plan(p, [NodeSpec("a", 1000), NodeSpec("b", 1000)], max_context=1)
    assert [s.num_layers for s in result.stages] == [5, 5] and all(s.bytes == 900 for s in result.stages)
    # tied: the last stage holds the embedding as its head, so a split needs it twice
    p = profile([100] * 10, embed=400, tied=True, norm=0, kv=0)
    assert p.total_bytes(1) == 1400
    result = plan(p, [NodeSpec("a", 900), NodeSpec("b", 900)], max_context=1)
    assert [s.bytes for s in result.stages] == [900, 900]
    with pytest.raises(PlanError, match=r"tied embedding.*short by 399 B"):
        plan(p, [NodeSpec("a", 700), NodeSpec("b", 701)], max_context=1)


def test_an_mtp_head_and_its_embedding_copy_weigh_on_the_last_stage():
    plain = profile([100] * 10, embed=400, head=400, norm=0, kv=0)
    p = dataclasses.replace(plain, mtp_bytes=150, mtp_embed_bytes=400)
    # one node holds the embedding already: the head alone is added
    assert p.total_bytes(1) == plain.total_bytes(1) + 150 == 1950
    # split, the last stage also needs the embedding for the head: 1000 + 400 + 400 + 150 + 400
    with pytest.raises(PlanError, match=r"needs 2\.3 KiB .*embedding, for its MTP head.*short by 302 B"):
        plan(p, [NodeSpec("a", 1000), NodeSpec("b", 1048)], max_context=1)
    assert [s.bytes for s in plan(plain, [NodeSpec("a", 1000), NodeSpec("b", 1048)], max_context=1).stages] == [
        900,
        900,
    ]
    # a holds 6 layers at most; b's 4, the head 400, the MTP head 150 and the embedding copy 400: 1350
    result = plan(p, [NodeSpec("a", 1000), NodeSpec("b", 1350)], max_context=1)
    assert [(s.nodes[0], s.num_layers, s.bytes) for s in result.stages] == [("a", 6, 1000), ("b", 4, 1350)]
    with pytest.raises(PlanError):
        plan(p, [NodeSpec("a", 1000), NodeSpec("b", 1349)], max_context=1)
    # tied: the last stage's embedding serves the head too
    tied = dataclasses.replace(profile([100] * 10, embed=400, tied=True, norm=0, kv=0), mtp_bytes=150)
    assert tied.stage_bytes(5, 10, 1) == 500 + 400 + 150
    assert p.without_mtp() == plain


def test_sliding_windows_cap_the_kv_cache():
    full = profile([100] * 4, embed=0, head=0, norm=0, kv=10)
    windowed = profile([100] * 4, embed=0, head=0, norm=0, kv=10, windows=[8, 8, 8, None])
    assert full.total_bytes(100) == 400 + 4 * 1000
    assert windowed.total_bytes(100) == 400 + 3 * 80 + 1000
    nodes = [NodeSpec("a", 2000), NodeSpec("b", 2000)]
    assert plan(windowed, nodes, max_context=100).strategy == "single"
    # each full-context layer needs 1100 bytes: one per node
    assert len(plan(full, [NodeSpec(x, 2000) for x in "abcd"], max_context=100).stages) == 4


def test_preferred_nodes_keep_their_place():
    p = profile([100] * 10, embed=0, head=0, norm=0, kv=0)
    nodes = [NodeSpec("a", 600), NodeSpec("b", 600), NodeSpec("c", 600)]
    assert plan(p, nodes, max_context=1).node_ids() == ["a", "b"]
    again = plan(p, nodes, max_context=1, preferred=["c", "b"])
    assert again.node_ids() == ["c", "b"]  # the current plan's nodes, in its order
    assert "keeps c, b from the current plan" in again.reason
    # a larger newcomer does not displace the current nodes while they still fit...
    bigger = nodes + [NodeSpec("d", 900)]
    assert plan(p, bigger, max_context=1, preferred=["c", "b"]).node_ids() == ["c", "b"]
    # ...but wins when it alone is enough: one machine beats two
    assert plan(p, nodes + [NodeSpec("e", 1000)], max_context=1, preferred=["c", "b"]).node_ids() == ["e"]
    # a preferred node that left is ignored; the survivor keeps its place and gets a partner
    assert plan(
        p, [NodeSpec("b", 600), NodeSpec("a", 600), NodeSpec("z", 600)], max_context=1, preferred=["c", "b"]
    ).node_ids() == ["b", "a"]


def test_another_stage_order_when_the_natural_one_does_not_fit():
    p = profile([900, 100, 100, 100], embed=0, head=0, norm=0, kv=0)
    result = plan(p, [NodeSpec("big", 950), NodeSpec("small", 300)], max_context=1)
    assert result.node_ids() == ["big", "small"]
    p = profile([100, 100, 100, 900], embed=0, head=0, norm=0, kv=0)
    result = plan(p, [NodeSpec("big", 950), NodeSpec("small", 300)], max_context=1)
    assert result.node_ids() == ["small", "big"]  # largest-first does not fit; the reverse does
    assert [(s.start_layer, s.end_layer) for s in result.stages] == [(0, 3), (3, 4)]


def test_error_messages_say_what_is_missing():
    p = profile([GiB] * 4, embed=0, head=0, norm=0, kv=0)
    with pytest.raises(PlanError) as info:
        plan(p, [NodeSpec("a", 2 * GiB), NodeSpec("b", GiB)], max_context=4096)
    assert str(info.value) == (
        "model needs 4.0 GiB for 4096 tokens of context; the 2 nodes offer 3.0 GiB together (short by 1.0 GiB)"
    )
    assert info.value.reasons == [str(info.value)]

    big = profile([GiB, 5 * GiB, GiB], embed=0, head=0, norm=0, kv=0)
    with pytest.raises(
        PlanError,
        match=r"^layer 1 alone needs 5\.0 GiB for 1 token of context, more than any "
        r"node's budget \(largest: a, 4\.0 GiB\)$",
    ):
        plan(big, [NodeSpec("a", 4 * GiB), NodeSpec("b", 4 * GiB)], max_context=1)
    with pytest.raises(PlanError, match="layer 0 with the embedding alone needs"):
        plan(profile([GiB, 1], embed=4 * GiB), [NodeSpec("a", 4 * GiB), NodeSpec("b", 4 * GiB)], max_context=1)

    # enough memory in total, but layers are whole: 3 layers of 1 GiB on nodes of 1.5 GiB
    with pytest.raises(PlanError, match="no contiguous split") as info:
        plan(
            profile([GiB] * 3, embed=0, head=0, norm=0, kv=0),
            [NodeSpec("a", 3 * GiB // 2), NodeSpec("b", 3 * GiB // 2)],
            max_context=1,
        )
    assert len(info.value.reasons) == 1


def test_error_suggests_a_context_that_fits():
    p = profile([1000] * 4, embed=0, head=0, norm=0, kv=10)
    with pytest.raises(PlanError, match=r"short by .*; it would fit with max_context 150$"):
        plan(p, [NodeSpec("a", 5000), NodeSpec("b", 5000)], max_context=1000)
    assert len(plan(p, [NodeSpec("a", 5000), NodeSpec("b", 5000)], max_context=150).stages) == 2


def test_bad_input_is_refused_with_a_reason():
    p = profile([GiB] * 4, embed=0, head=0, kv=0)
    with pytest.raises(PlanError, match="duplicate node ids: a"):
        plan(p, [NodeSpec("a", 1), NodeSpec("a", 1)], max_context=1)
    with pytest.raises(PlanError, match="no nodes"):
        plan(p, [], max_context=1)
    with pytest.raises(PlanError, match="positive memory budget: b, c"):
        plan(p, [NodeSpec("a", GiB), NodeSpec("c", -1), NodeSpec("b", 0)], max_context=1)
    with pytest.raises(PlanError, match="max_context must be positive"):
        plan(p, [NodeSpec("a", 10 * GiB)], max_context=0)
    with pytest.raises(PlanError, match="unknown strategy 'magic'"):
        plan(p, [NodeSpec("a", 10 * GiB)], max_context=1, strategy="magic")


def test_forced_strategies_examples():
    p = profile([100] * 6)
    result = plan(p, [NodeSpec("a", 10**6), NodeSpec("b", 10**6)], max_context=1, strategy="pipeline")
    assert result.strategy == "pipeline" and len(result.stages) == 2 and "pipeline forced" in result.reason
    with pytest.raises(PlanError, match="at least two nodes"):
        plan(p, [NodeSpec("a", 10**6)], max_context=1, strategy="pipeline")
    with pytest.raises(PlanError, match="at least two layers"):
        plan(profile([100]), [NodeSpec("a", 10**6), NodeSpec("b", 10**6)], max_context=1, strategy="pipeline")
    with pytest.raises(PlanError, match=r"strategy 'single'.*largest node \(a\).*short by"):
        plan(p, [NodeSpec("a", 500), NodeSpec("b", 500)], max_context=1, strategy="single")
    assert plan(p, [NodeSpec("a", 10**6), NodeSpec("b", 10**6)], max_context=1, strategy="single").node_ids() == ["a"]


def test_plan_round_trips_through_json():
    p = profile([100] * 6)
    result = plan(p, [NodeSpec("a", 500), NodeSpec("b", 500)], max_context=3).with_epoch(7)
    assert result.epoch == 7
    again = Plan.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result
    assert result.stage_of("b") == result.stages[1] and result.stage_of("zz") is None
    assert result.to_dict()["stages"][0] == {
        "start_layer": 0,
        "end_layer": result.stages[0].end_layer,
        "nodes": ["a"],
        "bytes": result.stages[0].bytes,
    }
    with pytest.raises(ValueError):
        Plan("m", "pipeline", (Stage(0, 2, ("a",)), Stage(3, 6, ("b",)))).check(6)
    with pytest.raises(ValueError):
        Plan("m", "pipeline", (Stage(0, 2, ("a",)), Stage(2, 6, ("a",)))).check(6)


def test_big_clusters_and_models_plan_quickly():
    # 80 layers of a 70B-class model on 8 machines, and an impossible variant: both fast.
    p = profile([1_700_000_000] * 80, embed=2 * GiB, head=2 * GiB, kv=4096)
    nodes = [NodeSpec(f"mac{i}", (16 + 8 * (i % 3)) * GiB) for i in range(8)]
    t = time.perf_counter()
    result = plan(p, nodes, max_context=8192)
    assert time.perf_counter() - t < 2
    check_valid(p, nodes, result, 8192)
    t = time.perf_counter()
    with pytest.raises(PlanError, match="short by"):
        plan(p, nodes[:5], max_context=8192)
    assert time.perf_counter() - t < 2
    # beyond the exact search (more than 12 stages), natural orders still find a plan
    many = [NodeSpec(f"n{i:02d}", 11 * GiB) for i in range(16)]
    result = plan(p, many, max_context=8192)
    check_valid(p, many, result, 8192)
    assert len(result.stages) == 14


# ---- time per token: tensor, hybrid, links (the cost model in planner's docstring) ----

from meshnode.control.messages import plan_from_pb, plan_to_pb  # noqa: E402
from meshnode.planner import (  # noqa: E402
    FAST_RTT_S,
    LinkSpec,
    crossover_latency,
    group_size_problem,
    supports_tensor,
)

MiB = 2**20


def shaped(
    n=32,
    layer=200 * MiB,
    heads=32,
    kv_heads=8,
    inter=14336,
    hidden=4096,
    experts=0,
    model_type="llama",
    embed=500 * MiB,
    kv=4096,
    name="m",
):
    return ModelProfile(
        name=name,
        model_type=model_type,
        num_layers=n,
        layer_bytes=(layer,) * n,
        embed_bytes=embed,
        head_bytes=embed,
        norm_bytes=8192,
        tied_embeddings=False,
        kv_bytes_per_token=(kv,) * n,
        sliding_window=(None,) * n,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=128,
        intermediate_size=inter,
        num_experts=experts,
        vocab_size=32000,
        dtype="bfloat16",
    )


def link_all(ids, rtt, bw=5e9):
    return {(a, b): LinkSpec(rtt, bw) for a, b in itertools.combinations(ids, 2)}


@st.composite
def timed_cases(draw):
    n = draw(st.integers(1, 8))
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 3, 4, 6, 8, 12) if heads % h == 0]))
    experts = draw(st.sampled_from([0, 0, 4]))
    model_type = draw(st.sampled_from(["llama", "qwen3", "qwen3_moe", "mixtral", "gemma3_text"]))
    p = ModelProfile(
        name="m",
        model_type=model_type,
        num_layers=n,
        layer_bytes=tuple(draw(st.lists(st.integers(100, 4000), min_size=n, max_size=n))),
        embed_bytes=draw(st.integers(0, 2000)),
        head_bytes=draw(st.integers(0, 2000)),
        norm_bytes=8,
        tied_embeddings=False,
        kv_bytes_per_token=(draw(st.integers(0, 4)),) * n,
        sliding_window=(None,) * n,
        hidden_size=8,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=2,
        intermediate_size=draw(st.sampled_from([16, 24, 36])),
        num_experts=experts,
        vocab_size=10,
        dtype="float16",
    )
    ctx = draw(st.integers(1, 16))
    m = draw(st.integers(2, 6))
    total = p.total_bytes(ctx)
    ids = [f"n{i}" for i in range(m)]
    nodes = [
        NodeSpec(
            i, max(1, total * draw(st.integers(15, 130)) // 100), layer_seconds=draw(st.none() | st.floats(1e-5, 1e-2))
        )
        for i in ids
    ]
    links = {}
    for a, b in itertools.combinations(ids, 2):
        if draw(st.integers(0, 3)):
            links[(a, b)] = LinkSpec(
                draw(st.sampled_from([5e-6, 30e-6, 150e-6, 400e-6, 2e-3])), draw(st.sampled_from([1e8, 1e9, 1e10]))
            )
    return p, nodes, links, ctx


def check_grouped(p, nodes, links, ctx, result, fast_rtt=FAST_RTT_S):
    budgets = {x.node_id: x.memory_budget for x in nodes}
    result.check(p.num_layers)  # every layer exactly once, no node twice
    covered = [i for s in result.stages for i in range(s.start_layer, s.end_layer)]
    assert covered == list(range(p.num_layers))
    for s in result.stages:
        assert all(s.bytes <= budgets[m] for m in s.nodes)  # every member within its budget
        g = len(s.nodes)
        if g == 1:
            assert s.bytes == stage_cost(p, s.start_layer, s.end_layer, ctx)
            continue
        assert p.model_type in ("llama", "qwen3", "qwen3_moe")  # families with shard() in mlx-lm
        assert p.num_heads % g == 0 and p.num_kv_heads % g == 0 and p.intermediate_size % g == 0
        if p.num_experts:  # experts never cross a slow link
            for a, b in itertools.combinations(s.nodes, 2):
                spec = links.get((a, b)) or links.get((b, a))
                assert spec is not None and spec.rtt_s < fast_rtt
        # each member holds at least its share of the weights and KV, plus the ends whole
        share = stage_cost(p, s.start_layer, s.end_layer, ctx) - sum(
            p.layer_bytes[i] + p.kv_bytes(i, ctx) for i in range(s.start_layer, s.end_layer)
        )
        assert s.bytes >= share + p.layers_bytes(s.start_layer, s.end_layer, ctx) // g
    kinds = {1: "single"} if len(result.stages) == 1 else {}
    grouped = any(len(s.nodes) > 1 for s in result.stages)
    expected = ("tensor" if grouped else "single") if len(result.stages) == 1 else ("hybrid" if grouped else "pipeline")
    assert result.strategy == expected, kinds
    assert result.estimate_s > 0 and result.reason
    for a in result.alternatives:  # the chosen one is the fastest feasible
        if a["feasible"]:
            assert result.estimate_s <= a["estimate_s"] * (1 + 1e-9)
            assert all(a["memory"][n] <= budgets[n] for n in a["memory"])
        else:
            assert a["why"]


@PROPS
@given(timed_cases(), st.sampled_from([None, "single", "pipeline", "tensor", "hybrid"]))
def test_timed_plans_are_valid_legal_and_fastest(case, strategy):
    p, nodes, links, ctx = case
    try:
        result = plan(p, nodes, max_context=ctx, links=links, strategy=strategy)
    except PlanError as exc:
        assert exc.reasons and all(exc.reasons)
        if strategy is None:  # nothing fits at all: not even a pipeline
            k, _ = fitting_subsets(p, nodes, ctx)
            assert k is None
        if strategy == "tensor" and not supports_tensor(p):
            assert "no tensor-parallel implementation" in str(exc)
        return
    check_grouped(p, nodes, links, ctx, result)
    if strategy is not None:
        assert result.strategy == strategy
    # deterministic whatever the order of the nodes, and JSON / protobuf round trips
    assert plan(p, nodes[::-1], max_context=ctx, links=links, strategy=strategy) == result
    assert Plan.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    assert plan_from_pb(plan_to_pb(result, "c"), p.num_layers) == result


def test_fast_link_makes_tensor_pay_and_a_tcp_link_does_not():
    p = shaped()  # 32 layers, ~0.5 ms each: a compute-bound 8B-class model
    nodes = [NodeSpec("a", 16 * GiB, layer_seconds=5e-4), NodeSpec("b", 16 * GiB, layer_seconds=5e-4)]
    fast = plan(p, nodes, max_context=4096, links=link_all("ab", 20e-6))
    assert fast.strategy == "tensor" and fast.stages[0].nodes == ("a", "b")
    assert "tensor over 0-31@a+b" in fast.reason and "vs single" in fast.reason and "20 µs RTT" in fast.reason
    single = next(a for a in fast.alternatives if a["strategy"] == "single")
    assert fast.estimate_s < single["estimate_s"]
    # members hold half the layers each, the embedding and head whole
    assert fast.stages[0].bytes < p.total_bytes(4096) // 2 + 2 * p.embed_bytes
    slow = plan(p, nodes, max_context=4096, links=link_all("ab", 300e-6))
    assert slow.strategy in ("single", "pipeline")
    assert "tensor" in {a["strategy"] for a in slow.alternatives if a["feasible"]}
    # unknown links are assumed a LAN, and the reason says so
    unknown = plan(p, nodes, max_context=4096, strategy="tensor")
    assert "unmeasured link a-b assumed 1 ms RTT" in unknown.reason


def test_three_nodes_where_three_does_not_divide_the_heads_get_a_hybrid():
    p = shaped(heads=8, kv_heads=8, n=32)
    nodes = [NodeSpec(x, 3 * GiB, layer_seconds=2e-3) for x in "abc"]
    result = plan(p, nodes, max_context=1024, links=link_all("abc", 20e-6))
    assert result.strategy == "hybrid"
    assert sorted(len(s.nodes) for s in result.stages) == [1, 2]
    check_grouped(p, nodes, link_all("abc", 20e-6), 1024, result)
    with pytest.raises(PlanError, match="tensor: 3 does not divide 8 heads"):
        plan(p, nodes, max_context=1024, strategy="tensor")
    assert group_size_problem(p, 3).startswith("tensor: 3 does not divide 8 heads")
    assert group_size_problem(p, 2) is None


def test_mixtral_and_families_without_shard_never_get_groups():
    nodes = [NodeSpec(x, 16 * GiB, layer_seconds=2e-3) for x in "ab"]
    for model_type in ("mixtral", "gemma3_text"):
        p = shaped(model_type=model_type, experts=8 if model_type == "mixtral" else 0)
        assert not supports_tensor(p)
        assert plan(p, nodes, max_context=1024, links=link_all("ab", 5e-6)).strategy in ("single", "pipeline")
        with pytest.raises(PlanError, match=f"tensor: {model_type} has no tensor-parallel implementation in mlx-lm"):
            plan(p, nodes, max_context=1024, strategy="tensor")


def test_moe_groups_only_over_fast_links():
    p = shaped(model_type="qwen3_moe", experts=8)
    nodes = [NodeSpec(x, 16 * GiB, layer_seconds=5e-4) for x in "ab"]
    assert plan(p, nodes, max_context=1024, links=link_all("ab", 20e-6)).strategy == "tensor"
    with pytest.raises(PlanError, match="mixture of experts and no 2 nodes are joined by links under 200 µs"):
        plan(p, nodes, max_context=1024, links=link_all("ab", 250e-6), strategy="tensor")


def test_crossover_latency_is_where_the_planner_flips():
    p = shaped()
    nodes = [NodeSpec("a", 16 * GiB, layer_seconds=5e-4), NodeSpec("b", 16 * GiB, layer_seconds=5e-4)]
    links = link_all("ab", 20e-6)
    cross = crossover_latency(p, nodes, max_context=4096, links=links)
    assert 5e-6 < cross < 150e-6
    below = plan(p, nodes, max_context=4096, links=links, link_latency_s=cross * 0.99)
    above = plan(p, nodes, max_context=4096, links=links, link_latency_s=cross * 1.01)
    assert below.strategy == "tensor" and above.strategy in ("single", "pipeline")
    # at the crossover both estimates agree
    at = plan(p, nodes, max_context=4096, links=links, link_latency_s=cross, strategy="tensor")
    best_plain = min(
        plan(p, nodes, max_context=4096, links=links, link_latency_s=cross, strategy=s).estimate_s
        for s in ("single", "pipeline")
    )
    assert at.estimate_s == pytest.approx(best_plain, rel=1e-9)
    # slower compute moves the crossover out: more to save per token
    slower = [NodeSpec(x.node_id, x.memory_budget, layer_seconds=2e-3) for x in nodes]
    assert crossover_latency(p, slower, max_context=4096, links=links) > cross
    # no tensor for the family: tensor never wins
    assert crossover_latency(shaped(model_type="mixtral", experts=8), nodes, max_context=4096) == 0.0


def test_faster_nodes_hold_more_layers_in_a_pipeline():
    p = shaped(n=32, embed=0, kv=0)
    nodes = [NodeSpec("slow", 5 * GiB, layer_seconds=2e-3), NodeSpec("fast", 5 * GiB, layer_seconds=5e-4)]
    result = plan(p, nodes, max_context=1, links=link_all(["slow", "fast"], 300e-6))
    counts = {s.nodes[0]: s.num_layers for s in result.stages}
    assert result.strategy == "pipeline" and counts["fast"] > counts["slow"]


def test_nodes_measured_a_few_percent_apart_split_the_layers_evenly():
    # Two identical machines measure a few percent apart; a least-time split that took that at face
    # value would put every layer it could on the one that measured faster, and a filled pipeline
    # would wait on the other's longer stage.
    p = shaped(n=16, embed=0, kv=0)
    budget = int(p.total_bytes(1) * 0.6)
    for a_s, b_s in ((5.0e-4, 5.2e-4), (5.2e-4, 5.0e-4), (5.0e-4, 5.45e-4)):
        nodes = [NodeSpec("a", budget, layer_seconds=a_s), NodeSpec("b", budget, layer_seconds=b_s)]
        result = plan(p, nodes, max_context=1, links=link_all("ab", 300e-6), strategy="pipeline")
        assert [s.num_layers for s in result.stages] == [8, 8], (a_s, b_s, result.stages)
    # Beyond the noise the faster node still takes more (as many as its memory holds)
    nodes = [NodeSpec("a", budget, layer_seconds=5.0e-4), NodeSpec("b", budget, layer_seconds=6.0e-4)]
    result = plan(p, nodes, max_context=1, links=link_all("ab", 300e-6), strategy="pipeline")
    assert {s.nodes[0]: s.num_layers for s in result.stages} == {"a": 9, "b": 7}


def test_three_nodes_within_the_noise_split_evenly_and_a_slower_one_takes_fewer():
    p = shaped(n=24, embed=0, kv=0)
    budget = int(p.total_bytes(1) * 0.45)  # three are needed
    links = link_all(["a", "b", "c"], 300e-6)
    nodes = [
        NodeSpec("a", budget, layer_seconds=5.0e-4),
        NodeSpec("b", budget, layer_seconds=5.2e-4),
        NodeSpec("c", budget, layer_seconds=5.4e-4),
    ]
    result = plan(p, nodes, max_context=1, links=links, strategy="pipeline")
    assert sorted(s.num_layers for s in result.stages) == [8, 8, 8], result.stages
    nodes[2] = NodeSpec("c", budget, layer_seconds=1.0e-3)
    result = plan(p, nodes, max_context=1, links=links, strategy="pipeline")
    counts = {s.nodes[0]: s.num_layers for s in result.stages}
    assert counts["a"] == counts["b"] > counts["c"], counts


def test_estimate_of_a_placement_matches_the_plan_and_rpc_overhead_costs_only_hops():
    from meshnode.planner import estimate

    p = shaped(n=8)
    nodes = [NodeSpec("a", 2 * GiB, layer_seconds=5e-4), NodeSpec("b", 2 * GiB, layer_seconds=5e-4)]
    bare = {("a", "b"): LinkSpec(rtt_s=50e-6, bandwidth_Bps=1e9)}
    rpc = {("a", "b"): LinkSpec(rtt_s=50e-6, bandwidth_Bps=1e9, overhead_s=800e-6)}
    for links in (bare, rpc):
        for strategy in ("pipeline", "tensor"):
            chosen = plan(p, nodes, max_context=1024, links=links, strategy=strategy)
            assert estimate(p, nodes, chosen.stages, max_context=1024, links=links) == pytest.approx(chosen.estimate_s)
    piped = [plan(p, nodes, max_context=1024, links=x, strategy="pipeline") for x in (bare, rpc)]
    grouped = [plan(p, nodes, max_context=1024, links=x, strategy="tensor") for x in (bare, rpc)]
    # A pipeline's two hops per token (there and back) each pay half the RPC round trip...
    assert piped[1].estimate_s - piped[0].estimate_s == pytest.approx(800e-6)
    # ...a tensor group's ring collectives run below the RPC stack and pay none of it.
    assert grouped[1].estimate_s == pytest.approx(grouped[0].estimate_s)
    assert estimate(p, nodes[:1], piped[0].stages, max_context=1024) == float("inf")  # b is gone


def test_a_lan_hop_outweighs_half_the_layers_only_by_the_newcomers_own_figure():
    """What tests/test_faults.py's join-during-load test rests on: on a 5 ms link a node holding
    the whole model beats a two-stage pipeline by more than REPLAN_GAIN when all three nodes'
    figures are the machine's; with the newcomer's figure 1.7x slower (2.898 against 1.716 ms, as a
    node timing its layers while the other two serve the load on the same two cores may measure) the
    move is not worth it, and the mesh rightly stays put."""
    from meshnode.control.coordinator import REPLAN_GAIN
    from meshnode.planner import estimate

    p = shaped(n=8)
    lan = LinkSpec(rtt_s=5e-3, bandwidth_Bps=100e6, overhead_s=500e-6)
    links = {(x, y): lan for x in "abc" for y in "abc" if x != y}
    piped, alone = [Stage(0, 4, ("b",)), Stage(4, 8, ("a",))], [Stage(0, 8, ("c",))]
    for newcomer_s, moves in ((1.716e-3, True), (2.898e-3, False)):
        nodes = [
            NodeSpec("a", 2 * GiB, layer_seconds=1.716e-3),
            NodeSpec("b", 2 * GiB, layer_seconds=1.716e-3),
            NodeSpec("c", 4 * GiB, layer_seconds=newcomer_s),
        ]
        now = estimate(p, nodes, piped, max_context=512, links=links)
        after = estimate(p, nodes, alone, max_context=512, links=links)
        assert (after < now * (1 - REPLAN_GAIN)) is moves, (newcomer_s, now, after)


def test_a_plan_on_fewer_nodes_needs_only_to_be_no_slower_and_the_way_back_the_full_gain():
    """A node back from a restart: the two-stage plan on it is estimated 12 % faster than the
    three-stage plan that served without it, under REPLAN_GAIN, and still wins because it holds one
    node fewer; the three-stage plan would need the full gain to win back, so the two never flap."""
    from meshnode.control.coordinator import REPLAN_GAIN, pays_to_move

    three = Plan("m", "pipeline", (Stage(0, 3, ("b",)), Stage(3, 6, ("c",)), Stage(6, 8, ("d",))), estimate_s=5.57e-3)
    two = Plan("m", "pipeline", (Stage(0, 4, ("b",)), Stage(4, 8, ("a",))), estimate_s=4.91e-3)
    assert two.estimate_s > three.estimate_s * (1 - REPLAN_GAIN)
    assert pays_to_move(three, three.estimate_s, two)
    assert not pays_to_move(two, two.estimate_s, three)
    assert pays_to_move(two, 0.5e-3 + three.estimate_s / (1 - REPLAN_GAIN), three)  # the full gain
    assert not pays_to_move(three, 4.9e-3, two)  # fewer nodes, but slower
    assert not pays_to_move(two, two.estimate_s, dataclasses.replace(two, estimate_s=1e-3))  # same layout
    other = Plan("m", "pipeline", (Stage(0, 4, ("c",)), Stage(4, 8, ("d",))), estimate_s=4.5e-3)
    assert not pays_to_move(two, two.estimate_s, other)  # as many nodes, 8 % faster


def test_each_recent_plan_change_doubles_the_wait_before_an_optional_move():
    """The soak's busy machine: a slow node left the plan, looked fast again once idle, and came back,
    a new epoch every 5-7 s. Each plan change in the last five minutes doubles the wait, up to a cap;
    older ones count for nothing."""
    from meshnode.control.coordinator import MOVES_BACKOFF_MAX, MOVES_WINDOW_S, rebalance_wait

    now = 1000.0
    assert rebalance_wait(5.0, [], now) == 5.0
    assert rebalance_wait(5.0, [now - 10], now) == 10.0
    assert rebalance_wait(5.0, [now - 30, now - 20, now - 10], now) == 40.0
    assert rebalance_wait(5.0, [now - MOVES_WINDOW_S - 1, now - 10], now) == 10.0  # one is too old to count
    assert rebalance_wait(5.0, [now - i for i in range(1, 9)], now) == 5.0 * MOVES_BACKOFF_MAX


def test_plan_endpoints_travel_and_bad_ones_are_refused():
    p = shaped(n=8)
    nodes = [NodeSpec("a", 2 * GiB, layer_seconds=5e-4), NodeSpec("b", 2 * GiB, layer_seconds=5e-4)]
    chosen = plan(p, nodes, max_context=1024, strategy="tensor")
    stage = chosen.stages[0]
    with_ep = Plan(
        chosen.model,
        chosen.strategy,
        (Stage(stage.start_layer, stage.end_layer, stage.nodes, stage.bytes, ("10.0.0.1", "fe80::1")),),
    )
    assert plan_from_pb(plan_to_pb(with_ep, "c"), p.num_layers) == with_ep
    assert Plan.from_dict(json.loads(json.dumps(with_ep.to_dict()))) == with_ep
    for endpoints in (("10.0.0.1",), ("10.0.0.1", "not-an-ip"), ("10.0.0.1", "10.0.0.2:80")):
        msg = plan_to_pb(with_ep, "c")
        del msg.stages[0].endpoints[:]
        msg.stages[0].endpoints.extend(endpoints)
        with pytest.raises(ValueError, match="endpoints"):
            plan_from_pb(msg, p.num_layers)
    msg = plan_to_pb(with_ep, "c")
    msg.stages[0].nodes.append("a")
    with pytest.raises(ValueError, match="repeated"):
        plan_from_pb(msg, p.num_layers)


def test_the_all_reduce_machinery_prices_tensor_out_of_small_layers_only():
    """0.2 ms per all-reduce (what mx.distributed's ring costs on a Linux CPU box) outweighs
    halving a 0.1 ms layer, not halving a 10 ms one."""
    link = {("a", "b"): LinkSpec(rtt_s=20e-6, bandwidth_Bps=1e9, overhead_s=600e-6)}
    for layer_s, expected in ((1e-4, "single"), (1e-2, "tensor")):
        p = shaped(n=8)
        nodes = [NodeSpec(x, 64 * GiB, layer_seconds=layer_s, collective_s=200e-6) for x in "ab"]
        free = [NodeSpec(x, 64 * GiB, layer_seconds=layer_s) for x in "ab"]
        chosen = plan(p, nodes, max_context=1024, links=link)
        assert chosen.strategy == expected, chosen.reason
        grouped = plan(p, nodes, max_context=1024, links=link, strategy="tensor")
        assert grouped.estimate_s - plan(
            p, free, max_context=1024, links=link, strategy="tensor"
        ).estimate_s == pytest.approx((2 * 8 + 1) * 200e-6)  # two per layer, and the step's hand-off


# ---- models from peers: placements that reuse the layers nodes hold on disk ----


@PROPS
@given(cases(), st.data())
def test_a_replan_with_what_nodes_hold_fetches_nothing(case, data):
    """Where the nodes of a previous plan hold exactly its stages on disk, planning again with
    those holdings (no current plan to prefer, nodes listed in any order) reuses them all."""
    from meshnode.planner import bytes_to_fetch

    p, nodes, ctx = case
    try:
        first = plan(p, nodes, max_context=ctx, strategy="pipeline")
    except PlanError:
        return
    held = {s.nodes[0]: frozenset(range(s.start_layer, s.end_layer)) for s in first.stages}
    again = plan(p, data.draw(st.permutations(nodes)), max_context=ctx, strategy="pipeline", held=held)
    check_valid(p, nodes, again, ctx)
    assert len(again.stages) == len(first.stages)  # holdings never cost a node more
    assert sum(bytes_to_fetch(p, again, held).values()) == 0


@PROPS
@given(cases(), st.data())
def test_holdings_never_change_how_many_nodes_a_plan_uses(case, data):
    p, nodes, ctx = case
    ids = [x.node_id for x in nodes]
    held = {
        i: frozenset(data.draw(st.lists(st.integers(0, p.num_layers - 1), max_size=p.num_layers)))
        for i in data.draw(st.lists(st.sampled_from(ids), unique=True))
    }
    try:
        base = plan(p, nodes, max_context=ctx, strategy="pipeline")
    except PlanError:
        with pytest.raises(PlanError):
            plan(p, nodes, max_context=ctx, strategy="pipeline", held=held)
        return
    with_held = plan(p, nodes, max_context=ctx, strategy="pipeline", held=held)
    check_valid(p, nodes, with_held, ctx)
    assert len(with_held.stages) == len(base.stages)


def test_the_node_holding_the_first_layers_gets_the_first_stage():
    from meshnode.planner import bytes_to_fetch

    p = profile([100] * 6, embed=10, head=10)
    nodes = [NodeSpec("a", 500), NodeSpec("b", 500), NodeSpec("c", 500)]
    held = {"c": frozenset(range(0, 3)), "b": frozenset(range(3, 6))}
    result = plan(p, nodes, max_context=1, strategy="pipeline", held=held)
    assert [s.nodes[0] for s in result.stages] == ["c", "b"]
    assert bytes_to_fetch(p, result, held) == {"c": 0, "b": 0}
    without = plan(p, nodes, max_context=1, strategy="pipeline")
    assert sum(bytes_to_fetch(p, without, held).values()) > 0


@PROPS
@given(cases())
def test_holdings_alike_on_every_node_change_nothing(case):
    """Where every node holds the same layers (every machine has the whole model), holdings
    express no preference: the plan is the one made without them."""
    p, nodes, ctx = case
    everything = {x.node_id: frozenset(range(p.num_layers)) for x in nodes}
    try:
        base = plan(p, nodes, max_context=ctx)
    except PlanError:
        return
    assert plan(p, nodes, max_context=ctx, held=everything) == base


def test_quantized_tensor_groups_keep_whole_quantization_groups():
    from dataclasses import replace as _replace

    from meshnode.planner import group_size_problem
    from meshnode.weights.profile import ModelProfile

    base = ModelProfile(
        name="q",
        model_type="deepseek_v3",
        num_layers=4,
        layer_bytes=(1,) * 4,
        embed_bytes=1,
        head_bytes=1,
        norm_bytes=1,
        tied_embeddings=False,
        kv_bytes_per_token=(1,) * 4,
        sliding_window=(None,) * 4,
        hidden_size=2048,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        intermediate_size=11008,
        num_experts=64,
        vocab_size=1000,
        dtype="bfloat16",
        moe_intermediate_size=1408,
        quant_group_size=64,
    )
    assert group_size_problem(base, 2) is None  # 5504 and 704 inputs: whole groups of 64
    problem = group_size_problem(base, 4)  # 1408 / 4 = 352 = 5.5 groups
    assert problem and "quantization groups" in problem and "expert size 1408 / 4" in problem
    assert group_size_problem(_replace(base, quant_group_size=0), 4) is None
    assert "expert intermediate size 1408" in group_size_problem(_replace(base, moe_intermediate_size=1408), 3)
    assert "no tensor-parallel" in group_size_problem(_replace(base, model_type="minimax"), 2)


def test_a_jittery_link_loses_to_a_steadier_one_with_a_worse_median():
    """The home lab's case: peer b is 4 ms +- 4 ms away (median 4 ms; p10-p90 0.8-7.2 ms, as a
    uniform 0-8 ms wanders), c a steady 5 ms. A token waits for each hop at its slow moments, so
    the plan that takes c wins, though b's median is lower; with b steady, b wins."""
    p = shaped(n=8)
    nodes = [NodeSpec(x, int(1.6 * GiB), layer_seconds=5e-4) for x in "abc"]  # a and one peer hold it
    steady_c = LinkSpec(rtt_s=5e-3, bandwidth_Bps=100e6)
    for jitter_b, partner in ((6.4e-3, "c"), (0.0, "b")):
        b = LinkSpec(rtt_s=4e-3, bandwidth_Bps=100e6, jitter_s=jitter_b)
        links = {("a", "b"): b, ("a", "c"): steady_c, ("b", "c"): LinkSpec(rtt_s=9e-3, bandwidth_Bps=100e6)}
        chosen = plan(p, nodes, max_context=512, links=links, strategy="pipeline", preferred=("a",))
        assert sorted(n for s in chosen.stages for n in s.nodes) == sorted(["a", partner]), (jitter_b, chosen)
    assert b.tail_rtt_s == b.rtt_s and LinkSpec(4e-3, 1e8, jitter_s=6.4e-3).tail_rtt_s == pytest.approx(8.096e-3)


def test_the_steadier_address_of_a_peer_is_its_best():
    """Ethernet and Wi-Fi to one Mac: the Wi-Fi address with the lower median but a wide spread loses."""
    from meshnode.control.links import LinkStat, best

    wifi = LinkStat("b", "192.168.1.20", rtt_us=3000, jitter_us=9000, bandwidth=50e6, measured_at=0)
    wired = LinkStat("b", "10.0.0.20", rtt_us=4000, jitter_us=200, bandwidth=50e6, measured_at=0)
    assert best([wifi, wired]) is wired
    assert best([dataclasses.replace(wifi, jitter_us=200), wired]).address == "192.168.1.20"


def test_a_plan_to_resume_on_forms_no_tensor_group():
    """After a loss the coordinator asks for a plan that loads without forming a group
    (``grouped=False``); the faster tensor plan is weighed again after the dwell."""
    p = shaped(model_type="qwen3_moe", experts=8)
    nodes = [NodeSpec(x, 16 * GiB, layer_seconds=5e-4) for x in "ab"]
    links = link_all("ab", 20e-6)
    assert plan(p, nodes, max_context=1024, links=links).strategy == "tensor"
    resumed = plan(p, nodes, max_context=1024, links=links, grouped=False)
    assert resumed.strategy in ("single", "pipeline")


def test_beyond_the_exact_search_a_wired_pair_beats_the_biggest_nodes_on_wifi():
    """Ten machines, the model on any two of the four big ones: the biggest and the fastest is on
    Wi-Fi (6 ms round trips), the other three are wired. Past the exact search the planner still
    weighs every pair, so it serves two wired nodes, not the first two by budget or by speed."""
    p = shaped(n=8)
    need = p.total_bytes(1024)
    wired = LinkSpec(rtt_s=300e-6, bandwidth_Bps=100e6)
    wifi = LinkSpec(rtt_s=6e-3, bandwidth_Bps=20e6, jitter_s=3e-3)
    big = [NodeSpec("wifi", need, layer_seconds=1.0e-3)] + [
        NodeSpec(f"wired{i}", need * 6 // 10, layer_seconds=1.1e-3) for i in range(3)
    ]
    small = [NodeSpec(f"small{i}", need // 10, layer_seconds=1.2e-3) for i in range(6)]
    nodes = big + small
    links = {
        (a.node_id, b.node_id): wifi if "wifi" in (a.node_id, b.node_id) else wired
        for a, b in itertools.combinations(nodes, 2)
    }
    chosen = plan(p, nodes, max_context=1024, strategy="pipeline", links=links)
    assert "wifi" not in chosen.node_ids() and len(chosen.node_ids()) == 2, chosen.stages
