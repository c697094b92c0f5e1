"""A node's pace (meshnode.model.pace): timed steps and probes in, a slowdown out only once it has
held for the dwell, and the coordinator planning with it."""

from __future__ import annotations

import pytest

from meshnode.control.coordinator import node_specs, slow_notes
from meshnode.model.pace import NORMAL, PROBE_GAP_S, WINDOW_S, Pace, Probe
from meshnode.nodeinfo import NodeInfo


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def pace(factor: float = 2.0, dwell: float = 10.0) -> tuple[Pace, Clock]:
    clock = Clock()
    p = Pace(factor, dwell, clock=clock, wall=lambda: 1_700_000_000.0 + clock.t)
    return p, clock


def run(p: Pace, clock: Clock, seconds: float, step_s: float, *, every: float = 0.5):
    """Steps of 4 ms of CPU work taking ``step_s`` each, ``every`` seconds for ``seconds``, judged
    after each; the changes announced."""
    changes = []
    end = clock.t + seconds
    while clock.t < end:
        clock.t += every
        p.observe("layers 0-4", step_s, min(step_s, 0.004))
        if (c := p.update()) is not None:
            changes.append((clock.t, c))
    return changes


def test_steps_as_fast_as_measured_announce_nothing():
    p, clock = pace()
    assert run(p, clock, 60, 0.0045) == []  # 1.1x the estimate: noise
    assert p.reported == NORMAL


def test_a_spike_shorter_than_the_dwell_moves_nothing():
    p, clock = pace()
    # 10x for 6 s of a 10 s dwell: the window's median stays up half a window longer.
    assert run(p, clock, 10 - WINDOW_S / 2 - 1, 0.04) == []
    assert run(p, clock, 20, 0.004) == []
    assert p.reported == NORMAL


def test_a_slowdown_that_holds_is_announced_after_the_dwell_with_its_start():
    p, clock = pace()
    t0 = clock.t
    changes = run(p, clock, 30, 0.04)
    assert len(changes) == 1, changes
    at, slowdown = changes[0]
    assert 10 <= at - t0 <= 11
    assert slowdown.factor == pytest.approx(10.0)
    assert slowdown.since == pytest.approx(1_700_000_000.0 + t0, abs=1.0)


def test_while_slow_a_much_larger_slowdown_is_told_and_a_small_change_is_not():
    p, clock = pace()
    run(p, clock, 30, 0.04)
    since = p.reported.since
    assert run(p, clock, 20, 0.05) == []  # 12.5x against 10x told: within REPORT_CHANGE
    changes = run(p, clock, 20, 0.2)
    assert [c.factor for _, c in changes] == [50.0]
    assert changes[0][1].since == since  # the same slowdown, worse


def test_recovery_needs_the_dwell_and_hysteresis_so_it_does_not_flap():
    p, clock = pace()
    run(p, clock, 30, 0.04)
    # 1.5x is under the factor but above factor * RECOVER: still reported slow, the figure updated.
    changes = run(p, clock, 60, 0.006)
    assert all(c.slow for _, c in changes) and p.reported.slow
    changes = run(p, clock, 30, 0.004)
    assert [c for _, c in changes] == [NORMAL]


def test_a_node_with_no_steps_asks_for_a_probe_and_is_judged_by_it():
    p, clock = pace()
    assert p.needs_probe()
    p.observe("layers 0-4", 0.004, 0.004)
    assert not p.needs_probe()
    clock.t += PROBE_GAP_S
    assert p.needs_probe()
    changes = []
    for _ in range(30):
        clock.t += 1
        p.sample(8.0)
        if (c := p.update()) is not None:
            changes.append(c)
    assert [c.factor for c in changes] == [8.0]


def test_no_sample_is_no_judgement():
    p, clock = pace()
    run(p, clock, 30, 0.04)
    clock.t += 600  # nothing served, nothing probed: the slowdown stands
    assert p.update() is None and p.reported.slow


def test_a_node_throttled_from_its_first_step_is_judged_by_its_cpu_time():
    p, clock = pace()
    changes = run(p, clock, 30, 0.04)  # never once as fast as its CPU time says it could be
    assert [c.factor for _, c in changes] == [10.0]


def test_kinds_of_step_are_timed_apart():
    p, clock = pace()
    for _ in range(60):  # a short stage and a long one, each at its own speed
        clock.t += 0.5
        p.observe("layers 0-2", 0.002, 0.002)
        p.observe("layers 2-8", 0.006, 0.006)
    assert p.current() == pytest.approx(1.0)


def test_the_probe_is_timed_against_the_fastest_it_ran():
    probe = Probe()
    ratios = [probe() for _ in range(4)]
    assert all(r >= 1.0 for r in ratios), ratios  # the run itself counts toward the fastest


def info(nid: str, slowdown: float = 1.0, since: float = 0.0) -> NodeInfo:
    return NodeInfo(
        node_id=nid,
        addresses=("10.0.0.1",),
        http_port=1,
        grpc_port=2,
        memory_budget=2**30,
        total_memory=2**31,
        compute=100.0,
        version="x",
        cluster_id="c",
        models=("m",),
        layer_seconds=0.001,
        slowdown=slowdown,
        slow_since=since,
    )


def test_the_coordinator_plans_a_slow_node_at_its_measured_pace_and_says_so():
    alive = {"n1": info("n1"), "n2": info("n2", 5.0, 1_700_000_000.0)}
    specs = {s.node_id: s for s in node_specs(alive, "m")}
    assert specs["n1"].layer_seconds == pytest.approx(0.001)
    assert specs["n2"].layer_seconds == pytest.approx(0.005)
    assert specs["n2"].compute == pytest.approx(20.0)
    note = slow_notes(alive)
    assert note.startswith("n2 runs at 0.2x its measured speed since ") and "n1" not in note
