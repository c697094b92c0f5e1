"""A busy stage is not a lost stage (issue 10b): the rules, without namespaces.

Liveness comes from the control plane: a reply is awaited while the peer heartbeats, however
long it takes; a false suspicion replays on the same epoch at once when no new plan is coming;
long prompts are cut into short chunks while other generations run; every HTTP request leaves
one access line and a client that goes away leaves no traceback. The same on real namespace
hosts: tests/test_busy.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from unittest import mock

import aiohttp
import pytest

from meshnode.model.build import build_model
from meshnode.serving.generation import SamplingParams
from meshnode.serving.prefill import BUSY_MIN_CHUNK, SHARED_STEP, TURN, ChunkSizer
from meshnode.serving.resilience import FailoverSource, NotReady, PlacementLost, await_while_alive
from meshnode.transport.refusals import StageError
from meshnode.transport.remote_stage import RemoteSession, RemoteStage, RemoteTicket
from tests.helpers import running_node

TRUE = list(range(100, 120))


class Flaky:
    """Continues TRUE after the prompt; the first run fails after ``fail_after`` tokens."""

    def __init__(self, epoch, fail_after):
        self.epoch, self.fail_after, self.runs = epoch, fail_after, 0

    async def tokens(self, prompt, params):
        self.runs += 1
        done = len(prompt) - 3
        for i, t in enumerate(TRUE[done : done + params.max_tokens]):
            if self.runs == 1 and i == self.fail_after:
                raise PlacementLost("head n2 stopped heartbeating")
            yield t


def collect(src):
    async def go():
        return [t async for t in src.tokens([1, 2, 3], SamplingParams(max_tokens=20))]

    return asyncio.run(go())


def never_newer(after):
    if after is not None:
        raise NotReady("no newer plan")
    return placement


placement = Flaky(2, fail_after=5)


def test_false_suspicion_retries_on_the_same_epoch_at_once():
    """Nothing failed (every node answered since), no plan is coming: the generation replays on
    the same epoch right away instead of waiting out the 30 s failover deadline."""
    global placement
    placement = Flaky(2, fail_after=5)
    heard = []

    def same_epoch(epoch, since):
        heard.append((epoch, since))
        return placement if len(heard) >= 2 else None  # a heartbeat arrives on the second look

    t0 = time.monotonic()
    out = collect(FailoverSource(never_newer, poll=0.01, deadline=30, same_epoch=same_epoch))
    assert out == TRUE
    assert time.monotonic() - t0 < 2.0
    assert placement.runs == 2 and heard[0][0] == 2


def test_a_lost_node_still_waits_for_the_new_plan():
    """A node never heard from again: no same-epoch retry; without a new plan the generation fails
    at the deadline."""
    global placement
    placement = Flaky(2, fail_after=5)
    src = FailoverSource(never_newer, poll=0.01, deadline=0.3, same_epoch=lambda epoch, since: None)
    with pytest.raises(PlacementLost, match="no new plan"):
        collect(src)


def test_await_while_alive_waits_past_any_deadline_and_stops_when_the_peer_does():
    async def slow(seconds, value):
        await asyncio.sleep(seconds)
        return value

    async def go():
        t0 = time.monotonic()
        assert await await_while_alive(slow(1.2, "token"), lambda: True, str, poll=0.05) == "token"
        assert time.monotonic() - t0 >= 1.2
        alive = {"v": True}
        asyncio.get_running_loop().call_later(0.3, alive.update, {"v": False})
        t0 = time.monotonic()
        with pytest.raises(PlacementLost, match="gone after"):
            await await_while_alive(slow(60, None), lambda: alive["v"], lambda s: f"gone after {s:.1f} s", poll=0.05)
        assert time.monotonic() - t0 < 1.0

    asyncio.run(go())


def _remote_stage(alive):
    return RemoteStage(
        node_id="n1",
        channel=mock.MagicMock(),
        loop=None,
        start=0,
        end=4,
        epoch=1,
        hidden_size=8,
        hop_timeout=0.2,
        alive=alive,
    )


def test_a_reply_is_awaited_while_the_stage_heartbeats():
    """A stage's reply 1.5 s late (far past 2 x hop_timeout) is waited for while the stage
    is alive; once it stops heartbeating, the wait ends within a poll."""
    alive = {"v": True}
    stage = _remote_stage(lambda: alive["v"])
    session = RemoteSession(stage, "req")
    future = concurrent.futures.Future()
    ticket = RemoteTicket(session, future, 1)
    timer = __import__("threading").Timer(1.5, future.set_result, ("reply",))
    timer.start()
    t0 = time.perf_counter()
    ticket.wait()
    assert time.perf_counter() - t0 >= 1.4
    ticket = RemoteTicket(session, concurrent.futures.Future(), 1)
    __import__("threading").Timer(0.3, alive.update, ({"v": False},)).start()
    t0 = time.perf_counter()
    with pytest.raises(StageError, match="stopped heartbeating"):
        ticket.wait()
    assert time.perf_counter() - t0 < 1.0


def test_long_prompts_are_cut_short_while_others_run():
    busy = {"v": False}
    sizer = ChunkSizer(1, max_step=0.5, max_chunk=512, seed=[0.001], busy=lambda: busy["v"])
    assert sizer.next(1000, 1000) == int(TURN / 0.001)  # alone: a turn's worth, from the earlier rate
    busy["v"] = True
    assert sizer.next(1000, 1000) == int(SHARED_STEP / 0.001)  # others waiting: a short slice
    sizer.observe(0, 10, 1.0)  # a very slow stage
    assert sizer.next(1000, 1000) == BUSY_MIN_CHUNK


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("busy-api") / "llama", "llama", num_layers=2, dtype="float32")


@pytest.mark.slow
def test_access_log_and_quiet_client_disconnect(model_path, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with running_node(model_path, tmp_path, max_context=512) as (node, base):

        async def go():
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{base}/api/unknown") as r:
                    assert r.status == 404
                body = {"model": node.model_id, "prompt": "hello", "max_tokens": 3, "temperature": 0}
                async with s.post(f"{base}/v1/completions", json=body) as r:
                    assert r.status == 200
                body = {**body, "max_tokens": 400, "stream": True}
                async with s.post(f"{base}/v1/completions", json=body) as r:
                    await r.content.readline()
            deadline = time.monotonic() + 10
            while node.scheduler.active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)

        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if r.name == "meshnode.access"]
    assert len(lines) == 3, lines
    assert lines[0].startswith("GET /api/unknown 404 ")
    assert lines[1].startswith("POST /v1/completions 200 ") and f"model={node.model_id}" in lines[1]
    assert lines[1].endswith("+3")
    assert "client-disconnected" in lines[2]
    assert sum("client disconnected" in r.getMessage() for r in caplog.records) == 1
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_access_log_off_by_setting(model_path, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with running_node(model_path, tmp_path, max_context=512, access_log=False) as (node, base):

        async def go():
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{base}/health") as r:
                    assert r.status == 200

        asyncio.run(go())
    assert not [r for r in caplog.records if r.name == "meshnode.access"]


def test_a_stage_server_tells_a_pending_epoch_from_a_superseded_one():
    import grpc

    from meshnode.proto import mesh_pb2
    from meshnode.transport.refusals import StageRefused
    from meshnode.transport.stage_server import StageServer

    server = StageServer(None, vocab_size=10, max_chunk=8, max_context=64)
    server.serve(3, {})
    server.serve(4, {})

    def refusal(epoch):
        with pytest.raises(StageRefused) as info:
            server.open(mesh_pb2.ForwardRequest(epoch=epoch, start_layer=0, end_layer=2))
        return info.value.code

    assert refusal(5) == grpc.StatusCode.ABORTED  # adopted or loading here, not yet served
    assert refusal(2) == grpc.StatusCode.FAILED_PRECONDITION  # retired: the generation needs a newer plan
    assert refusal(4) == grpc.StatusCode.UNAVAILABLE  # served, but these layers are not held here


def test_the_head_and_the_stages_error_codes_mean_what_the_generation_does_next():
    import grpc

    from meshnode.transport.refusals import FAULT, StageFault, StagePending, StageRefused, StageUnavailable, stage_error

    class St:
        start, end, node_id = 0, 4, "n1"

    assert isinstance(stage_error(St, None, grpc.StatusCode.ABORTED, "epoch 5 not yet"), StagePending)
    assert isinstance(stage_error(St, None, grpc.StatusCode.INTERNAL, FAULT + "layers [0, 4) failed"), StageFault)
    # gRPC's own INTERNAL (a stream ended while the client wrote) is not a fault: retried as lost
    own = stage_error(St, None, grpc.StatusCode.INTERNAL, "Internal error from Core")
    assert not isinstance(own, StageFault) and not isinstance(own, StageRefused)
    assert type(stage_error(St, None, grpc.StatusCode.UNAVAILABLE, "connection refused")) is StageUnavailable


def test_every_stage_learns_how_much_prompt_its_request_has_left():
    """A stage gives its MLX thread to the request with the least prompt left (a short answer's
    chunk before a long title's), so each chunk reaches every stage with its request's remaining
    work as the head cut it, not the chunk's own size (else a title's small chunks go before an
    answer's whole prompt at the stages, and the answer waits for all of them)."""
    import mlx.core as mx

    from meshnode.serving.prefill import DoneTicket, pipelined_prefill

    class Sent(DoneTicket):  # a remote stage's reply, already here
        def wait_handle(self):
            return self

    class Stage:
        remote = True

        def __init__(self):
            self.got = []

        def submit(self, x, *, work=0):
            self.got.append((x.shape[1], work))
            return Sent(mx.zeros((1, x.shape[1], 4)), x.shape[1])

    stages = [Stage(), Stage()]
    sizer = ChunkSizer(2, max_step=1.0, max_chunk=512, seed=[0.001, 0.001], busy=lambda: True)  # 10-position chunks
    sizer.observe = lambda *timed: None  # as timed before (these stages answer at once)
    chunks = pipelined_prefill(stages, list(range(95)), sizer, wait=lambda handles, timeout: None)
    first = stages[0].got
    assert len(first) == chunks > 5 and sum(p for p, _ in first) == 95
    left = 95
    for positions, work in first:
        assert work == left  # this chunk's positions and every one after it
        left -= positions
    assert stages[1].got == first  # the next stage is told the same


def test_a_prompt_is_cut_finer_only_for_generations_with_less_left():
    """The title's prompt is sliced while the answer (less left) or a decoder runs; the answer's
    is not sliced for the title's sake (the baton serves the answer first anyway, and each slice
    would wait behind the title's chunk in progress at every stage)."""
    import threading

    from meshnode.model.scheduler import TokenScheduler, mlx_idle, set_priority

    scheduler = TokenScheduler("test-left")
    seen: dict[str, list[bool]] = {"title": [], "answer": []}
    waiting, answered, looked = threading.Event(), threading.Event(), threading.Event()

    def title():
        set_priority(1000)
        seen["title"].append(scheduler.others_waiting())  # alone
        with mlx_idle():  # waits on a remote stage, as a prefill does
            waiting.set()
            assert answered.wait(5)
        seen["title"].append(scheduler.others_waiting())  # the answer beside it, decoding
        looked.set()
        yield 1

    def answer():
        seen["answer"].append(scheduler.others_waiting())  # 14 left beside the title's 1000
        answered.set()
        yield 1
        set_priority(0)
        seen["answer"].append(scheduler.others_waiting())  # decoding: nothing to cut
        with mlx_idle():  # its next step on a remote stage: the title's turn meanwhile
            assert looked.wait(5)
        yield 2

    async def main():
        jobs = [scheduler.submit(title(), work=1000)]
        assert await asyncio.to_thread(waiting.wait, 5)
        jobs.append(scheduler.submit(answer(), work=14))
        for job in jobs:
            async for _ in job:
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        scheduler.stop()
    assert seen == {"title": [False, True], "answer": [False, False]}
