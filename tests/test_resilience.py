"""FailoverSource: a failed placement is replaced and the generation replays without loss."""

import asyncio

import pytest

from meshnode.serving.generation import SamplingParams
from meshnode.serving.resilience import EpochPending, FailoverSource, GenerationFault, NotReady, PlacementLost

TRUE = list(range(100, 120))  # what an unfailing greedy run produces after any prompt


class Placement:
    """Deterministic 'model': continues TRUE from where the given prefix left off; may fail."""

    def __init__(self, epoch, fail_after=None):
        self.epoch, self.fail_after, self.prompts = epoch, fail_after, []

    async def tokens(self, prompt, params):
        self.prompts.append(list(prompt))
        done = len(prompt) - 3  # the original prompt has 3 tokens
        for i, t in enumerate(TRUE[done : done + params.max_tokens]):
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
        collect(
            FailoverSource(
                Mesh([Placement(1, fail_after=2), Placement(2, fail_after=2)]).current, poll=0.01, attempts=2
            )
        )
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

    for source in (
        FailoverSource(
            Mesh([Placement(1, fail_after=2), Placement(2, fail_after=2)]).current,
            poll=0.01,
            attempts=2,
            give_up=unavailable,
        ),
        FailoverSource(Mesh([Placement(1, fail_after=2)]).current, poll=0.01, deadline=0.3, give_up=unavailable),
    ):
        with pytest.raises(ApiError) as info:
            collect(source)
        assert info.value.status == 503 and isinstance(info.value.__cause__, PlacementLost)


class Switching:
    """A placement whose epoch is not switched to on one of its nodes for its first ``pending``
    tries (EpochPending), then serves; the params of every try are kept."""

    def __init__(self, epoch, pending, fail=None):
        self.epoch, self.pending, self.fail, self.tries = epoch, pending, fail, []

    async def tokens(self, prompt, params):
        self.tries.append((list(prompt), params))
        if len(self.tries) <= self.pending:
            raise EpochPending(f"epoch {self.epoch} is not served here yet")
        done = len(prompt) - 3
        for i, t in enumerate(TRUE[done : done + params.max_tokens]):
            if self.fail is not None and i == self.fail:
                raise self.fail_with
            yield t


def test_a_not_yet_switched_epoch_is_retried_on_the_same_placement_without_spending_attempts():
    """As in issue 10's log: the new head has not switched to epoch 2 when the replay reaches it.
    Six refusals in a row with attempts=2: the same placement is tried until it serves."""
    lost, switching = Placement(1, fail_after=5), Switching(2, pending=6)
    mesh = Mesh([lost, switching])
    assert collect(FailoverSource(mesh.current, poll=0.001, attempts=2)) == TRUE
    assert len(switching.tries) == 7 and all(p == [1, 2, 3, *TRUE[:5]] for p, _ in switching.tries)


def test_a_pending_epoch_gives_way_to_a_newer_ready_plan():
    stuck, newer = Switching(1, pending=10**6), Placement(2)
    assert collect(FailoverSource(Mesh([stuck, newer]).current, poll=0.001)) == TRUE
    assert len(stuck.tries) == 1 and newer.prompts == [[1, 2, 3]]


def test_a_pending_epoch_that_never_gets_ready_ends_within_the_deadline():
    with pytest.raises(PlacementLost, match="did not become ready"):
        collect(FailoverSource(Mesh([Switching(1, pending=10**6)]).current, poll=0.01, deadline=0.3))


def test_a_stage_fault_is_reported_at_once_not_replayed():
    """A stage that raises on its input would raise again on a replay: no retry, no wait."""
    from meshnode.api.validation import ApiError

    faulty = Switching(1, pending=0, fail=4)
    faulty.fail_with = GenerationFault("layers [0, 4) failed on this input: ValueError: shapes")
    mesh = Mesh([faulty, Placement(2)])
    source = FailoverSource(mesh.current, poll=0.01, give_up=lambda exc: ApiError(503, str(exc)))
    with pytest.raises(ApiError, match="failed on this input") as info:
        collect(source)
    assert info.value.status == 503 and len(faulty.tries) == 1 and mesh.calls == 1


def test_the_wait_for_a_new_plan_counts_from_the_loss_not_from_the_start():
    """A generation that streamed for longer than the failover deadline still gets its new plan."""

    class Slow(Placement):
        async def tokens(self, prompt, params):
            async for t in super().tokens(prompt, params):
                await asyncio.sleep(0.02)
                yield t

    first, second = Slow(1, fail_after=10), Placement(2)
    assert collect(FailoverSource(Mesh([first, second]).current, poll=0.01, deadline=0.1)) == TRUE


def test_a_replay_carries_how_many_tokens_were_produced():
    first, second = Switching(1, pending=0, fail=7), Switching(2, pending=0)
    first.fail_with = PlacementLost("stage died")
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=9)

    async def go():
        source = FailoverSource(Mesh([first, second]).current, poll=0.01)
        return [t async for t in source.tokens([1, 2, 3], params)]

    assert asyncio.run(go()) == TRUE
    ((_, replayed),) = second.tries
    assert (replayed.offset, replayed.max_tokens, replayed.seed) == (7, 13, 9)


def test_seeded_sampling_resumed_at_an_offset_draws_what_it_would_have_drawn():
    """Token i of a seeded generation is drawn from (seed, i) alone: a replay that starts at
    offset k (failover) continues the draws of the run it replaces."""
    import mlx.core as mx

    from meshnode.serving.sampling import make_request_sampler

    logits = mx.log(mx.softmax(mx.random.normal((1, 64), key=mx.random.key(3)), axis=-1))
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=-12345)
    sampler = make_request_sampler(params)
    whole = [sampler(logits).item() for _ in range(40)]
    assert len(set(whole)) > 5, "the draws should vary"
    resumed = make_request_sampler(SamplingParams(max_tokens=25, temperature=1.0, top_p=0.95, seed=-12345, offset=15))
    assert [resumed(logits).item() for _ in range(25)] == whole[15:]
