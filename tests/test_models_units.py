"""Several models on one mesh, the parts without a mesh: which idle model makes room and when one
expires (meshnode.control.demand), the settings that name the models and their keep-alive, what a
heartbeat says of each model, unloaded plans on the wire, a stream for a model not served here,
the memory the other models' plans take, and requests counted and held while their model loads.
The same on running nodes: tests/test_models_mesh.py.
"""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from meshnode import cli
from meshnode.config import ConfigError, Settings, load_settings
from meshnode.control.demand import expired, keep_alive_of, total, victim
from meshnode.control.heartbeats import model_states
from meshnode.control.lanes import Lane, Lanes
from meshnode.control.messages import plan_from_pb
from meshnode.planner.plans import UNLOADED, Plan, Stage
from meshnode.proto import mesh_pb2
from meshnode.serving.usage import CountedSource, Use, UseCounter
from meshnode.transport import routing
from meshnode.transport.dataport import recv_frame
from meshnode.transport.routing import StageRouter
from meshnode.values import keep_alive_map, model_list, parse_duration

# --------------------------------------------------------------------------- demand


def test_use_idle_only_without_active_or_waiting_requests():
    assert Use().idle
    assert Use(last_used=5.0).idle
    assert not Use(active=1).idle
    assert not Use(waiting=1).idle


def test_total_adds_counts_and_keeps_the_latest_use():
    assert total([]) == Use()
    got = total([Use(10.0, 1, 0), Use(30.0, 0, 2), Use(20.0, 3, 1)])
    assert got == Use(last_used=30.0, active=4, waiting=3)


def test_victim_is_the_least_recently_used_idle_model():
    loaded = {"a": Use(last_used=100.0), "b": Use(last_used=50.0), "c": Use(last_used=200.0)}
    assert victim(loaded, {}) == "b"


def test_victim_skips_models_in_use_and_waited_for():
    loaded = {
        "old-busy": Use(last_used=1.0, active=1),
        "old-waited": Use(last_used=2.0, waiting=1),
        "newer": Use(last_used=50.0),
    }
    assert victim(loaded, {}) == "newer"


def test_victim_none_when_every_model_is_in_use():
    assert victim({"a": Use(active=1), "b": Use(waiting=2)}, {"a": 0.0, "b": 0.0}) is None
    assert victim({}, {}) is None


def test_victim_never_used_model_counts_from_when_it_was_loaded():
    # "fresh" was never used but was loaded after "a" was last used: "a" goes first.
    loaded = {"a": Use(last_used=100.0), "fresh": Use()}
    assert victim(loaded, {"a": 10.0, "fresh": 150.0}) == "a"
    # loaded before "a"'s last use: "fresh" goes first.
    assert victim(loaded, {"a": 10.0, "fresh": 50.0}) == "fresh"


def test_victim_reloaded_model_counts_from_its_reload():
    # "r" was used long ago, then unloaded and loaded again just now: it is not the oldest.
    loaded = {"r": Use(last_used=10.0), "s": Use(last_used=100.0)}
    assert victim(loaded, {"r": 500.0, "s": 20.0}) == "s"


def test_victim_ties_by_model_id():
    loaded = {"zeta": Use(last_used=7.0), "alpha": Use(last_used=7.0), "mid": Use(last_used=7.0)}
    assert victim(loaded, {}) == "alpha"
    assert victim({"b": Use(), "a": Use()}, {"a": 3.0, "b": 3.0}) == "a"


def test_expired_only_idle_models_past_their_keep_alive():
    use = Use(last_used=100.0)
    assert not expired(use, 60.0, loaded_at=0.0, now=150.0)
    assert not expired(use, 60.0, loaded_at=0.0, now=160.0)  # exactly the keep-alive: not yet
    assert expired(use, 60.0, loaded_at=0.0, now=161.0)
    assert not expired(Use(last_used=100.0, active=1), 60.0, loaded_at=0.0, now=1000.0)
    assert not expired(Use(last_used=100.0, waiting=1), 60.0, loaded_at=0.0, now=1000.0)


def test_expired_keep_alive_zero_never_expires():
    assert not expired(Use(last_used=1.0), 0.0, loaded_at=0.0, now=1e9)
    assert not expired(Use(), 0.0, loaded_at=0.0, now=1e9)


