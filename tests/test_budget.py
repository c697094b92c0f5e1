"""The memory a node offers (meshnode.control.budget) as the machine takes it back and gives it
again, and the coordinator re-planning a plan that no longer fits what its nodes offer."""

from __future__ import annotations

from meshnode.control.budget import LOWER_TO, Budget
from meshnode.control.coordinator import squeezed
from meshnode.nodeinfo import NodeInfo
from meshnode.planner.plans import Plan, Stage

GIB = 2**30


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def budget(configured: int = 10 * GIB) -> tuple[Budget, Clock]:
    clock = Clock()
    return Budget(configured, margin=GIB, dwell=30.0, clock=clock), clock


def test_room_for_the_offer_changes_nothing():
    b, _ = budget()
    assert b.update(held=8 * GIB, available=8 * GIB) is None  # room 15 GiB for an offer of 10
    assert b.update(held=8 * GIB, available=3 * GIB + 1) is None  # exactly room for it
    assert b.offered == 10 * GIB


def test_memory_taken_back_lowers_the_offer_at_once_under_the_room_left():
    b, _ = budget()
    new = b.update(held=8 * GIB, available=2 * GIB)  # room: 8 + 2 - 1 = 9 GiB
    assert new == int(9 * GIB * LOWER_TO) and b.offered == new
    assert b.update(held=8 * GIB, available=2 * GIB) is None  # the same squeeze lowers it once


def test_an_offer_is_raised_only_after_the_room_has_lasted_the_dwell():
    b, clock = budget()
    b.update(held=2 * GIB, available=2 * GIB)  # lowered to 2.7 GiB
    for t in (0, 10, 29):
        clock.t = t
        assert b.update(held=2 * GIB, available=20 * GIB) is None
    clock.t = 31
    assert b.update(held=2 * GIB, available=20 * GIB) == 10 * GIB  # never above the configured budget


def test_a_room_that_does_not_last_starts_the_dwell_again():
    b, clock = budget()
    b.update(held=2 * GIB, available=2 * GIB)
    lowered = b.offered
    b.update(held=2 * GIB, available=20 * GIB)
    clock.t = 20
    b.update(held=2 * GIB, available=int(1.5 * GIB))  # gone again: no raise worth it
    clock.t = 40
    assert b.update(held=2 * GIB, available=20 * GIB) is None
    clock.t = 71
    assert b.update(held=2 * GIB, available=20 * GIB) == 10 * GIB
    assert lowered < 10 * GIB


def test_a_small_gain_is_not_worth_a_re_plan():
    b, clock = budget()
    b.update(held=4 * GIB, available=5 * GIB)  # room 8 GiB: offered 7.2
    before = b.offered
    for t in (0, 40, 80):
        clock.t = t
        assert b.update(held=4 * GIB, available=5 * GIB + GIB // 4) is None  # 0.2 GiB more room
    assert b.offered == before


def test_all_memory_taken_offers_nothing():
    b, _ = budget()
    assert b.update(held=0, available=GIB // 2) == 0


def info(nid: str, budget: int) -> NodeInfo:
    return NodeInfo(nid, ("10.0.0.1",), 1, 2, budget, 2 * budget, 1.0, "x", "c", models=("m",))


def test_a_plan_putting_more_on_a_node_than_it_offers_now_is_squeezed():
    plan = Plan(model="m", strategy="pipeline", stages=(Stage(0, 4, ("a",), 6 * GIB), Stage(4, 8, ("b",), 6 * GIB)))
    alive = {"a": info("a", 8 * GIB), "b": info("b", 8 * GIB)}
    assert squeezed(plan, alive, {}) == []
    assert squeezed(plan, alive, {"b": 3 * GIB}) == ["b"]  # another model's plan holds 3 GiB there
    alive["a"] = info("a", 5 * GIB)
    assert squeezed(plan, alive, {}) == ["a"]
