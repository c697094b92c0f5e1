"""A chat's next turn resumes the prefix its previous turn is still keeping (issue 48).

The API closes a generation's tokens as soon as the answer is complete, and the client sends its
next turn at once, while the generation still runs its last step and then keeps its prefix. The
answer waits for that keep a bounded time (SETTLE_WAIT); a machine slow enough outruns it, and
then the next turn must wait for the keep itself rather than resume an older prefix. Here the
keep is held on an event until the next turn looks for its prefix, with the answer's wait set to
nothing: the outcome does not depend on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from meshnode.model.build import build_model
from meshnode.model.prefixes import PrefixStore, prefix_key
from meshnode.model.scheduler import TokenScheduler
from meshnode.model.shard import Shard
from meshnode.serving import promptcache
from meshnode.serving.batching import BatchedSource
from meshnode.serving.generation import PipelineSource, PrefillOptions
from meshnode.serving.local_stage import LocalStage
from meshnode.serving.promptcache import MIN_REUSE, PrefixIndex
from meshnode.serving.sampling import SamplingParams


class HeldStore(PrefixStore):
    """Keeps a prefix only once ``release`` is set; ``keeping`` is set when a keep begins."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.keeping, self.release = threading.Event(), threading.Event()

    def keep(self, *args, **kwargs):
        self.keeping.set()
        if not self.release.wait(60):
            raise TimeoutError("the test never released the keep")
        return super().keep(*args, **kwargs)


class ReleasingIndex(PrefixIndex):
    """Releases the store's held keep the first time a request looks for a prefix while it is held."""

    def __init__(self, store: HeldStore):
        super().__init__()
        self._store = store

    def match(self, prompt):
        if self._store.keeping.is_set():
            self._store.release.set()
        return super().match(prompt)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(
        tmp_path_factory.mktemp("keep") / "llama",
        "llama",
        num_layers=4,
        hidden_size=64,
        intermediate_size=128,
        dtype="float32",
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", ["pipeline", "batched"])
def test_the_next_turn_waits_for_the_keep_the_answer_outran(model, source, monkeypatch):
    monkeypatch.setattr(promptcache, "SETTLE_WAIT", 0.0)  # the answer does not wait for its keep at all
    store = HeldStore(capacity=1024)
    index = ReleasingIndex(store)
    scheduler = TokenScheduler("test-keep-race")
    try:
        if source == "pipeline":
            stages = [LocalStage(Shard(model, 0, 2), store), LocalStage(Shard(model, 2, 4), store)]
            tokens_of = PipelineSource(scheduler, lambda: stages, prefill=PrefillOptions(), prefixes=index)
        else:
            stages = [LocalStage(Shard(model, 0, 4), store)]
            tokens_of = BatchedSource(scheduler, stages[0], prefixes=index)
        first = list(range(40, 40 + 2 * MIN_REUSE))

        async def answer(prompt: list[int], n: int) -> list[int]:
            out = []
            async with contextlib.aclosing(tokens_of.tokens(prompt, SamplingParams(max_tokens=64))) as tokens:
                async for token in tokens:
                    out.append(int(token))
                    if len(out) == n:
                        break  # the answer is complete: the API closes the tokens
            return out

        async def chat() -> list[int]:
            out = await answer(first, 5)
            # The answer is out and its generation is keeping its prefix (held): the next turn comes now.
            assert await asyncio.to_thread(store.keeping.wait, 30)
            assert not store.release.is_set() and store.hits == 0
            await answer(first + out + [7, 8, 9], 3)
            return out

        out = asyncio.run(chat())
        # Every stage resumed the second turn from what it was fed in the first (prompt and answer
        # but its last token), none prefilled it all again.
        assert store.hits == len(stages), (store.hits, store.reused_positions)
        assert store.reused_positions >= len(stages) * (len(first) + len(out) - 1), store.reused_positions
    finally:
        scheduler.stop()


def test_a_request_waits_only_for_closed_generations_that_give_it_a_longer_start():
    """Waiting is for a generation whose answer is complete (its tokens closed) and whose prefix
    would give the request more than the prefixes kept now: an agent's parallel calls and other
    conversations go on; the next turn of the closed one resumes that one's prefix."""
    index = PrefixIndex()
    system = list(range(100, 100 + 2 * MIN_REUSE))
    kept = system + [1] * 10
    index.add(kept)
    closed = system + [2] * 30  # its prompt and answer
    ended = threading.Event()

    async def run() -> None:
        assert await index.until_kept(ended, closed, timeout=0) is False  # its keep goes on
        # Another conversation, and a new one sharing only the system prompt: nothing to wait for.
        assert await asyncio.wait_for(index.settled_match([9] * 40), 10) is None
        assert await asyncio.wait_for(index.settled_match(system + [3] * 5), 10) == (prefix_key(kept), len(system))
        # A request still generating is not waited for: only closed ones are registered.
        nxt = asyncio.create_task(index.settled_match(closed + [4] * 5))
        await asyncio.sleep(0.3)
        assert not nxt.done()  # the next turn of the closed generation waits for its keep
        key = index.add(closed[:-1])  # what it kept (all but its last token)
        ended.set()
        assert await asyncio.wait_for(nxt, 10) == (key, len(closed) - 1)
        # Once over, it is not waited for again.
        assert await asyncio.wait_for(index.settled_match(closed + [5]), 10) == (key, len(closed) - 1)

    asyncio.run(run())


def test_a_generation_closed_before_it_started_is_over(monkeypatch):
    """A generation whose consumer closed it before its first step (a client gone at once) never
    keeps anything; it is over all the same, so a next turn does not wait for it."""
    monkeypatch.setattr(promptcache, "SETTLE_WAIT", 0.0)
    index = PrefixIndex()
    scheduler = TokenScheduler("test-keep-unstarted")
    opened = threading.Event()

    class Stage:
        start, end = 0, 4

        def open(self, request_id, resume=None):
            opened.set()
            raise AssertionError("the generation was closed before it started")

    tokens_of = PipelineSource(scheduler, lambda: [Stage()], prefill=PrefillOptions(), prefixes=index)
    prompt = list(range(40, 40 + 2 * MIN_REUSE))

    async def run() -> None:
        scheduler.baton.acquire()  # the generation's thread cannot take its first step
        try:
            tokens = tokens_of.tokens(prompt, SamplingParams(max_tokens=8))
            first = asyncio.ensure_future(tokens.__anext__())
            while scheduler.active == 0:  # until the generation is submitted
                await asyncio.sleep(0.01)
            first.cancel()  # the client is gone before the first token
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await first
            await tokens.aclose()
        finally:
            scheduler.baton.release()
        assert await asyncio.wait_for(index.settled_match(prompt + [1, 2, 3]), 10) is None

    try:
        asyncio.run(run())
        assert not opened.is_set()
    finally:
        scheduler.stop()