def test_expired_counts_from_the_later_of_last_use_and_load():
    # never used: from its load
    assert not expired(Use(), 60.0, loaded_at=1000.0, now=1050.0)
    assert expired(Use(), 60.0, loaded_at=1000.0, now=1061.0)
    # used before it was (re)loaded: from the load
    assert not expired(Use(last_used=10.0), 60.0, loaded_at=1000.0, now=1050.0)
    # used after the load: from the use
    assert not expired(Use(last_used=2000.0), 60.0, loaded_at=1000.0, now=2050.0)
    assert expired(Use(last_used=2000.0), 60.0, loaded_at=1000.0, now=2061.0)


def test_keep_alive_of_own_entry_then_star_then_zero():
    setting = {"a": 3600.0, "*": 300.0, "z": 0.0}
    assert keep_alive_of(setting, "a") == 3600.0
    assert keep_alive_of(setting, "other") == 300.0
    assert keep_alive_of(setting, "z") == 0.0  # its own 0 beats "*"
    assert keep_alive_of({"a": 60.0}, "b") == 0.0
    assert keep_alive_of({}, "a") == 0.0


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    "value, want",
    [
        ("a,b", ("a", "b")),
        ("a b\tc", ("a", "b", "c")),
        (" a , b ", ("a", "b")),
        ("org/m-1,/path/to/m2", ("org/m-1", "/path/to/m2")),
        (["a", "b"], ("a", "b")),
        (("x",), ("x",)),
        ([" a "], ("a",)),
        ("", ()),
        ([], ()),
    ],
)
def test_model_list_accepts_lists_and_separated_strings(value, want):
    assert model_list(value) == want


def test_model_list_dedupes_keeping_order():
    assert model_list("b,a,b,c,a") == ("b", "a", "c")
    assert model_list(["b", "a", "b"]) == ("b", "a")


