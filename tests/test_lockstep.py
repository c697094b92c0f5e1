"""Lockstep across stages, the head's side (meshnode.serving.lockstep): concurrent
generations over a chain of stages step together and each answers exactly as mlx-lm alone; one
that ends or is cancelled leaves the others correct; a lone one steps on its own."""

from __future__ import annotations

import asyncio
import threading
import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from meshnode.model.build import build_model
from meshnode.model.scheduler import TokenScheduler
from meshnode.model.shard import Shard, any_thread_stream
from meshnode.serving import lockstep
from meshnode.serving.generation import PipelineSource, PrefillOptions
from meshnode.serving.local_stage import LocalStage
from meshnode.serving.lockstep import LockstepGroups, can_lockstep
from meshnode.serving.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

LAYERS = 4
PROMPTS = [
    [3, 17, 42, 99, 7, 250, 31, 64],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    [21, 22, 23],
    [40, 41, 42, 43, 44, 45],
]
# They end at different steps: the batch shrinks while others go on.
LENGTHS = [96, 60, 120, 80]


def reference(path, prompt, n):
    model, _ = load_model(path)
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


@pytest.fixture(params=[("llama", None), ("qwen3_moe", None), ("llama", "4bit")], ids=["llama", "qwen3_moe", "4bit"])
def pipeline(request, tmp_path):
    family, quantize = request.param
    path = build_model(
        tmp_path / family, family, num_layers=LAYERS, hidden_size=128, dtype="float32", quantize=quantize, seed=9
    )
    handles = [LocalStage(Shard(path, 0, 2)), LocalStage(Shard(path, 2, LAYERS))]
    # Claims of the baton served in the order they come, so every generation takes its turn after
    # each token and they decode together. With the node's default (a decoder goes before a prompt
    # until the prompt has waited meshnode.model.scheduler.AGE_S), this tiny model decodes its
    # whole answer in less than that on a fast machine, and the generations run one after another.
    scheduler = TokenScheduler("test-step-batch", age_s=0)
    yield path, handles, scheduler
    scheduler.stop()


async def _tokens(source, prompt, n, stop_after=None):
    out = []
    async for token in source.tokens(prompt, SamplingParams(max_tokens=n)):
        out.append(int(token))
        if stop_after is not None and len(out) == stop_after:
            break  # the client went away
    return out


async def _together(scheduler, *coros):
    """Run generations that all arrive before any starts: the MLX baton is held until each has
    been submitted (on a tiny model one would otherwise be over before the next begins)."""
    go = threading.Event()
    held = threading.Event()

    def hold():
        with scheduler.baton.holding():
            held.set()
            go.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    tasks = [asyncio.ensure_future(c) for c in coros]
    await asyncio.sleep(0.3)
    go.set()
    try:
        return await asyncio.gather(*tasks)
    finally:
        holder.join(10)


@pytest.mark.slow
def test_concurrent_generations_step_together_and_answer_as_alone(pipeline):
    path, handles, scheduler = pipeline
    assert can_lockstep(handles)
    batcher = LockstepGroups(handles)
    source = PipelineSource(scheduler, lambda: handles, prefill=PrefillOptions(), batcher=batcher)

    got = asyncio.run(_together(scheduler, *(_tokens(source, p, n) for p, n in zip(PROMPTS, LENGTHS))))
    for prompt, n, tokens in zip(PROMPTS, LENGTHS, got):
        assert tokens == reference(path, prompt, n)
    assert batcher.widest >= 2, batcher.widest  # 4 requests in 2 micro-batches (one per stage)
    assert all(len(b) == 0 for g in batcher._groups for b in g.batches.values())  # every cache back to its request


@pytest.mark.slow
def test_a_cancelled_generation_leaves_the_batch_and_the_others_stay_correct(pipeline):
    path, handles, scheduler = pipeline
    batcher = LockstepGroups(handles)
    source = PipelineSource(scheduler, lambda: handles, prefill=PrefillOptions(), batcher=batcher)

    first, cut, third, fourth = asyncio.run(
        _together(
            scheduler,
            _tokens(source, PROMPTS[0], 96),
            _tokens(source, PROMPTS[1], 96, stop_after=40),
            _tokens(source, PROMPTS[2], 80),
            _tokens(source, PROMPTS[3], 90),
        )
    )
    assert first == reference(path, PROMPTS[0], 96) and third == reference(path, PROMPTS[2], 80)
    assert fourth == reference(path, PROMPTS[3], 90)
    assert cut == reference(path, PROMPTS[1], 40)
    assert batcher.widest >= 2


def test_a_lone_generation_steps_on_its_own(pipeline):
    path, handles, scheduler = pipeline
    batcher = LockstepGroups(handles)
    source = PipelineSource(scheduler, lambda: handles, prefill=PrefillOptions(), batcher=batcher)
    assert asyncio.run(_tokens(source, PROMPTS[0], 16)) == reference(path, PROMPTS[0], 16)
    assert batcher.widest == 0


class _SlowRounds(LockstepGroups):
    """A batcher whose rounds take ``round_s`` (a loaded machine, a slow stage) and return zeros:
    when the group's members step is the question here, not what a round computes."""

    def __init__(self, round_s: float):
        super().__init__([object()])  # one stage: one group, so both requests share it
        self.round_s, self.rows = round_s, []

    def _run(self, group, round_):
        self.rows.append(len(round_))
        time.sleep(self.round_s)
        return mx.zeros((len(round_), 1, 4))


@pytest.mark.slow
def test_members_out_of_step_batch_again_when_rounds_outlast_the_gather_wait(monkeypatch):
    """With rounds longer than GATHER_S (a loaded machine, a slow stage), a step that comes during a
    round must not go alone right after it, its own wait spent: the other member would come back
    during that round, and so on, two members taking turns for good (every round one row). Here both
    start together: the first one's first round goes before the other is a member, so they start
    out of step; from the next round on they step together (not [1, 1, 1, 1, ...])."""
    monkeypatch.setattr(lockstep, "GATHER_S", 0.2)
    batcher = _SlowRounds(round_s=0.3)
    a, b = object(), object()
    for m in (a, b):
        batcher.decoding(m)
    errors: list[BaseException] = []

    def steps(model):
        try:
            with mx.stream(any_thread_stream()):  # as a generation's thread
                for _ in range(5):
                    time.sleep(0.01)  # sampling the last token
                    batcher.step(model, mx.zeros((1, 1), dtype=mx.int32))
        except BaseException as exc:  # noqa: BLE001 - the test fails with it
            errors.append(exc)

    threads = [threading.Thread(target=steps, args=(m,)) for m in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert batcher.rows[1:5] == [2, 2, 2, 2], batcher.rows
