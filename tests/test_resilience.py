"""FailoverSource: a failed placement is replaced and the generation replays without loss."""

import asyncio

import pytest

from meshnode.generation import SamplingParams
from meshnode.resilience import FailoverSource, NotReady, PlacementLost

TRUE = list(range(100, 120))  # what an unfailing greedy run produces after any prompt


class Placement:
    """Deterministic 'model': continues TRUE from where the given prefix left off; may fail."""

    def __init__(self, epoch, fail_after=None):
        self.epoch, self.fail_after, self.prompts = epoch, fail_after, []

    async def tokens(self, prompt, params):
        self.prompts.append(list(prompt))
        done = len(prompt) - 3  # the original prompt has 3 tokens
        for i, t in enumerate(TRUE[done: done + params.max_tokens]):
            if self.fail_after is not None and i == self.fail_after:
                raise PlacementLost("stage died")
            yield t


class Mesh:
    def __init__(self, placements, ready_after=0):
        self.placements, self.calls, self.ready_after = placements, 0, ready_after

    def current(self, after):
        self.calls += 1
        p = self.placements[0]
        if after is not None:
            newer = [q for q in self.placements if q.epoch > after]
            if not newer or self.calls <= self.ready_after:
                raise NotReady("not yet")
            p = newer[0]
        return p


def collect(src, n=20):
    async def go():
        return [t async for t in src.tokens([1, 2, 3], SamplingParams(max_tokens=n))]

    return asyncio.run(go())


def test_replays_prompt_plus_produced_on_new_plan():
    first, second = Placement(1, fail_after=7), Placement(2)
    mesh = Mesh([first, second], ready_after=5)
    assert collect(FailoverSource(mesh.current, poll=0.01)) == TRUE
    assert second.prompts == [[1, 2, 3, *TRUE[:7]]]


def test_several_failures_within_attempts():
    ps = [Placement(1, fail_after=3), Placement(2, fail_after=4), Placement(3)]
    assert collect(FailoverSource(Mesh(ps).current, poll=0.01, attempts=3)) == TRUE


def test_gives_up_after_attempts_and_deadline():
    with pytest.raises(PlacementLost):
        collect(FailoverSource(Mesh([Placement(1, fail_after=2), Placement(2, fail_after=2)]).current,
                               poll=0.01, attempts=2))
    with pytest.raises(PlacementLost, match="no new plan"):
        collect(FailoverSource(Mesh([Placement(1, fail_after=2)]).current, poll=0.01, deadline=0.3))


def test_other_errors_are_not_retried():
    class Gone(Exception):
        pass

    def current(after):
        if after is not None:
            raise Gone("model no longer fits")
        return Placement(1, fail_after=1)

    with pytest.raises(Gone):
        collect(FailoverSource(current, poll=0.01))


def test_giving_up_raises_what_the_caller_maps_it_to():
    """The node maps a generation lost for good to the API's 503 with Retry-After (not a 500)."""
    from meshnode.api.validation import ApiError

    def unavailable(exc):
        return ApiError(503, f"lost: {exc}", headers={"Retry-After": "2"})

    for source in (FailoverSource(Mesh([Placement(1, fail_after=2), Placement(2, fail_after=2)]).current,
                                  poll=0.01, attempts=2, give_up=unavailable),
                   FailoverSource(Mesh([Placement(1, fail_after=2)]).current, poll=0.01, deadline=0.3,
                                  give_up=unavailable)):
        with pytest.raises(ApiError) as info:
            collect(source)
        assert info.value.status == 503 and isinstance(info.value.__cause__, PlacementLost)
