"""A pause for a drafter that finds nothing ends as soon as a free drafter (prompt lookup) has a
guess again: a model that answers in its own words for a while, then quotes its context, is
speculated from where the quote begins, not from wherever the doubling pauses happen to end.

Over local stages (their plain steps built ahead, speculative._plain_run) and as a head with a
peer: the first stage served by a StageServer behind a real data port on loopback, reached by
RemoteStage and HopSession as a head reaches its peers, the last the head's own. There the steps
of the pause promise the peer's stage their next one (it builds it ahead), passes fill the
pipeline, and the pause's end keeps the promise. Every
answer is the tokens of decoding one at a time.
"""

from __future__ import annotations

from unittest import mock

import pytest

from meshnode.model.scheduler import TokenScheduler
from meshnode.model.shard import Shard
from meshnode.serving.draft_length import DRY_RUN, REMEASURE, DraftLength, PassCosts
from meshnode.serving.sampling import SamplingParams
from meshnode.transport.dataport import DataServer
from meshnode.transport.hop import HopSession, serve_forward
from meshnode.transport.remote_stage import RemoteStage
from meshnode.transport.stage_server import StageServer
from meshnode.trust.auth import ClusterAuth
from tests.speculation import TEXT, Patchy, model_cases, plain, speculate, stages_of

pytestmark = pytest.mark.timeout(240)

model_case = model_cases()

EPOCH, KEY = 7, "pause test key"
N = 60
# The answer's positions (from its first token) where the drafter has guesses: inside the second
# pause (the first runs from the 4th token for REMEASURE, the second from its end for twice as long).
QUOTE = (DRY_RUN + REMEASURE + 6, DRY_RUN + REMEASURE + 26)


class FixedCosts(PassCosts):
    """Costs where guesses pay (a further position 5 % of a step, as on a GPU), whatever the
    machine measures: the pauses and k do not depend on its timings."""

    def __init__(self):
        super().__init__(0.1, 0.005)
        self.observe = lambda positions, seconds: None
        self.observe_filled = lambda positions, seconds: None


def head_and_peer(path, cuts, closers):
    """The model's layers in stages as a head sees them: the last one its own (a LocalStage), the
    ones before served by a peer (a StageServer behind a data port on loopback, reached through
    RemoteStage handles)."""
    from meshnode.serving.local_stage import LocalStage

    shards = {(a, b): Shard(path, a, b) for a, b in zip(cuts, cuts[1:-1])}
    scheduler = TokenScheduler("test-pause")
    server = StageServer(scheduler, vocab_size=512, max_chunk=512, max_context=4096)
    server.serve(EPOCH, shards)
    auth = ClusterAuth(KEY)
    data = DataServer(
        "127.0.0.1",
        0,
        auth=auth,
        verify=True,
        forward=lambda conn, opening, host: serve_forward(server, scheduler.run_here, conn, opening, host),
    )
    closers += [scheduler.stop, data.close]
    return [
        RemoteStage(
            node_id="peer",
            channel=mock.MagicMock(),
            loop=None,
            start=a,
            end=b,
            epoch=EPOCH,
            hidden_size=shard.hidden_size,
            hop_timeout=5.0,
            data_port=lambda: ("127.0.0.1", data.port),
            auth=auth,
            caller="head",
            data_session=HopSession,
        )
        for (a, b), shard in shards.items()
    ] + [LocalStage(Shard(path, cuts[-2], cuts[-1]))]


def test_a_free_drafters_guess_ends_a_pause_for_finding_nothing_and_only_that_pause():
    length = DraftLength(PassCosts(one=0.1, extra=0.005), k_max=4)
    for _ in range(DRY_RUN):
        assert length.choose() > 0
        length.dry()
    assert length.dry_paused and length.plain_left == REMEASURE
    for _ in range(3):
        length.observe(0, 0)
    length.found()  # a guess again: the step in flight (or promised) is the pause's last
    assert length.plain_left == 1 and not length.paused() and not length.dry_paused
    assert length.choose() == 0
    length.observe(0, 0)
    assert length.choose() == 1  # then a probe, as at a pause's end
    length.observe(1, 1)
    # A pause because guesses do not pay (none confirmed, each costing a step) is not ended by one.
    dear = DraftLength(PassCosts(one=0.1, extra=0.1), k_max=4, prior=0.05)
    assert dear.choose() == 0 and dear.plain_left == REMEASURE
    assert not dear.dry_paused
    dear.found()
    assert dear.plain_left == REMEASURE


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_quote_past_the_first_pause_is_speculated_from_where_it_begins(model_case, where):
    name, path, model, tokenizer = model_case
    prompt = tokenizer.encode(TEXT)
    closers: list = []
    try:
        for params in (SamplingParams(max_tokens=N), SamplingParams(max_tokens=N, temperature=0.8, seed=77)):
            want = plain(model, prompt, N, params if params.temperature else None)
            reference = prompt + want
            confirmed = {}
            quote = [(len(prompt) + QUOTE[0], len(prompt) + QUOTE[1])]  # QUOTE, counted from the prompt's end
            for free in (True, False):
                stages = stages_of(path, [0, 2, 4]) if where == "local" else head_and_peer(path, [0, 2, 4], closers)
                passes: list = []
                got = speculate(
                    stages,
                    prompt,
                    params,
                    lambda h, reference=reference, quote=quote, free=free: Patchy(h, reference, quote, free),
                    passes,
                    depth=None if where == "remote" else 1,
                    costs=FixedCosts(),
                )
                assert got == want, (name, where, free, params)
                confirmed[free] = sum(a for _, a, _, _ in passes)
            # Not free: asked again only where the second pause ends, past the quote. Free: asked
            # at every token of the pause, it guesses from the quote's second token on (one step in
            # flight or promised, then a probe of one guess, then passes of several).
            assert confirmed[False] == 0, (name, where, confirmed)
            assert confirmed[True] >= QUOTE[1] - QUOTE[0] - 8, (name, where, confirmed)
    finally:
        for close in reversed(closers):
            close()


def test_where_a_free_drafter_finds_nothing_each_step_promises_the_next(model_case):
    """A chat answer prompt lookup finds nothing in: every step but the first few (the DRY_RUN
    misses before the pause) promises the peer's stage that the next is plain too, so it builds
    each step ahead, as without speculation."""
    from meshnode.model.shard import Shard as ShardClass

    name, path, model, tokenizer = model_case
    prompt = tokenizer.encode(TEXT)
    closers: list = []
    built: list[int] = []
    original = ShardClass.build_ahead

    def counting(self, cache):
        if self.start == 0:  # the peer's stage
            built.append(len(built))
        return original(self, cache)

    try:
        params = SamplingParams(max_tokens=N)
        want = plain(model, prompt, N, None)
        with mock.patch.object(ShardClass, "build_ahead", counting):
            stages = head_and_peer(path, [0, 2, 4], closers)
            got = speculate(
                stages, prompt, params, lambda h: Patchy(h, prompt + want, [], free=True), costs=FixedCosts()
            )
        assert got == want, name
        assert len(built) >= N - DRY_RUN, (name, len(built))
    finally:
        for close in reversed(closers):
            close()