@pytest.mark.parametrize("bad", [["a", ""], ["a", "   "], [1], 3, None, {"a": 1}])
def test_model_list_refuses_empty_entries_and_non_lists(bad):
    with pytest.raises(ValueError):
        model_list(bad)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1.5h", 5400.0),
        ("0m", 0.0),
        ("2M", 120.0),
        ("1H", 3600.0),
        ("500ms", 0.5),
        ("2s", 2.0),
        ("2", 2.0),
        (" 2s ", 2.0),
        ("0.5", 0.5),
        (3, 3.0),
        (0.25, 0.25),
    ],
)
def test_parse_duration_units(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["m", "h", "5d", "five", "5 min", "", "infm", "nanh", True, None])
def test_parse_duration_refuses_garbage(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_keep_alive_map_one_duration_for_every_model():
    assert keep_alive_map("5m") == {"*": 300.0}
    assert keep_alive_map("0") == {"*": 0.0}
    assert keep_alive_map(30) == {"*": 30.0}


def test_keep_alive_map_per_model():
    assert keep_alive_map("a=1h,*=5m") == {"a": 3600.0, "*": 300.0}
    assert keep_alive_map("org/a=10s b=500ms") == {"org/a": 10.0, "b": 0.5}
    assert keep_alive_map({"a": "1h", "*": 60}) == {"a": 3600.0, "*": 60.0}
    assert keep_alive_map({}) == {}


@pytest.mark.parametrize(
    "bad",
    [
        "-5m",
        "a=-1s",
        {"a": "-1"},
        "a=",
        "=5m",
        "a=1h,b",
        "a=soon",
        "soon",
        {"": "5m"},
        {"a": True},
        True,
        None,
    ],
)
def test_keep_alive_map_refuses_negative_and_malformed(bad):
    with pytest.raises(ValueError):
        keep_alive_map(bad)


# --------------------------------------------------------------------------- config


def test_models_from_the_environment():
    s = load_settings(None, env={"MESHNODE_MODELS": "x,y"}, flags={})
    assert s.models == ("x", "y")
    assert s.model is None


def test_models_default_and_flag_beats_environment():
    assert load_settings(None, env={}, flags={}).models == ()
    s = load_settings(None, env={"MESHNODE_MODELS": "x,y"}, flags={"models": ["z"]})
    assert s.models == ("z",)


def test_models_from_a_config_file(tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text('model = "p"\nmodels = ["q", "r", "q"]\nkeep_alive = { q = "1h", "*" = "5m" }\n')
    s = load_settings(cfg, env={}, flags={})
    assert s.model == "p" and s.models == ("q", "r")
    assert s.keep_alive == {"q": 3600.0, "*": 300.0}


def test_offered_models_puts_model_first_without_repeating_it():
    assert Settings(model="x", models=("y", "x", "z")).offered_models() == ("x", "y", "z")
    assert Settings(model="x").offered_models() == ("x",)
    assert Settings(models=("a",)).offered_models() == (None, "a")  # None: the demo model


def test_keep_alive_from_the_environment():
    assert load_settings(None, env={"MESHNODE_KEEP_ALIVE": "m=10m"}, flags={}).keep_alive == {"m": 600.0}
    assert load_settings(None, env={"MESHNODE_KEEP_ALIVE": "5m"}, flags={}).keep_alive == {"*": 300.0}


def test_keep_alive_default_keeps_models_until_room_is_needed():
    assert load_settings(None, env={}, flags={}).keep_alive == {"*": 0.0}
    assert Settings().keep_alive == {"*": 0.0}


@pytest.mark.parametrize("bad", ["m=-1m", "m=", "forever"])
def test_bad_keep_alive_names_the_variable(bad):
    with pytest.raises(ConfigError, match="MESHNODE_KEEP_ALIVE"):
        load_settings(None, env={"MESHNODE_KEEP_ALIVE": bad}, flags={})


def test_bad_models_name_the_key_and_settings_check_in_code(tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text('models = ["a", ""]\n')
    with pytest.raises(ConfigError, match="models"):
        load_settings(cfg, env={}, flags={})
    with pytest.raises(ConfigError, match="keep_alive"):
        Settings(keep_alive={"a": -1.0})
    with pytest.raises(ConfigError, match="models"):
        Settings(models=("a", ""))


# --------------------------------------------------------------------------- cli


def run_args(*argv: str):
    return cli.build_parser().parse_args(["run", *argv])


def test_repeated_model_flag_makes_model_and_models():
    s = cli.settings_from_args(run_args("--model", "a", "--model", "b", "--model", "c"), env={})
    assert s.model == "a"
    assert s.models == ("b", "c")
    assert s.offered_models() == ("a", "b", "c")


def test_repeated_model_flag_replaces_models_from_lower_layers():
    s = cli.settings_from_args(run_args("--model", "a", "--model", "b"), env={"MESHNODE_MODELS": "x,y"})
    assert s.model == "a" and s.models == ("b",)


def test_single_model_flag_leaves_models_as_configured():
    s = cli.settings_from_args(run_args("--model", "a"), env={"MESHNODE_MODELS": "x,y"})
    assert s.model == "a" and s.models == ("x", "y")
    s = cli.settings_from_args(run_args("--model", "a"), env={})
    assert s.model == "a" and s.models == ()


def test_no_model_flag_leaves_model_and_models_as_configured():
    s = cli.settings_from_args(run_args(), env={"MESHNODE_MODEL": "m", "MESHNODE_MODELS": "x"})
    assert s.model == "m" and s.models == ("x",)


# --------------------------------------------------------------------------- heartbeats


def test_model_states_one_pair_per_model_entry():
    a = mesh_pb2.ModelState(model="a", epoch=3, last_used=12.5, active=1)
    b = mesh_pb2.ModelState(model="b", epoch=7, waiting=2)
    msg = mesh_pb2.HeartbeatRequest(
        coordinator="n1", epoch=9, plan=mesh_pb2.Plan(model="other", epoch=9), models=[a, b]
    )
    got = model_states(msg)
    assert [m for m, _ in got] == ["a", "b"]  # the models entries, not the plan's model
    assert got[0][1] == a and got[1][1] == b
    assert got[0][1].active == 1 and got[1][1].waiting == 2


def test_model_states_without_models_tells_of_the_plans_model():
    msg = mesh_pb2.HeartbeatRequest(coordinator="n1", epoch=4, plan=mesh_pb2.Plan(model="m", epoch=4))
    assert model_states(msg) == [("m", msg)]


def test_model_states_without_models_or_plan_tells_of_the_first_model():
    msg = mesh_pb2.HeartbeatRequest(coordinator="n1", epoch=2)
    assert model_states(msg) == [("", msg)]


def test_model_states_of_a_reply():
    reply = mesh_pb2.HeartbeatReply(models=[mesh_pb2.ModelState(model="r")])
    assert [m for m, _ in model_states(reply)] == ["r"]


# --------------------------------------------------------------------------- plans on the wire


def test_unloaded_plan_without_stages_decodes():
    msg = mesh_pb2.Plan(model="big", strategy=UNLOADED, epoch=5, reason="does not fit beside the others")
    plan = plan_from_pb(msg, num_layers=24)
    assert plan.unloaded
    assert plan.stages == () and plan.model == "big" and plan.epoch == 5
    assert plan.reason == "does not fit beside the others"


@pytest.mark.parametrize("strategy", ["pipeline", "single", "tensor", ""])
def test_plan_without_stages_and_another_strategy_is_refused(strategy):
    with pytest.raises(ValueError):
        plan_from_pb(mesh_pb2.Plan(model="m", strategy=strategy, epoch=1), num_layers=24)


def test_unloaded_plan_with_a_partial_stage_is_refused():
    msg = mesh_pb2.Plan(
        model="m", strategy=UNLOADED, epoch=1, stages=[mesh_pb2.Stage(start_layer=0, end_layer=10, nodes=["n1"])]
    )
    with pytest.raises(ValueError):
        plan_from_pb(msg, num_layers=24)


def test_loaded_plan_still_decodes():
    msg = mesh_pb2.Plan(
        model="m",
        strategy="pipeline",
        epoch=2,
        stages=[
            mesh_pb2.Stage(start_layer=0, end_layer=10, nodes=["n1"], bytes=5),
            mesh_pb2.Stage(start_layer=10, end_layer=24, nodes=["n2"], bytes=7),
        ],
    )
    plan = plan_from_pb(msg, num_layers=24)
    assert not plan.unloaded
    assert plan.node_ids() == ["n1", "n2"]


# --------------------------------------------------------------------------- routing


class Lookup:
    def __init__(self, servers):
        self.servers, self.asked = servers, []

    def __call__(self, model):
        self.asked.append(model)
        return self.servers.get(model)


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(2.0)
    b.settimeout(2.0)
    yield a, b
    a.close()
    b.close()


def test_data_stream_for_a_model_not_served_here_is_refused_as_pending(pair):
    conn, peer = pair
    lookup = Lookup({"served": object()})
    router = StageRouter(lookup, run_here=None)
    opening = mesh_pb2.DataOpen(forward=mesh_pb2.ForwardRequest(request_id="r1", epoch=3, model="ghost-model"))
    router.data(conn, opening, "127.0.0.1")
    assert lookup.asked == ["ghost-model"]
    frame = recv_frame(peer)
    assert frame is not None
    reply = mesh_pb2.ForwardReply.FromString(bytes(frame))
    assert reply.code == grpc.StatusCode.ABORTED.value[0]
    assert "ghost-model" in reply.error
    # one frame only: nothing more is waiting
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        peer.recv(1)


@pytest.mark.parametrize("lockstep", [False, True])
def test_data_stream_goes_to_its_models_server(pair, monkeypatch, lockstep):
    conn, peer = pair
    calls = []
    monkeypatch.setattr(routing, "serve_forward", lambda *a, hook=None: calls.append(("forward", a)))
    monkeypatch.setattr(routing, "serve_lockstep", lambda *a: calls.append(("lockstep", a)))
    first, second = object(), object()
    run_here = object()
    router = StageRouter(Lookup({"": first, "m2": second}), run_here)
    opening = mesh_pb2.DataOpen(forward=mesh_pb2.ForwardRequest(request_id="r", model="m2", lockstep=lockstep))
    router.data(conn, opening, "10.0.0.9")
    assert calls == [("lockstep" if lockstep else "forward", (second, run_here, conn, opening, "10.0.0.9"))]
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        peer.recv(1)  # nothing refused


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self):
        self.aborted = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise Aborted(details)


async def test_grpc_forward_for_a_model_not_served_here_aborts_as_pending():
    async def requests():
        yield mesh_pb2.ForwardRequest(request_id="r", model="ghost-model")

    context = FakeContext()
    router = StageRouter(Lookup({}), run_here=None)
    with pytest.raises(Aborted):
        async for _ in router.forward(requests(), context):
            pass
    code, details = context.aborted
    assert code == grpc.StatusCode.ABORTED
    assert "ghost-model" in details


# --------------------------------------------------------------------------- lanes


class FakeServed:
    def __init__(self, model_id, plan):
        self.model_id, self.plan, self.loads = model_id, plan, 0

    async def load(self, holders):
        self.loads += 1

    def close(self):
        pass


def stage(start, end, nodes, nbytes):
    return Stage(start_layer=start, end_layer=end, nodes=tuple(nodes), bytes=nbytes)


PLANS = {
    "a": Plan("a", "pipeline", (stage(0, 10, ["n1"], 100), stage(10, 20, ["n2"], 200))),
    "b": Plan("b", "hybrid", (stage(0, 4, ["n1"], 10), stage(4, 8, ["n2", "n3"], 40))),  # tensor: each member
    "c": Plan("c", UNLOADED, ()),
    "d": None,  # not planned yet
    "e": Plan("e", "single", (stage(0, 30, ["n3"], 1000),)),
}


def make_lane(spec, offered):
    return Lane(served=FakeServed(spec, PLANS[spec]), adoption=None, coordinator=None, offered=offered)


async def started_lanes():
    lanes = Lanes(make_lane, ("a", "b", "c", "d", "e"))
    await lanes.start(holders=None)
    assert [lane.model_id for lane in lanes] == ["a", "b", "c", "d", "e"]
    assert all(lane.served.loads == 1 for lane in lanes)
    return lanes


async def test_used_by_others_sums_the_other_models_plans_per_node():
    lanes = await started_lanes()
    assert lanes.used_by_others("a") == {"n1": 10, "n2": 40, "n3": 40 + 1000}
    assert lanes.used_by_others("b") == {"n1": 100, "n2": 200, "n3": 1000}
    assert lanes.used_by_others("e") == {"n1": 110, "n2": 240, "n3": 40}


async def test_used_by_others_skips_unloaded_and_unplanned_models():
    lanes = await started_lanes()
    everything = {"n1": 110, "n2": 240, "n3": 1040}
    assert lanes.used_by_others("c") == everything  # c's own (unloaded) plan: nothing either way
    assert lanes.used_by_others("d") == everything
    assert lanes.used_by_others("not-a-lane") == everything


def test_used_by_others_with_lanes_filled_directly():
    lanes = Lanes(make_lane, ("a",))
    for spec in ("a", "c", "d"):
        lanes._lanes[spec] = lanes.primary if spec == "a" else make_lane(spec, False)
    assert lanes.used_by_others("a") == {}
    assert lanes.used_by_others("c") == {"n1": 100, "n2": 200}


# --------------------------------------------------------------------------- counted requests


class FakeSource:
    def __init__(self, tokens=(1, 2, 3), counter=None):
        self._tokens, self.calls, self.counter, self.seen_active = tokens, 0, counter, []

    async def tokens(self, prompt, params):
        self.calls += 1
        for t in self._tokens:
            if self.counter is not None:
                self.seen_active.append(self.counter.active)
            yield t
            await asyncio.sleep(0)


def counted(source, counter, *, on_demand=False, loaded=lambda: True, deadline=5.0):
    return CountedSource(
        source,
        counter,
        on_demand=lambda: on_demand,
        loaded=loaded,
        deadline=lambda: deadline,
        give_up=lambda exc: RuntimeError(str(exc)),
        model="the-model",
    )


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        self.t += 1.0
        return self.t


async def until(cond, timeout=2.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.005)


async def test_counted_source_counts_active_during_the_generation():
    clock = Clock()
    counter = UseCounter(clock)
    src = FakeSource(counter=counter)
    cs = counted(src, counter)
    got = []
    async for t in cs.tokens([5, 6], None):
        got.append(t)
        assert counter.active == 1 and counter.waiting == 0
    assert got == [1, 2, 3]
    assert src.seen_active == [1, 1, 1]
    assert counter.active == 0
    assert counter.last_used == clock.t  # touched when it ended
    assert counter.now() == Use(clock.t, 0, 0)


async def test_counted_source_not_on_demand_streams_without_asking_loaded():
    counter = UseCounter()
    asked = []
    cs = CountedSource(
        FakeSource(),
        counter,
        on_demand=lambda: False,
        loaded=lambda: asked.append(1) or False,
        deadline=lambda: 0.1,
        give_up=lambda exc: RuntimeError(str(exc)),
        model="m",
    )
    assert [t async for t in cs.tokens([1], None)] == [1, 2, 3]
    assert asked == [] and counter.active == 0


async def test_counted_source_consumer_closing_early_ends_the_count():
    counter = UseCounter()
    src = FakeSource(tokens=range(100), counter=counter)
    gen = counted(src, counter).tokens([1], None)
    assert await gen.__anext__() == 0
    assert counter.active == 1
    await gen.aclose()
    assert counter.active == 0
    assert counter.last_used > 0


async def test_counted_source_consumer_breaking_off_ends_the_count():
    # As the engine does at an end-of-sequence token or max_tokens: break, and drop the generator.
    counter = UseCounter()
    src = FakeSource(tokens=range(100), counter=counter)
    async for t in counted(src, counter).tokens([1], None):
        if t == 2:
            break
    await until(lambda: counter.active == 0)


async def test_counted_source_source_failing_ends_the_count():
    class Failing:
        async def tokens(self, prompt, params):
            yield 1
            raise ValueError("stage lost")

    counter = UseCounter()
    with pytest.raises(ValueError, match="stage lost"):
        async for _ in counted(Failing(), counter).tokens([1], None):
            pass
    assert counter.active == 0 and counter.waiting == 0


async def test_counted_source_on_demand_waits_until_loaded():
    counter = UseCounter()
    src = FakeSource(counter=counter)
    state = {"loaded": False}
    cs = counted(src, counter, on_demand=True, loaded=lambda: state["loaded"])

    async def consume():
        return [t async for t in cs.tokens([1], None)]

    task = asyncio.create_task(consume())
    await until(lambda: counter.waiting == 1)
    await asyncio.sleep(0.12)  # a few polls: still held
    assert not task.done()
    assert counter.waiting == 1 and counter.active == 0 and src.calls == 0
    assert not counter.now().idle  # a model waited for is not idle (demand.victim skips it)
    state["loaded"] = True
    assert await asyncio.wait_for(task, 2.0) == [1, 2, 3]
    assert counter.waiting == 0 and counter.active == 0
    assert src.seen_active == [1, 1, 1]


async def test_counted_source_on_demand_already_loaded_streams_at_once():
    counter = UseCounter()
    cs = counted(FakeSource(), counter, on_demand=True, loaded=lambda: True)
    started = time.monotonic()
    assert [t async for t in cs.tokens([1], None)] == [1, 2, 3]
    assert time.monotonic() - started < 0.5
    assert counter.waiting == 0


async def test_counted_source_gives_up_when_the_model_is_not_loaded_in_time():
    counter = UseCounter()
    src = FakeSource()
    cs = counted(src, counter, on_demand=True, loaded=lambda: False, deadline=0.2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the-model"):
        async for _ in cs.tokens([1], None):
            pass
    waited = time.monotonic() - started
    assert 0.2 <= waited < 1.5
    assert src.calls == 0
    assert counter.waiting == 0 and counter.active == 0
    assert counter.last_used > 0  # the request counted as a use


async def test_counted_source_cancelled_while_waiting_stops_waiting():
    counter = UseCounter()
    src = FakeSource()
    cs = counted(src, counter, on_demand=True, loaded=lambda: False, deadline=30.0)

    async def consume():
        async for _ in cs.tokens([1], None):
            pass

    task = asyncio.create_task(consume())
    await until(lambda: counter.waiting == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert counter.waiting == 0 and counter.active == 0 and src.calls == 0
