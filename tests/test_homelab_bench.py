"""The arithmetic of benchmarks/homelab.py, apart from its namespaces: the lab's table, the
percentiles and regret it reports, and the planner inputs it times (no timed assertion)."""

from __future__ import annotations

import pytest

from benchmarks.homelab_lab import (
    LAB,
    alternatives,
    gaps,
    layout_of,
    percentile,
    period_us,
    planner_inputs,
    regret,
    scaled_figures,
    table,
    to_force,
)
from meshnode.values import layout_units


def test_the_table_is_a_lab_of_six_to_ten_distinct_hosts_that_no_one_of_holds_the_model():
    assert 6 <= len(LAB) <= 10
    assert len({h.name for h in LAB}) == len(LAB)
    assert all(0 < h.budget < 1 and 0 < h.quota <= 1 and h.jitter_ms <= max(h.delay_ms, 0.0) for h in LAB)
    # the smaller labs (the first 3 and 6 hosts) still hold it on two or three of them
    for n in (3, 6, 10):
        best = sorted((h.budget for h in LAB[:n]), reverse=True)
        assert best[0] + best[1] >= 1.05


def test_percentiles_interpolate_as_numpy_does():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 95) == pytest.approx(95.0)
    assert percentile([], 50) != percentile([], 50)  # nan


def test_gaps_and_regret():
    assert gaps([0.0, 0.1, 0.3]) == pytest.approx([0.1, 0.2])
    assert regret(10.0, [12.0, 15.0]) == 0.0
    assert regret(11.0, [10.0, 20.0]) == pytest.approx(0.1)
    assert regret(10.0, []) == 0.0


def test_layouts_read_back_as_the_setting_takes_them():
    plan = {
        "stages": [
            {"start_layer": 0, "end_layer": 5, "nodes": ["a"]},
            {"start_layer": 5, "end_layer": 8, "nodes": ["b", "c"]},
        ],
        "alternatives": [
            {"strategy": "tensor", "stages": "0-7@a+b", "feasible": True},
            {"strategy": "single", "stages": "", "feasible": False},
        ],
    }
    assert layout_of(plan) == "0-4@a | 5-7@b+c"
    assert layout_units(layout_of(plan)) == ((("a",), 0, 5), (("b", "c"), 5, 8))
    assert [a["strategy"] for a in alternatives(plan)] == ["tensor"]


def test_quotas_become_1_ms_slices_and_slower_figures():
    assert period_us(0.5) == 2000 and period_us(1.0) == 1000 and period_us(0.25) == 4000
    assert scaled_figures({"k": 0.002, "k-tp2": 0.001, "v": "x"}, 0.5) == {"k": 0.004, "k-tp2": 0.002, "v": "x"}


def test_planner_inputs_follow_the_table():
    nodes, links = planner_inputs(LAB[:3], 1000, 1e-3, 1e-4)
    assert [n.memory_budget for n in nodes] == [int(1000 * h.budget) for h in LAB[:3]]
    assert nodes[0].layer_seconds == pytest.approx(1e-3 / LAB[0].quota)
    assert len(links) == 6
    wired, wifi = links[(nodes[0].node_id, nodes[1].node_id)], links[(nodes[0].node_id, nodes[2].node_id)]
    assert wifi.rtt_s > wired.rtt_s and wifi.jitter_s > wired.jitter_s == 0.0


def test_a_table_is_markdown():
    assert table(["a", "b"], [[1, 2]]).splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |"]


def test_the_plans_to_force_are_the_listed_and_the_fresh_ones_once_without_the_served():
    def plan(layout: str, alts: list[tuple[str, str]], strategy: str = "pipeline") -> dict:
        stages = []
        for part in layout.split(" | "):
            span, nodes = part.split("@")
            first, last = span.split("-")
            stages.append({"start_layer": int(first), "end_layer": int(last) + 1, "nodes": nodes.split("+")})
        return {
            "strategy": strategy,
            "estimate_s": 0.01,
            "stages": stages,
            "alternatives": [{"strategy": s, "stages": lay, "estimate_s": 0.02, "feasible": True} for s, lay in alts],
        }

    served = plan("0-3@a | 4-7@b", [("pipeline", "0-3@b | 4-7@a"), ("tensor", "0-7@a+b")])
    now = plan("0-3@c | 4-7@b", [("pipeline", "0-3@a | 4-7@b"), ("tensor", "0-7@a+b")])
    rows = to_force(served, now, plan("0-3@d | 4-7@c", []))
    assert [(r["layout"], r["sources"]) for r in rows] == [
        ("0-3@b | 4-7@a", ["listed"]),
        ("0-7@a+b", ["listed", "now"]),
        ("0-3@c | 4-7@b", ["now"]),
        ("0-3@d | 4-7@c", ["every subset"]),
    ]
    assert len(to_force(served, now, plan("0-3@a | 4-7@b", []))) == 3  # the served one is not forced
    assert rows[0]["listed_estimate_ms"] == 20.0 and "listed_estimate_ms" not in rows[2]
    assert "\\|" in table(["stages"], [["0-3@a | 4-7@b"]])
