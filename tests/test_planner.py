"""The pure planner over many made-up clusters (hypothesis), checked against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from meshnode.control.planner import NodeSpec, PlanError, plan
from meshnode.data.profile import ModelProfile

GiB = 2**30


def profile(layer_bytes, embed=100, head=100, tied=False, kv=1, name="m"):
    n = len(layer_bytes)
    return ModelProfile(
        name=name, model_type="llama", num_layers=n, layer_bytes=tuple(layer_bytes), embed_bytes=embed,
        head_bytes=0 if tied else head, norm_bytes=1, tied_embeddings=tied, kv_bytes_per_token=(kv,) * n,
        sliding_window=(None,) * n, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
        intermediate_size=16, num_experts=0, vocab_size=10, dtype="float32")


def fits(p, order, ctx) -> bool:
    """Brute force: is there any contiguous split of the layers over nodes in this order?"""
    k, n = len(order), p.num_layers
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        if all(p.stage_bytes(edges[i], edges[i + 1], ctx) <= order[i].memory_budget for i in range(k)):
            return True
    return False


def min_nodes(p, nodes, ctx):
    for k in range(1, len(nodes) + 1):
        for subset in itertools.combinations(nodes, k):
            if any(fits(p, order, ctx) for order in itertools.permutations(subset)):
                return k
    return None


clusters = st.lists(st.integers(50, 3000), min_size=1, max_size=4).map(
    lambda bs: [NodeSpec(f"n{i}", b) for i, b in enumerate(bs)])
profiles = st.builds(
    profile,
    st.lists(st.integers(10, 400), min_size=1, max_size=9),
    embed=st.integers(0, 300), head=st.integers(0, 300), tied=st.booleans(), kv=st.integers(0, 2))


@settings(max_examples=400, deadline=None)
@given(profiles, clusters, st.integers(1, 64))
def test_plans_are_valid_minimal_and_errors_are_true(p, nodes, ctx):
    best = min_nodes(p, nodes, ctx)
    try:
        result = plan(p, nodes, max_context=ctx)
    except PlanError as exc:
        assert best is None, f"planner missed a fit with {best} nodes: {exc}"
        assert exc.reasons and str(exc)
        return
    budgets = {n.node_id: n.memory_budget for n in nodes}
    edges = [(s.start_layer, s.end_layer) for s in result.stages]
    assert edges[0][0] == 0 and edges[-1][1] == p.num_layers
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(edges, edges[1:]))
    for s in result.stages:
        assert len(s.nodes) == 1
        assert p.stage_bytes(s.start_layer, s.end_layer, ctx) == s.bytes <= budgets[s.nodes[0]]
    used = result.node_ids()
    assert len(set(used)) == len(used) == best
    assert result.strategy == ("single" if best == 1 else "pipeline")
    # Deterministic, whatever order the nodes are listed in.
    assert plan(p, list(reversed(nodes)), max_context=ctx) == result


def test_one_machine_beats_two():
    p = profile([100] * 8)
    result = plan(p, [NodeSpec("big", 10**6), NodeSpec("small", 10**6 - 1)], max_context=4)
    assert result.strategy == "single" and result.node_ids() == ["big"]
    assert "alone" in result.reason


def test_layers_follow_budgets():
    p = profile([100] * 30, embed=0, head=0, kv=0)
    result = plan(p, [NodeSpec("a", 1000), NodeSpec("b", 1100), NodeSpec("c", 1200)], max_context=1)
    counts = {s.nodes[0]: s.end_layer - s.start_layer for s in result.stages}
    # 3000 bytes needed, no two nodes suffice; each fills about 91 % of its budget.
    assert counts == {"a": 9, "b": 10, "c": 11}


def test_preferred_nodes_keep_their_place():
    p = profile([100] * 10, embed=0, head=0, kv=0)
    nodes = [NodeSpec("a", 600), NodeSpec("b", 600), NodeSpec("c", 600)]
    assert set(plan(p, nodes, max_context=1).node_ids()) == {"a", "b"}
    assert set(plan(p, nodes, max_context=1, preferred=["b", "c"]).node_ids()) == {"b", "c"}


def test_error_messages_say_what_is_missing():
    p = profile([GiB] * 4, embed=0, head=0, kv=0)
    with pytest.raises(PlanError, match="short by"):
        plan(p, [NodeSpec("a", 2 * GiB)], max_context=1)
    with pytest.raises(PlanError, match="single layer"):
        plan(profile([5 * GiB, 1]), [NodeSpec("a", 4 * GiB), NodeSpec("b", 4 * GiB)], max_context=1)
    with pytest.raises(PlanError, match="duplicate"):
        plan(p, [NodeSpec("a", 1), NodeSpec("a", 1)], max_context=1)
    with pytest.raises(PlanError, match="no nodes"):
        plan(p, [], max_context=1)
    with pytest.raises(PlanError, match="unknown strategy"):
        plan(p, [NodeSpec("a", 10 * GiB)], max_context=1, strategy="magic")
    with pytest.raises(PlanError):
        plan(p, [NodeSpec("a", 10 * GiB)], max_context=1, strategy="pipeline")


def test_forced_pipeline_splits_even_when_one_fits():
    p = profile([100] * 6)
    result = plan(p, [NodeSpec("a", 10**6), NodeSpec("b", 10**6)], max_context=1, strategy="pipeline")
    assert result.strategy == "pipeline" and len(result.stages) == 2


def test_plan_round_trips_through_dict():
    p = profile([100] * 6)
    result = plan(p, [NodeSpec("a", 500), NodeSpec("b", 500)], max_context=1).with_epoch(7)
    from meshnode.control.planner import Plan
    assert Plan.from_dict(result.to_dict()) == result
