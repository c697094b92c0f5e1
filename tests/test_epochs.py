"""One plan per epoch (issue 10): the epoch rule of meshnode.control.epochs under injected interleavings.

Each simulated node holds the real ``EpochState`` and elects with the real
``choose_coordinator``; the test owns the clock and the message queue, so every ordering of
heartbeats, Installs and refusals it picks is replayed exactly. Control ticks mirror
``ControlPlane.tick``/``_coordinate``: the elected coordinator publishes when it has no plan, when the
members changed, or when its epoch is contested. What must hold, whatever the order: a node's
epoch never goes back, and once the messages are delivered every node holds the same plan (one
epoch, one coordinator, every member) under a number no other plan it ever held had.
The same on real namespace hosts: test_faults.py
(test_nodes_that_planned_alone_under_one_epoch_meet_and_settle_on_one_plan).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from meshnode.control.election import Candidate, choose_coordinator
from meshnode.control.epochs import EpochState, Published


@dataclass(frozen=True)
class Plan:
    epoch: int
    coordinator: str
    members: frozenset


class SimNode:
    def __init__(self, node_id: str, started_at: float, grace: float):
        self.id, self.started_at = node_id, started_at
        self.state = EpochState(grace=grace)
        self.plan: Plan | None = None
        self.hears: set[str] = set()
        self.alive_node = True
        self.history: list[Plan] = []  # every plan it adopted, in order

    def alive(self) -> frozenset:
        return frozenset(self.hears | {self.id})

    def adopt(self, plan: Plan) -> None:
        assert plan.epoch > (self.plan.epoch if self.plan else 0), f"{self.id}'s epoch went back"
        self.plan = plan
        self.state.adopted(plan.epoch, plan.coordinator)
        self.history.append(plan)


class Sim:
    def __init__(self, nodes: dict[str, float], grace: float = 0.0):
        self.nodes = {nid: SimNode(nid, t, grace) for nid, t in nodes.items()}
        self.queue: list[tuple] = []
        self.now = 0.0
        self.published: dict[int, set[Plan]] = {}  # epoch -> every plan published under it
        self.publications = 0

    def connect(self, *groups) -> None:
        """Who hears whom: each group is fully connected, groups do not hear each other."""
        for n in self.nodes.values():
            n.hears = set()
        for group in groups:
            for a in group:
                self.nodes[a].hears = set(group) - {a}

    def kill(self, nid: str) -> None:
        self.nodes[nid].alive_node = False
        self.queue = [m for m in self.queue if nid not in (m[1], m[2])]
        for n in self.nodes.values():
            n.hears.discard(nid)

    def tick(self, nid: str) -> None:
        """One control-loop round of ``nid``: heartbeats out, then coordinate (ControlPlane.tick)."""
        n = self.nodes[nid]
        if not n.alive_node:
            return
        for peer in sorted(n.hears):
            self.queue.append(("heartbeat", nid, peer, n.plan, n.state.epoch))
        alive = n.alive()
        if choose_coordinator(Candidate(x, self.nodes[x].started_at) for x in alive) != nid:
            return
        if not n.state.may_publish_first(self.now - n.started_at):
            return
        if n.plan is not None and n.plan.members == alive and not n.state.must_republish():
            return
        self.publications += 1
        plan = Plan(n.state.next_epoch(), nid, alive)
        self.published.setdefault(plan.epoch, set()).add(plan)
        n.adopt(plan)
        for peer in sorted(n.hears):
            self.queue.append(("install", nid, peer, plan, None))

    def deliver(self, i: int) -> None:
        kind, src, dst, plan, epoch = self.queue.pop(i)
        d = self.nodes[dst]
        if not d.alive_node:
            return
        if kind == "heartbeat":
            d.state.saw(epoch)
            if plan is not None and d.state.offered(plan.epoch, plan.coordinator, src):
                d.adopt(plan)
            if src in d.hears:  # the heartbeat's reply carries the receiver's plan back
                self.queue.append(("reply", dst, src, d.plan, d.state.epoch))
        elif kind == "reply":
            d.state.saw(epoch)
            if plan is not None and d.state.offered(plan.epoch, plan.coordinator, src):
                d.adopt(plan)
        elif kind == "install":
            if d.state.holds(plan.epoch, plan.coordinator):
                pass  # already brought by a heartbeat: accepted
            elif d.state.offered(plan.epoch, plan.coordinator, src):
                d.adopt(plan)
            else:
                self.queue.append(("refused", dst, src, plan, d.state.epoch))
        elif kind == "refused":
            d.state.refused(plan.epoch, epoch, src)

    def run(self, rng: random.Random, steps: int) -> None:
        """``steps`` random choices between delivering any queued message and ticking any node."""
        live = [nid for nid, n in self.nodes.items() if n.alive_node]
        for _ in range(steps):
            if self.queue and rng.random() < 0.7:
                self.deliver(rng.randrange(len(self.queue)))
            else:
                self.tick(rng.choice(live))
                self.now += 0.1

    def settle(self, rounds: int = 20) -> None:
        """Every node ticks and every message is delivered, until a round changes nothing."""
        live = sorted(nid for nid, n in self.nodes.items() if n.alive_node)

        def snapshot():
            return [(self.nodes[nid].plan, dict(vars(self.nodes[nid].state))) for nid in live]

        for _ in range(rounds):
            before = snapshot()
            for nid in live:
                self.tick(nid)
            self.now += 0.5
            while self.queue:
                self.deliver(0)
            if before == snapshot():
                return
        raise AssertionError("the mesh did not settle")

    def check_one_plan(self) -> Plan:
        live = [n for n in self.nodes.values() if n.alive_node]
        plans = {n.plan for n in live}
        assert len(plans) == 1, plans
        (plan,) = plans
        assert plan.members == frozenset(n.id for n in live)
        assert {n.state.held for n in live} == {Published(plan.epoch, plan.coordinator)}
        assert self.published[plan.epoch] == {plan}, f"epoch {plan.epoch} names two plans: {self.published}"
        return plan


def test_two_nodes_that_planned_alone_meet_in_every_order():
    """Started apart (each publishes epoch 1 for itself), then they hear each other: every
    ordering of the first exchange ends on one plan, numbered above both epoch-1 plans."""
    for order in itertools.permutations(range(6)):
        sim = Sim({"a": 0.0, "b": 0.5})
        sim.now = 1.0
        sim.tick("a")
        sim.tick("b")
        assert {p.coordinator for p in sim.published[1]} == {"a", "b"}
        sim.connect({"a", "b"})
        sim.tick("a")
        sim.tick("b")
        sim.tick("a")  # a second round: more messages in flight
        for i in order:  # deliver the first messages in this order (those left go after)
            if sim.queue:
                sim.deliver(min(i, len(sim.queue) - 1))
        sim.settle()
        plan = sim.check_one_plan()
        assert plan.coordinator == "a" and plan.epoch >= 2


def test_a_new_coordinator_that_missed_the_last_plan_never_leaves_two_plans_under_one_epoch():
    """The coordinator installs epoch N+1 on one node and dies before the others hear of it; the
    next coordinator, elected before or after that node's heartbeat reaches it, may publish N+1
    too. The refusal or the heartbeat marks N+1 contested and the new coordinator publishes
    above it: one plan, every order."""
    for seed in range(300):
        rng = random.Random(seed)
        sim = Sim({"c": 0.0, "d": 1.0, "x": 2.0, "y": 3.0})
        sim.now = 4.0
        sim.connect({"c", "d", "x", "y"})
        sim.settle()
        first = sim.check_one_plan()
        # y leaves; c plans {c, d, x} and reaches only x before dying
        sim.kill("y")
        sim.tick("c")
        installs = [i for i, m in enumerate(sim.queue) if m[0] == "install" and m[2] == "x"]
        sim.deliver(installs[0])
        sim.kill("c")
        sim.run(rng, rng.randrange(0, 30))
        sim.settle()
        plan = sim.check_one_plan()
        assert plan.coordinator == "d" and plan.epoch > first.epoch + 1


@pytest.mark.parametrize("seed", range(40))
def test_partitions_that_heal_settle_on_one_plan(seed):
    """Two halves each elect and publish, for a while, then heal: random interleavings of
    everything in flight, one plan at the end, and no node's epoch ever went back."""
    rng = random.Random(seed)
    sim = Sim({"a": 0.0, "b": 1.0, "c": 2.0, "d": 3.0, "e": 4.0})
    sim.now = 5.0
    sim.connect({"a", "b", "c", "d", "e"})
    sim.settle()
    sim.connect({"a", "b"}, {"c", "d", "e"})
    sim.run(rng, rng.randrange(5, 60))
    sim.connect({"a", "b", "c", "d", "e"})
    sim.run(rng, rng.randrange(5, 60))
    sim.settle()
    assert sim.check_one_plan().coordinator == "a"


