"""The plan_layout setting pins a plan to named stages (benchmarks/homelab.py forces each
alternative the planner lists this way): the layout text, the pinned plan's estimate and checks."""

from __future__ import annotations

import pytest

from meshnode.config import ConfigError, load_settings
from meshnode.planner import LinkSpec, NodeSpec, PlanError, plan
from meshnode.planner.pinned import pinned_plan
from meshnode.values import layout_units, plan_layout
from meshnode.weights.profile import ModelProfile

PROFILE = ModelProfile(
    name="m",
    model_type="llama",
    num_layers=8,
    layer_bytes=(1000,) * 8,
    embed_bytes=100,
    head_bytes=100,
    norm_bytes=1,
    tied_embeddings=False,
    kv_bytes_per_token=(1,) * 8,
    sliding_window=(None,) * 8,
    hidden_size=8,
    num_heads=2,
    num_kv_heads=2,
    head_dim=4,
    intermediate_size=16,
    num_experts=0,
    vocab_size=10,
    dtype="float32",
)
NODES = [
    NodeSpec("a", 6000, layer_seconds=1e-3),
    NodeSpec("b", 6000, layer_seconds=2e-3),
    NodeSpec("c", 4500, layer_seconds=1e-3),
    NodeSpec("d", 3000, layer_seconds=1e-3),
]
LINKS = {(x, y): LinkSpec(rtt_s=2e-3, bandwidth_Bps=50e6) for x in "abcd" for y in "abcd" if x != y}


def test_a_layout_reads_as_the_planner_writes_it():
    assert layout_units("0-3@a | 4-7@b+c") == ((("a",), 0, 4), (("b", "c"), 4, 8))
    assert plan_layout(" 0-3@a|4-7@b + c ") == "0-3@a | 4-7@b+c"
    for bad in ("", "0-3", "a@0-3", "0-3@", "0-x@a", "0-3@a+"):
        with pytest.raises(ValueError):
            layout_units(bad)


def test_the_setting_comes_from_the_environment_and_is_checked():
    assert load_settings(env={"MESHNODE_PLAN_LAYOUT": "0-7@a"}).plan_layout == "0-7@a"
    assert load_settings(env={"MESHNODE_PLAN_LAYOUT": ""}).plan_layout is None
    with pytest.raises(ConfigError, match="(?i)plan_layout"):
        load_settings(env={"MESHNODE_PLAN_LAYOUT": "a then b"})


def test_each_alternative_pinned_is_the_plan_and_estimate_the_planner_listed():
    chosen = plan(PROFILE, NODES, max_context=16, links=LINKS)
    listed = [a for a in chosen.alternatives if a["feasible"]]
    assert listed
    for alt in listed:
        pinned = pinned_plan(PROFILE, NODES, alt["stages"], max_context=16, links=LINKS)
        assert pinned.strategy == alt["strategy"]
        assert pinned.estimate_s == pytest.approx(alt["estimate_s"])
        assert "pinned by plan_layout" in pinned.reason
    layout = " | ".join(f"{s.start_layer}-{s.end_layer - 1}@{'+'.join(s.nodes)}" for s in chosen.stages)
    again = pinned_plan(PROFILE, NODES, layout, max_context=16, links=LINKS)
    assert again.estimate_s == pytest.approx(chosen.estimate_s)
    assert again.stages == chosen.stages


@pytest.mark.parametrize(
    ("layout", "why"),
    [
        ("0-3@a | 4-7@x", "not among the nodes"),
        ("0-3@a | 5-7@b", "does not tile"),
        ("0-3@a | 4-7@a", "names a node twice"),
        ("0-5@d | 6-7@a", "d offers"),
        ("0-7@a+b+c", "3 does not divide"),
    ],
)
def test_a_layout_that_cannot_be_served_is_refused_with_why(layout, why):
    with pytest.raises(PlanError, match=why):
        pinned_plan(PROFILE, NODES, layout, max_context=16, links=LINKS)
