"""The coordinator's decisions for several models on one mesh (meshnode.control.plane), driven with
fake lanes and a fake clock: which model is unloaded to make room, when an idle one's keep-alive
runs out, when a model unloaded for want of room is tried again. Deterministic: no network, no
timing; each scenario states the mesh and checks what the coordinator asked of each lane."""

from __future__ import annotations

import pytest

from meshnode.config import Settings
from meshnode.control import plane as plane_module
from meshnode.control.plane import ControlPlane
from meshnode.control.settings import ControlSettings
from meshnode.nodeinfo import NodeInfo
from meshnode.planner.plans import UNLOADED, Plan, Stage
from meshnode.serving.usage import Use


class Clock:
    def __init__(self):
        self.wall, self.mono = 1_000_000.0, 100.0

    def time(self):
        return self.wall

    def monotonic(self):
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


class Served:
    def __init__(self, model: str, loaded: bool):
        self.model_id = model
        self.plan = (
            Plan(model=model, strategy="single", stages=(Stage(0, 2, ("a",), bytes=10),), epoch=1) if loaded else None
        )
        self.use = Use()

    def use_now(self) -> Use:
        return self.use


class Coordinator:
    """Records what the control loop asks; ``fits`` says whether a plan fits now."""

    def __init__(self, served: Served, log: list):
        self.served, self.log, self.fits, self.needs_room = served, log, True, False

    def coordinate(self, alive) -> None:
        self.log.append(("coordinate", self.served.model_id))
        self.needs_room = not self.fits
        if self.fits:
            self.served.plan = Plan(
                model=self.served.model_id, strategy="single", stages=(Stage(0, 2, ("a",)),), epoch=9
            )

    def unload(self, reason: str) -> None:
        self.log.append(("unload", self.served.model_id, reason))
        self.served.plan = Plan(model=self.served.model_id, strategy=UNLOADED, stages=(), reason=reason)


class Epochs:
    def may_publish_first(self, elapsed) -> bool:
        return True


class Lane:
    def __init__(self, model: str, loaded: bool, log: list):
        self.model_id = model
        self.served = Served(model, loaded)
        self.coordinator = Coordinator(self.served, log)
        self.adoption = type("Adoption", (), {"epochs": Epochs()})()


class Lanes:
    def __init__(self, lanes: list[Lane]):
        self._lanes = lanes
        self.primary = lanes[0]

    def __iter__(self):
        return iter(self._lanes)

    def get(self, model: str):
        return next((lane for lane in self._lanes if lane.model_id == model), None)


class Peers:
    membership = None


def _node(node_id: str, models: tuple[str, ...]) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        addresses=("10.0.0.1",),
        http_port=1,
        grpc_port=2,
        memory_budget=100,
        total_memory=200,
        compute=1.0,
        version="t",
        cluster_id="cluster",
        models=models,
    )


def _mesh(monkeypatch, loaded: dict[str, bool], keep_alive=None, nodes=("a", "b")):
    clock = Clock()
    monkeypatch.setattr(plane_module, "time", clock)
    log: list = []
    lanes = Lanes([Lane(m, is_loaded, log) for m, is_loaded in loaded.items()])
    settings = Settings(keep_alive=keep_alive or {"*": 0.0})
    cp = ControlPlane(ControlSettings.of(settings), "a", "cluster", 0.0, Peers(), lanes, event=lambda *a, **k: None)
    alive = {n: _node(n, tuple(loaded)) for n in nodes}
    return cp, lanes, log, clock, alive


def test_a_model_a_request_waits_for_makes_the_least_recently_used_idle_one_give_way(monkeypatch):
    cp, lanes, log, clock, alive = _mesh(monkeypatch, {"a": True, "b": True, "c": False})
    lanes.get("c").coordinator.fits = False
    cp._coordinate(alive, {"a", "b", "c"})  # c does not fit beside a and b: unloaded, on demand
    assert ("unload", "c", "does not fit beside a, b; loaded when a request asks for it") in log
    clock.advance(10)
    lanes.get("a").served.use = Use(last_used=clock.wall - 1)  # a was used a second ago; b never
    lanes.get("c").served.use = Use(waiting=1)
    log.clear()
    cp._coordinate(alive, {"a", "b", "c"})
    assert ("coordinate", "c") in log
    assert [e for e in log if e[0] == "unload"] == [
        ("unload", "b", "the least recently used idle model, unloaded to make room for c")
    ]
    lanes.get("c").coordinator.fits = True  # the room b left
    log.clear()
    cp._coordinate(alive, {"a", "b", "c"})
    assert ("coordinate", "c") in log and not lanes.get("c").served.plan.unloaded


def test_no_model_gives_way_while_every_loaded_one_is_in_use(monkeypatch):
    cp, lanes, log, clock, alive = _mesh(monkeypatch, {"a": True, "b": True, "c": False})
    lanes.get("c").coordinator.fits = False
    cp._coordinate(alive, {"a", "b", "c"})
    lanes.get("a").served.use = Use(active=1)
    lanes.get("b").served.use = Use(waiting=1)  # not loaded yet for someone: not idle either
    lanes.get("c").served.use = Use(waiting=1)
    log.clear()
    cp._coordinate(alive, {"a", "b", "c"})
    assert not [e for e in log if e[0] == "unload"], log


def test_an_idle_model_is_unloaded_once_its_keep_alive_runs_out(monkeypatch):
    cp, lanes, log, clock, alive = _mesh(monkeypatch, {"a": True, "b": True}, keep_alive={"b": 60.0})
    cp._coordinate(alive, {"a", "b"})
    lanes.get("b").served.use = Use(last_used=clock.wall)
    clock.advance(59)
    cp._coordinate(alive, {"a", "b"})
    assert not [e for e in log if e[0] == "unload"]
    clock.advance(2)
    cp._coordinate(alive, {"a", "b"})
    assert [e for e in log if e[0] == "unload"] == [("unload", "b", "idle for longer than its keep_alive")]
    clock.advance(3600)  # a has no keep-alive (0: until its room is needed); b stays unloaded unasked
    log.clear()
    cp._coordinate(alive, {"a", "b"})
    assert not [e for e in log if e[0] == "unload"] and ("coordinate", "b") not in log


def test_a_model_no_live_node_offers_is_unloaded(monkeypatch):
    cp, lanes, log, clock, alive = _mesh(monkeypatch, {"a": True, "b": True})
    cp._coordinate(alive, {"a"})
    assert ("unload", "b", "no live node offers it any more") in log


@pytest.mark.parametrize("joined", [False, True])
def test_a_model_unloaded_for_want_of_room_is_tried_again_only_when_the_members_change(monkeypatch, joined):
    cp, lanes, log, clock, alive = _mesh(monkeypatch, {"a": True, "b": False})
    lanes.get("b").coordinator.fits = False
    cp._coordinate(alive, {"a", "b"})
    log.clear()
    cp._coordinate(alive, {"a", "b"})  # same members, nobody asks: not weighed again
    assert ("coordinate", "b") not in log
    if joined:
        alive = {**alive, "c": _node("c", ("a",))}
    lanes.get("b").coordinator.fits = True
    cp._coordinate(alive, {"a", "b"})
    assert (("coordinate", "b") in log) == joined
    assert lanes.get("b").served.plan.unloaded != joined