def test_nodes_started_together_publish_one_first_plan():
    """Rule 4: nodes that start together and hear each other within the grace period never
    publish two epoch-1 plans (without it, each would publish one for itself, and they would have
    to settle)."""
    sim = Sim({"a": 0.0, "b": 0.0, "c": 0.05}, grace=1.0)
    for _ in range(3):  # 0.3 s alone: nobody publishes
        for nid in "abc":
            sim.tick(nid)
        sim.now += 0.1
    assert not sim.published
    sim.connect({"a", "b", "c"})  # mDNS found everyone
    while sim.now < 1.5:
        for nid in "abc":
            sim.tick(nid)
        while sim.queue:
            sim.deliver(0)
        sim.now += 0.25
    assert {e: {p.coordinator for p in ps} for e, ps in sim.published.items()} == {1: {"a"}}
    sim.settle()
    assert sim.check_one_plan().epoch == 1


@pytest.mark.parametrize("seed", range(30))
def test_a_stable_mesh_publishes_once_whatever_the_order_of_heartbeats_and_installs(seed):
    """Nothing contested, nothing changed: the coordinator's plan reaches some nodes by heartbeats
    (relayed by other nodes) before its Install does. The Install of a plan a node already holds is
    accepted; were it refused, the coordinator would take its own plan for a contested one and
    publish again and again, one epoch after another with one layout."""
    rng = random.Random(seed)
    sim = Sim({"a": 0.0, "b": 1.0, "c": 2.0, "d": 3.0})
    sim.now = 4.0
    sim.connect({"a", "b", "c", "d"})
    sim.tick("a")  # a publishes epoch 1 for everyone
    for _ in range(200):  # everything else in random order, relays included
        if sim.queue and rng.random() < 0.7:
            sim.deliver(rng.randrange(len(sim.queue)))
        else:
            sim.tick(rng.choice("abcd"))
    sim.settle()
    assert sim.check_one_plan().epoch == 1 and sim.publications == 1


