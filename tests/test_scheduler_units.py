"""meshnode.model.scheduler: when a generation's tokens reach the event loop (deterministic, no timing)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from meshnode.model.scheduler import TokenJob, TokenScheduler, mlx_idle

pytestmark = pytest.mark.timeout(60)


def _run(steps, monkeypatch) -> tuple[list, list]:
    """Drive the generator ``steps(put)`` on a TokenScheduler; (what the event loop received, what
    was handed to it in order, with the generator's own notes between)."""
    handed: list = []
    original = TokenJob.put

    def put(self, item):
        handed.append(item)
        original(self, item)

    monkeypatch.setattr(TokenJob, "put", put)

    async def main():
        scheduler = TokenScheduler("test-scheduler")
        try:
            return [t async for t in scheduler.submit(steps(handed))]
        finally:
            scheduler.stop()

    return asyncio.run(main()), handed


def test_a_token_that_waited_on_a_remote_stage_is_handed_on_once_the_next_step_is_sent(monkeypatch):
    """A pipeline's step: build, send (then wait: mlx_idle), yield. Token 1 (its step waited) reaches
    the loop only when step 2 waits on the stage, i.e. after step 2 went out: the loop's work for
    it then runs while the stage computes, not while this node computes its own step."""

    def steps(handed):
        with mlx_idle():  # step 1 sent, its reply awaited
            pass
        yield 1
        handed.append("step 2 built and sent")
        with mlx_idle():
            handed.append("step 2 awaits the stage")
        yield 2
        handed.append("generator done")

    got, handed = _run(steps, monkeypatch)
    assert got == [1, 2]
    assert handed[:3] == ["step 2 built and sent", 1, "step 2 awaits the stage"]
    assert handed[3:] == ["generator done", 2, handed[-1]]  # the last token at the end, then the end marker


def test_a_token_computed_here_is_handed_on_at_once_and_held_ones_go_first(monkeypatch):
    """All stages local (no wait): each token is handed on as soon as it is made, and a token
    held from a waited step goes before it."""

    def steps(handed):
        yield 1  # nothing waited: handed on at once
        handed.append("after 1")
        with mlx_idle():
            pass
        yield 2  # held
        handed.append("after 2")
        yield 3  # computed here: 2, then 3

    got, handed = _run(steps, monkeypatch)
    assert got == [1, 2, 3]
    assert handed[:5] == [1, "after 1", "after 2", 2, 3]


def test_held_tokens_come_before_a_failure(monkeypatch):
    """A step that fails after tokens were held: the client gets those tokens, then the failure
    (which the failover source replays from)."""
    handed_out: list = []

    def steps(handed):
        handed_out.append(handed)
        yield 1
        with mlx_idle():
            pass
        yield 2
        with mlx_idle():
            pass
        yield 3  # held
        raise RuntimeError("the stage is gone")

    with pytest.raises(RuntimeError, match="the stage is gone"):
        _run(steps, monkeypatch)
    handed = handed_out[0]
    assert handed[:3] == [1, 2, 3] and isinstance(handed[3], RuntimeError)


class _SlowToClose:
    """Tokens whose close() waits for ``release``: the generation's thread has handed on its end but
    is not yet done with it, the moment stop() can come (the end must still be handed on once only)."""

    def __init__(self, tokens, release):
        self._tokens = iter(tokens)
        self._release = release
        self.closed = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._tokens)

    def close(self):
        self._release.wait(10)
        self.closed.set()


def test_a_generation_that_ended_as_the_scheduler_stops_is_ended_once(monkeypatch):
    release = threading.Event()
    tokens = _SlowToClose([1, 2], release)
    # _run stops the scheduler as soon as the consumer has the end: the job is still tracked then,
    # its thread waiting in close()
    got, handed = _run(lambda handed: tokens, monkeypatch)
    release.set()
    assert got == [1, 2]
    assert tokens.closed.wait(10)
    assert handed[:2] == [1, 2] and len(handed) == 3, handed  # one end marker, not one per ender
