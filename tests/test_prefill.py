"""Pipelined prefill and the baton, in one process: chunk sizes, tokens equal to mlx-lm's, turns.

The real-stage versions (gRPC between `meshnode run` processes) are in tests/test_speed_paths.py.
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from meshnode.model.build import build_model
from meshnode.model.scheduler import Baton, mlx_idle, set_priority
from meshnode.model.shard import Shard
from meshnode.serving.generation import PipelineModel, PrefillOptions, SamplingParams, generate_tokens
from meshnode.serving.local_stage import LocalStage
from meshnode.serving.prefill import CHUNKS_PER_STAGE, MIN_CHUNK, ChunkSizer

PROMPT = [(7 * i + 3) % 500 + 5 for i in range(300)]


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model(request, tmp_path_factory):
    return build_model(
        tmp_path_factory.mktemp("prefill") / request.param, request.param, num_layers=6, hidden_size=64, dtype="float32"
    )


def test_chunks_fit_the_step_limit_and_fill_the_pipe():
    sizer = ChunkSizer(2, max_step=0.04, max_chunk=512)  # below prefill.TURN, so the step limit decides
    assert sizer.next(1000, 1000) == 64  # nothing timed yet: a modest first chunk
    sizer.observe(0, 64, 0.064)  # 1 ms per position: 40 positions fit in 0.04 s
    assert sizer.next(1000, 1000) == 40
    assert sizer.next(1000, 200) == 200 // (CHUNKS_PER_STAGE * 2)  # several chunks per stage
    assert sizer.next(7, 1000) == 7  # never past the prompt
    sizer.observe(1, 10, 10.0)  # a very slow stage: the smallest chunk, never zero
    assert sizer.next(1000, 1000) == MIN_CHUNK
    assert ChunkSizer(1, max_step=10, max_chunk=32).next(1000, 1000) == 32  # the stages' message limit


def test_pipelined_prefill_gives_mlx_lm_tokens(model):
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    m, _ = load(str(model))
    ref = [int(t) for t, _ in generate_step(mx.array(PROMPT, dtype=mx.uint32), m, max_tokens=16)]
    stages = [LocalStage(Shard(model, a, b)) for a, b in ((0, 2), (2, 3), (3, 6))]
    for options in (
        PrefillOptions(max_step=0.5),
        PrefillOptions(max_step=1e-6, max_chunk=64),
        PrefillOptions(pipelined=False),
    ):
        got = list(generate_tokens(PipelineModel(stages, "t"), PROMPT, SamplingParams(max_tokens=16), prefill=options))
        assert got == ref, options


def test_baton_one_holder_in_turn_and_free_while_waiting():
    baton, inside, log, overlaps = Baton(), [], [], []

    def worker(name):
        baton.acquire()
        try:
            for _ in range(3):
                inside.append(name)
                time.sleep(0.002)
                if inside != [name]:  # somebody else held it meanwhile
                    overlaps.append(list(inside))
                inside.remove(name)
                log.append(name)
                with mlx_idle():  # "waiting on the network": another thread may compute
                    time.sleep(0.01)
                baton.pass_on()
        finally:
            baton.release()

    threads = [threading.Thread(target=worker, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(log) == ["a"] * 3 + ["b"] * 3 and not overlaps
    # Each lets go while it waits, so the two interleave instead of running one after the other.
    assert log != ["a"] * 3 + ["b"] * 3 and log != ["b"] * 3 + ["a"] * 3


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _claim_in_thread(baton: Baton, work: int, order: list, name: str) -> threading.Thread:
    def run():
        set_priority(work)
        baton.acquire()
        order.append(name)
        baton.release()

    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_claims(baton: Baton, n: int) -> None:
    deadline = time.monotonic() + 5
    while len(baton._waiting) < n:
        assert time.monotonic() < deadline, "claims never queued"
        time.sleep(0.001)


def test_baton_goes_to_the_least_work_first_then_to_the_aged():
    """Shortest remaining first: a short answer's claim passes a long title prompt's chunk that
    queued before it; a claim that waited AGE_S goes first whatever its work (no starvation)."""
    clock = _Clock()
    baton, order = Baton(age_s=0.25, clock=clock), []
    baton.acquire()
    threads = [_claim_in_thread(baton, 900, order, "title")]
    _wait_claims(baton, 1)
    clock.now = 0.1
    threads.append(_claim_in_thread(baton, 20, order, "answer"))
    _wait_claims(baton, 2)
    baton.release()
    for t in threads:
        t.join(5)
    assert order == ["answer", "title"]

    order.clear()
    baton.acquire()
    threads = [_claim_in_thread(baton, 900, order, "title")]
    _wait_claims(baton, 1)
    clock.now = 0.4  # the title has waited 0.3 s > age_s
    threads.append(_claim_in_thread(baton, 0, order, "decode"))
    _wait_claims(baton, 2)
    baton.release()
    for t in threads:
        t.join(5)
    assert order == ["title", "decode"]


def test_pass_on_yields_only_to_a_better_or_aged_claim():
    clock = _Clock()
    baton, order = Baton(age_s=0.25, clock=clock), []
    set_priority(0)  # this thread decodes
    baton.acquire()
    t = _claim_in_thread(baton, 500, order, "chunk")
    _wait_claims(baton, 1)
    settled = []
    baton.pass_on(lambda: settled.append(1))
    assert order == [] and settled == []  # a decode step goes before a fresh prefill chunk
    clock.now = 1.0
    baton.pass_on(lambda: settled.append(1))  # the chunk has aged: it goes now
    t.join(5)
    assert order == ["chunk"] and settled == [1]
    baton.release()


def test_one_off_work_and_generations_share_the_baton():
    """The MLX thread's one-off calls (a stage's step for a peer, loading a shard) and a
    generation's thread take turns through the same baton (TokenScheduler.run_here and call)."""
    import asyncio

    from meshnode.model.scheduler import TokenScheduler

    scheduler = TokenScheduler("test-mlx")
    try:
        assert scheduler.run_here(lambda: 41) + 1 == 42

        async def main():
            return await scheduler.call(lambda: "done")

        assert asyncio.run(main()) == "done"
    finally:
        scheduler.stop()


def test_step_watch_reports_the_oldest_step_in_flight():
    from meshnode.model.scheduler import StepWatch

    clock = _Clock()
    watch = StepWatch(clock=clock)
    assert watch.longest() == 0.0
    with watch.step():
        clock.now = 2.0
        with watch.step():
            clock.now = 5.0
            assert watch.longest() == 5.0  # the outer one, started at 0
        assert watch.longest() == 5.0
    assert watch.longest() == 0.0