def test_a_lone_node_still_publishes_after_the_grace():
    sim = Sim({"solo": 0.0}, grace=1.0)
    sim.tick("solo")
    assert sim.nodes["solo"].plan is None
    sim.now = 1.0
    sim.tick("solo")
    assert sim.nodes["solo"].plan == Plan(1, "solo", frozenset({"solo"}))


def test_a_refused_install_of_the_same_epoch_marks_it_contested():
    state = EpochState()
    state.adopted(6, "d")
    state.refused(6, 6, "x")  # x holds another plan under 6
    assert state.must_republish() and state.next_epoch() == 7
    other = EpochState()
    other.adopted(6, "d")
    other.refused(6, 9, "x")  # x is just ahead: a newer plan exists, nothing contested
    assert not other.must_republish() and other.next_epoch() == 10


def test_an_invalid_plans_epoch_is_not_taken_before_the_plan_is_adopted():
    """An Install of an invalid plan numbered 2**64 - 1 (as tests/test_fuzz.py sends) does not count
    toward the next epoch, which would overflow the wire's uint64 (an exception in the handler)."""
    state = EpochState()
    state.adopted(3, "a")
    assert not state.offered(2**64 - 1, "fuzzer", "fuzzer")  # too large to be real
    assert state.offered(9, "b", "b") and state.next_epoch() == 4  # not adopted yet: not counted
    state.saw(2**64 - 1)
    assert state.next_epoch() == 4


def test_a_node_that_withdrew_the_plan_alone_takes_it_back_from_its_coordinator():
    """A node cut off alone becomes coordinator, finds that no plan fits on it and withdraws epoch
    23; when its link comes back the mesh still holds epoch 23 (no one had to re-plan: the node was
    not in it), so by rule 1 alone the node would never adopt it again and would answer 503 until
    the next epoch."""
    state = EpochState()
    state.adopted(23, "h2")
    state.withdraw()
    assert state.held is None and state.epoch == 23
    assert not state.offered(23, "h2", "h0")  # a peer cut off with it: not from the coordinator
    assert not state.offered(23, "h9", "h9")  # another plan under that number: never
    assert not state.offered(22, "h2", "h2")  # an older one: never
    assert state.offered(23, "h2", "h2")  # the plan it dropped, from its coordinator
    state.adopted(23, "h2")
    assert state.held == Published(23, "h2") and state.next_epoch() == 24
    assert not state.offered(23, "h2", "h2")  # held again: nothing to take back
