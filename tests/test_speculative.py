"""Speculative decoding on local stages: same tokens as without it, every stage's cache cut back right.

The drafters here are real (prompt lookup) or the test drafter that proposes the reference
continuation right with a chosen probability, 4 guesses every pass whatever they cost
(ReferenceDrafter, the benchmark's), so passes with rejections at every position happen, on dense
and MoE families, float32, bf16 and 4-bit. Multi-host runs (2 stages over the data port, a tensor
pair) are in test_speculative_mesh.py.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load

from harness.drafts import ReferenceDrafter
from meshnode.model.build import model_dir_for
from meshnode.model.rewind import CannotRewind, rewind_limit
from meshnode.serving.draft_length import (
    DRY_RUN,
    MIN_GAIN,
    NOISE,
    REMEASURE,
    DraftLength,
    PassCosts,
    expected_tokens,
    filled_rate,
)
from meshnode.serving.drafting import PromptLookup
from meshnode.serving.generation import PipelineModel, generate_tokens
from meshnode.serving.sampling import SamplingParams
from meshnode.serving.speculative import Speculation, why_not
from tests.speculation import TEXT, Patchy, model_cases, plain, speculate, stages_of

model_case = model_cases()


class FixedCosts(PassCosts):
    """Pass costs that stay as given (what the timings of a loaded machine may measure), so that
    k and the pauses chosen from them do not depend on the machine."""

    def __init__(self, one: float, extra: float):
        super().__init__(one, extra)
        self.observe = lambda positions, seconds: None


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_tokens_identical_with_rejections_anywhere(model_case, p, depth):
    name, path, model, tokenizer = model_case
    prompt = tokenizer.encode(TEXT)
    want = plain(model, prompt, 24)
    reference = prompt + want
    for cuts in ([0, 4], [0, 2, 4]):
        passes: list = []
        got = speculate(
            stages_of(path, cuts),
            prompt,
            SamplingParams(max_tokens=24),
            lambda h, cuts=cuts: ReferenceDrafter(h, [reference], p, len(cuts), model.args.vocab_size, 4),
            passes,
            depth,
        )
        assert got == want, (name, cuts, p, depth)
        drafted = sum(d for d, _, _, _ in passes)
        accepted = sum(a for _, a, _, _ in passes)
        # A pass checks its 4 guesses, and with passes behind it (depth > 1) the first of the next
        # (fewer only near max_tokens, where no pass is sent that could yield more than it).
        assert all(d == 4 + (depth > 1) for d, _, _, _ in passes[: len(passes) // 2]), str(passes)
        if p == 1.0:
            assert accepted == drafted
        if p == 0.0:
            assert accepted == 0  # a wrong guess is never the right id
        if p == 0.5:
            assert 0 < accepted < drafted
        cancelled = sum(c for *_, c in passes)
        if depth > 1 and p < 1.0:  # passes sent behind a rejected guess were cancelled
            assert cancelled > 0
        else:
            assert cancelled == 0


def test_prompt_lookup_gives_the_same_tokens(model_case):
    name, path, model, tokenizer = model_case
    prompt = tokenizer.encode(TEXT)
    want = plain(model, prompt, 20)
    got = speculate(stages_of(path, [0, 2, 4]), prompt, SamplingParams(max_tokens=20), PromptLookup)
    assert got == want, name


@pytest.mark.parametrize("depth", [1, 2])
def test_seeded_sampling_is_the_same_draws(model_case, depth):
    """A seeded request's draw i comes from its own key (seed, i): checking guesses in a pass draws
    each position as decoding one at a time would, so the tokens are the same, and a replay that
    starts at an offset (failover) continues them."""
    name, path, model, tokenizer = model_case
    prompt = tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=1234)
    want = plain(model, prompt, 20, params)
    reference = prompt + want
    got = speculate(
        stages_of(path, [0, 2, 4]),
        prompt,
        params,
        lambda h: ReferenceDrafter(h, [reference], 0.7, 0, model.args.vocab_size, 4),
        depth=depth,
    )
    assert got == want, name
    # A replay after failover: the prompt plus the 7 tokens already sent, the draws from offset 7 on.
    again = SamplingParams(max_tokens=13, temperature=0.8, seed=1234, offset=7)
    got = speculate(
        stages_of(path, [0, 2, 4]),
        prompt + want[:7],
        again,
        lambda h: ReferenceDrafter(h, [reference], 0.7, 0, model.args.vocab_size, 4),
        depth=depth,
    )
    assert got == want[7:], name


@pytest.mark.parametrize("depth", [1, 2])
def test_caches_after_rejections_give_the_same_next_logits(model_case, depth):
    """After passes with rejected guesses (and passes behind them cancelled), every stage's cache
    holds exactly the confirmed positions: the next step's logits equal those of a run without
    speculation."""
    name, path, model, tokenizer = model_case
    prompt = tokenizer.encode(TEXT)
    want = plain(model, prompt, 12)
    reference = prompt + want
    stages = stages_of(path, [0, 2, 4])
    pipeline = PipelineModel(stages, "t")
    spec = Speculation(
        drafter=lambda h: ReferenceDrafter(h, [reference], 0.5, 3, model.args.vocab_size, 4), k_max=4, depth=depth
    )
    tokens = generate_tokens(pipeline, prompt, SamplingParams(max_tokens=12), speculation=spec)
    got = [int(next(tokens)) for _ in range(12)]  # the generation stays open: its caches are live
    assert got == want
    sessions = pipeline.state.sessions
    held = [s.cache[s._shard.spec.start].offset for s in sessions]
    # The stages hold the prompt and every token but the last (and possibly a pass's rejects, cut next).
    fed = len(prompt) + len(got) - 1
    x = mx.array([[got[-1]]], dtype=mx.uint32)
    for session, n in zip(sessions, held):
        session.rewind(n - fed)
    spec_logits = pipeline(x, [pipeline.state])
    ref_cache = None
    from mlx_lm.models.cache import make_prompt_cache

    ref_cache = make_prompt_cache(model)
    model(mx.array([prompt + got[:-1]]), cache=ref_cache)
    ref_logits = model(x, cache=ref_cache)[:, -1:, :]
    tol = 1e-4 if "f32" in name else 5e-2
    assert mx.allclose(spec_logits.astype(mx.float32), ref_logits.astype(mx.float32), atol=tol, rtol=tol).item(), name
    tokens.close()


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    d = PromptLookup([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3], longest=3, shortest=2)
    assert d.propose(3) == [5, 6, 7]  # [1, 2, 3] last occurred before 5, 6, 7
    d.extend([5])
    assert d.propose(2) == [6, 7]  # [2, 3, 5] occurred before 6, 7
    d.extend([8])
    assert d.propose(4) == []  # [5, 8] / [3, 5, 8] never occurred before
    assert PromptLookup([1, 2], longest=3).propose(2) == []
    assert PromptLookup([7, 7, 7, 7]).propose(3) == [7]  # overlapping: what follows the latest earlier [7, 7, 7]
    with pytest.raises(ValueError):
        PromptLookup([], longest=1, shortest=2)


def test_draft_length_follows_acceptance_and_cost():
    costs = PassCosts(one=0.1, extra=0.01)
    length = DraftLength(costs, k_max=8)
    for _ in range(30):
        length.observe(4, 4)
    assert length.choose() >= 4  # everything confirmed, extra positions cheap: guess many
    for _ in range(30):
        length.observe(4, 0)
    assert length.choose() == 0  # nothing confirmed: plain steps
    assert length.paused()
    for _ in range(REMEASURE):
        assert length.choose() == 0
        length.observe(0, 0)
    assert length.choose() == 1  # probed again, with one guess, after REMEASURE plain steps
    length.observe(1, 0)
    assert length.choose() == 0  # the probe confirmed nothing: the next pause is twice as long
    for _ in range(2 * REMEASURE - 1):
        length.observe(0, 0)
        assert length.choose() == 0
    length.observe(0, 0)
    assert length.choose() == 1
    # Extra positions as dear as a whole step (a compute-bound stage): guessing pays only when
    # nearly every guess is confirmed.
    dear = DraftLength(PassCosts(one=0.1, extra=0.1), k_max=8)
    for _ in range(30):
        dear.observe(4, 2)
    assert dear.choose() == 0
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


def test_where_passes_fill_the_pipeline_the_probe_is_a_pass_behind_the_plain_one():
    # Extra positions cost nearly a step (this CPU): a probe of two positions would cost a step's
    # compute; one guess sent behind the plain pass costs the first stage only time it would wait.
    length = DraftLength(PassCosts(one=0.1, extra=0.09), k_max=8, fills=True, stages=2)
    assert length.choose() == 0 and length.fill_ok(0)  # the prior: fill from the start
    for _ in range(10):
        length.observe(1, 0)
    assert length.choose() == 0 and not length.fill_ok(0) and length.paused()
    for _ in range(REMEASURE):
        length.observe(0, 0)
    assert length.choose() == 0  # the probe: no guess inside the pass ...
    assert length.fill_ok(0) and not length.fill_ok(0, in_flight=2) and not length.fill_ok(1)  # ... one behind it
    assert length.fill_ok(0)  # still, until a pass that checked a guess is observed
    length.observe(1, 0)
    assert not length.fill_ok(0) and length.choose() == 0 and length.paused()  # refused: a longer pause
    for _ in range(2 * REMEASURE):
        length.observe(0, 0)
    assert length.choose() == 0 and length.fill_ok(0)
    before = length.alpha
    length.observe(1, 1)  # the guess came right: the estimate rises, and decides the next fill
    assert length.alpha > before and length.fill_ok(0) == (length.alpha >= NOISE)


def test_with_one_stage_and_passes_behind_guesses_that_do_not_pay_pause_the_request():
    """One stage with passes in flight behind it (a single remote stage; the tests' depth 3 on one
    local stage): every pass behind is beyond one per stage. Where guesses do not pay
    inside a pass and a pass behind would not be sent either, choose() pauses: answering 0 with no
    pause, it would never ask the drafter again (no guess, no dry run, no pause) and every step would
    go through the pass pipe, not built ahead (as where a loaded CPU measures a further position at a
    whole step's cost)."""
    dear = PassCosts(one=0.1, extra=0.1)  # a further position costs a step: guesses inside a pass never pay
    length = DraftLength(dear, k_max=4, fills=True, stages=1)
    for _ in range(30):
        length.observe(4, 3)
    assert NOISE < length.alpha < 1 - MIN_GAIN
    assert length.choose() == 0 and length.paused() and not length.fill_ok(0, in_flight=1)
    for _ in range(REMEASURE):
        length.observe(0, 0)
    assert length.choose() == 1  # the probe: one guess inside the pass (no pass behind would go)
    # Nearly every guess confirmed: a pass behind the one in flight is worth sending, so 0 is a fill.
    sure = DraftLength(dear, k_max=4, fills=True, stages=1)
    for _ in range(30):
        sure.observe(4, 4)
    assert sure.choose() == 0 and not sure.paused() and sure.fill_ok(0, in_flight=1)


def test_the_pass_beyond_one_per_stage_goes_only_where_nearly_every_guess_comes_right():
    """It saves the first stage a wait of a few percent of a step and costs a whole step when
    cancelled. Sent from an estimate of 0.85 (two guesses ahead: 0.92), it would go after any five
    right guesses in a row at p = 0.8 (a third of the time) and cost more than it saves against at
    most one pass per stage (benchmarks.speculative --fixed compares the two)."""
    length = DraftLength(PassCosts(one=0.1, extra=0.09), k_max=8, fills=True, stages=2)
    for _ in range(30):
        length.observe(1, 1)
    length.observe(1, 0)
    for _ in range(5):
        length.observe(1, 1)
    assert 0.92 < length.alpha < 0.95
    assert length.choose() == 0 and length.fill_ok(0, in_flight=1)  # one pass per stage: yes
    assert not length.fill_ok(1, in_flight=2)  # the one beyond: no
    for _ in range(30):  # every guess right
        length.observe(1, 1)
    assert length.fill_ok(1, in_flight=2)


def test_at_half_the_guesses_confirmed_a_run_of_misses_does_not_stop_the_filling():
    # One guess two deep costs little where it is cancelled every time (p = 0) and pays where it is
    # kept half the time (p = 0.5). A threshold of 0.4 would let three misses in a row pause the
    # request 16 steps, then 32, ...: the benchmark's 48 tokens at p = 0.5 begin with three misses
    # (its seed), and the pauses would take the gain away.
    fresh = DraftLength(PassCosts(one=0.1, extra=0.09), k_max=8, fills=True, stages=2)
    for _ in range(3):  # the benchmark's start
        fresh.observe(1, 0)
        assert fresh.choose() == 0 and fresh.fill_ok(0) and not fresh.paused(), fresh.alpha
    length = DraftLength(PassCosts(one=0.1, extra=0.09), k_max=8, fills=True, stages=2)
    for i in range(30):
        length.observe(1, i % 2)
    for _ in range(4):
        length.observe(1, 0)
        assert length.choose() == 0 and length.fill_ok(0) and not length.paused(), length.alpha
    assert length.alpha < 0.25
    for _ in range(6):  # nothing comes right any more: it stops
        length.observe(1, 0)
    assert length.choose() == 0 and not length.fill_ok(0) and length.paused()


def test_where_passes_fill_the_pipeline_k_is_chosen_against_a_full_pipeline_not_a_plain_step():
    # A CPU's costs: a further position at 0.67 of a step. At 0.8 acceptance a pass of two
    # positions beats a plain step (1.8 tokens for 1.67 steps), but a pipeline kept full of
    # one-position passes does better still.
    costs = PassCosts(one=0.1, extra=0.067)
    alone, filled = DraftLength(costs, k_max=8), DraftLength(costs, k_max=8, fills=True, stages=2)
    for length in (alone, filled):
        for _ in range(30):
            length.observe(1, 0 if _ % 5 == 2 else 1)  # 4 in 5 confirmed
    assert 0.75 < filled.alpha < 0.85
    assert alone.choose() == 1
    assert filled.choose() == 0 and filled.fill_ok(0)
    # Nearly every guess confirmed: longer passes pay even in a full pipeline
    for _ in range(30):
        filled.observe(4, 4)
    assert filled.choose() >= 2
    assert abs(filled_rate(0.0, 0, 1.0, 0.5) - 1.0) < 1e-9  # nothing confirmed: a pass per traversal
    assert abs(filled_rate(1.0, 0, 1.0, 0.5) - 2.0) < 1e-9  # everything: a token per stage's step
    assert abs(filled_rate(0.8, 1, 1.67, 1.0) - 1.8 / 1.67) < 1e-9  # no fill: passes against plain steps


def test_a_new_placement_measures_what_a_guess_costs_before_guessing_more():
    costs = PassCosts()
    length = DraftLength(costs, k_max=8)
    assert length.choose() == 0  # nothing measured: a plain step first
    costs.observe(1, 0.25)
    assert length.choose() == 0  # ... and another: the first built MLX's kernels, and is not kept
    costs.observe(1, 0.1)
    assert length.choose() == 1  # then one guess (twice, for the same reason)
    costs.observe(2, 0.45)
    assert length.choose() == 1
    costs.observe(2, 0.197)  # a further position costs 0.97 of a step (this CPU)
    for _ in range(5):
        length.observe(1, 1)
    assert length.choose() == 0  # even confirmed guesses do not pay for themselves here


def test_where_passes_fill_the_pipeline_the_passes_that_measure_the_costs_go_alone():
    """Only a pass alone in the stages times what its positions cost. Where passes fill the
    pipeline, the pass of one guess that measures a further position goes with nothing behind it:
    with a pass sent behind it, it would never be measured, and every pass after it would guess one
    token for good."""
    costs = PassCosts()
    length = DraftLength(costs, k_max=8, fills=True, stages=2)
    assert length.choose() == 0 and not length.fill_ok(0)  # nothing measured: a plain step, alone
    costs.observe(1, 0.1)
    costs.observe(1, 0.1)  # (a size's first time is not kept: see PassCosts.observe)
    assert length.choose() == 1  # then one guess ...
    assert not length.fill_ok(0) and not length.fill_ok(1)  # ... with nothing behind it
    costs.observe(2, 0.19)
    assert length.choose() == 1 and not length.fill_ok(0)
    costs.observe(2, 0.19)  # a further position costs 0.9 of a step (this CPU)
    assert length.choose() == 0 and length.fill_ok(0)  # measured: one-position passes fill the pipeline


class RecordedCosts(PassCosts):
    """Pass costs that note each pass timed: (its positions, passes checked before it)."""

    def __init__(self, passes: list):
        super().__init__()
        self.passes, self.timed = passes, []

    def observe(self, positions: int, seconds: float) -> None:
        self.timed.append((positions, len(self.passes)))
        super().observe(positions, seconds)


def test_in_a_filled_pipeline_a_new_placement_times_a_guess_first(model_case):
    name, path, model, tokenizer = model_case
    prompt = tokenizer.encode(TEXT)
    want = plain(model, prompt, 32)
    passes: list = []
    costs = RecordedCosts(passes)
    got = speculate(
        stages_of(path, [0, 2, 4]),
        prompt,
        SamplingParams(max_tokens=32),
        lambda h: ReferenceDrafter(h, [prompt + want], 1.0, 1, model.args.vocab_size),
        passes,
        depth=3,
        costs=costs,
    )
    assert got == want, name
    # Plain steps, then passes with a guess, are timed (each alone; two of each, as a size's first
    # time is not kept) before any pass goes behind another: were a pass sent behind each, nothing in
    # the whole request would be timed.
    assert [n for n, _ in costs.timed[:4]] == [1, 1, 2, 2] and costs.timed[3][1] == 1, (name, costs.timed)


def test_pass_costs_fit_the_cost_of_extra_positions():
    costs = PassCosts()
    assert costs.ratio() == 1.0 and costs.fit() == (None, None)  # a whole step until measured
    costs.observe(3, 0.3)  # nothing to measure it against yet (and a size's first: not kept)
    for t in (0.3, 0.1, 0.1):  # plain steps (the first built MLX's kernels: not kept)
        costs.observe(1, t)
    assert costs.fit() == (0.1, None) and costs.ratio() == 1.0  # steps alone cannot tell a position's cost
    costs.observe(3, 0.3)  # a further position costs a step
    one, extra = costs.fit()
    assert abs(one - 0.1) < 1e-9 and abs(extra - 0.1) < 1e-9 and abs(costs.ratio() - 1.0) < 1e-9
    gpu = PassCosts()
    for n, t in [(1, 0.3), (5, 0.3), (3, 0.3), (1, 0.1), (5, 0.104), (1, 0.1), (3, 0.102)]:
        gpu.observe(n, t)
    assert abs(gpu.ratio() - 0.01) < 1e-6
    assert PassCosts(one=0.2).fit() == (0.2, None)


def test_who_cannot_speculate(tmp_path):
    assert why_not(SamplingParams(repetition_penalty=1.1), (None, ""))
    assert why_not(SamplingParams(), (0, "a recurrent state"))
    assert not why_not(SamplingParams(temperature=0.7, seed=3), (4096, ""))
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    assert rewind_limit([KVCache(), KVCache()]) == (None, "")
    assert rewind_limit([KVCache(), RotatingKVCache(max_size=128)]) == (128, "")
    limit, why = rewind_limit([KVCache(), ArraysCache(size=2)])
    assert limit == 0 and "recurrent" in why


def test_a_stage_refuses_a_cut_it_cannot_make():
    from mlx_lm.models.cache import ArraysCache

    from meshnode.model.rewind import rewind_owned

    with pytest.raises(CannotRewind):
        rewind_owned([ArraysCache(size=2)], 1)


def test_reference_drafter_guesses_known_answers_at_a_chosen_rate(tmp_path):
    import json

    answer = list(range(100, 160))
    path = tmp_path / "drafts.json"
    path.write_text(json.dumps({"p": 0.5, "seed": 9, "vocab": 512, "answers": [answer]}))
    make = ReferenceDrafter.from_file(str(path))
    d = make(answer[:10])
    guesses = d.propose(40)
    assert len(guesses) == 40 and all(0 <= g < 512 for g in guesses)
    right = sum(g == a for g, a in zip(guesses, answer[10:50]))
    assert 10 <= right <= 30  # about half
    assert make(answer[:10]).propose(40) == guesses  # the same guesses in every run
    assert make([1, 2, 3]).propose(4) == []  # not a known answer
    d.extend([999])  # the request left the answer: no more guesses
    assert d.propose(4) == []
    assert ReferenceDrafter(answer[:5], [answer], 1.0, 0, 512).propose(3) == answer[5:8]
    assert d.fixed_k is None
    path.write_text(json.dumps({"p": 0.5, "seed": 9, "vocab": 512, "answers": [answer], "k": 3}))
    assert make(answer[:10]).fixed_k == 3
    path.write_text(json.dumps({"off": True}))  # read again for every request: now without speculation
    assert make(answer[:10]) is None
    path.write_text(json.dumps({"prompt_lookup": True}))
    assert isinstance(make(answer[:10]), PromptLookup)


def test_a_draft_model_guesses_and_the_answer_is_the_same(model_case, tmp_path_factory):
    """The served model as its own draft: every guess confirmed. Another model (same vocabulary):
    guesses mostly rejected. The tokens are mlx-lm's either way, and the draft's cache follows."""
    from meshnode.serving.drafting import DraftModel

    name, path, model, tokenizer = model_case
    prompt = tokenizer.encode(TEXT)
    want = plain(model, prompt, 24)
    same = DraftModel.load(str(path))
    passes: list = []
    assert speculate(stages_of(path, [0, 2, 4]), prompt, SamplingParams(max_tokens=24), same.drafter, passes) == want
    drafted, accepted = sum(p[0] for p in passes), sum(p[1] for p in passes)
    assert drafted > 0 and accepted == drafted, (name, passes)
    other_path = model_dir_for(
        tmp_path_factory.getbasetemp() / "models", "llama", num_layers=2, hidden_size=32, dtype="float32", seed=9
    )
    other = DraftModel.load(str(other_path))
    assert other.vocab_size == model.args.vocab_size and other.nbytes > 0
    passes = []
    assert speculate(stages_of(path, [0, 2, 4]), prompt, SamplingParams(max_tokens=24), other.drafter, passes) == want
    assert sum(p[0] for p in passes) > 0


def test_log_probabilities_are_those_of_decoding_one_at_a_time(model_case):
    name, path, model, tokenizer = model_case
    prompt = tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=12, top_logprobs=2)
    alone = list(generate_tokens(PipelineModel(stages_of(path, [0, 2, 4]), "t"), prompt, params))
    reference = prompt + [int(t) for t in alone]
    spec = Speculation(drafter=lambda h: ReferenceDrafter(h, [reference], 0.6, 1, model.args.vocab_size, 4), k_max=4)
    got = list(generate_tokens(PipelineModel(stages_of(path, [0, 2, 4]), "t"), prompt, params, speculation=spec))
    assert [int(t) for t in got] == [int(t) for t in alone]
    tol = 1e-4 if "f32" in name else 5e-2
    for a, b in zip(got, alone):
        assert abs(a.logprob - b.logprob) < tol and [i for i, _ in a.top] == [i for i, _ in b.top], name


def test_test_drafts_with_only_k_fix_the_configured_drafters_guesses(tmp_path):
    """A drafts file (harness/drafts.py) of only {"k": n} keeps the drafter the settings chose (a draft
    model, prompt lookup) and makes it guess n every pass: a mesh test then gets guesses whatever they cost."""
    f = tmp_path / "drafts.json"
    f.write_text('{"k": 3}')
    drafter = ReferenceDrafter.from_file(str(f), configured=PromptLookup)([1, 2, 3])
    assert isinstance(drafter, PromptLookup) and drafter.fixed_k == 3
    f.write_text('{"p": 1.0, "vocab": 512, "answers": [[1, 2, 3, 4]]}')  # answers: the reference drafter
    assert isinstance(ReferenceDrafter.from_file(str(f), configured=PromptLookup)([1, 2, 3]), ReferenceDrafter)


def test_passes_in_flight_drain_when_others_start_decoding(model_case):
    """Another request starts decoding in the middle (its steps and this one's then batch): the
    passes in flight are taken in, none is sent behind them, a pending cut goes out with a pass
    of its own, and plain steps follow; when it is alone again, passes are filled again. The
    tokens are the same throughout."""
    name, path, model, tokenizer = model_case
    from meshnode.serving.speculative import speculative_tokens

    prompt = tokenizer.encode(TEXT)
    want = plain(model, prompt, 40)
    reference = prompt + want
    pipeline = PipelineModel(stages_of(path, [0, 2, 4]), "t")
    cache = pipeline.make_cache()
    mx.eval(pipeline(mx.array([prompt[:-1]], dtype=mx.uint32), cache))
    got: list[int] = []
    checked: list[int] = []  # tokens so far at each pass that checked guesses
    spec = Speculation(drafter=None, k_max=4, depth=3, on_pass=lambda *a: checked.append(len(got)))
    drafter = ReferenceDrafter(prompt, [reference], 0.6, 7, model.args.vocab_size, 2)
    busy = lambda: 8 <= len(got) < 24  # noqa: E731 - others decode while tokens 8 to 23 come
    for token in speculative_tokens(
        pipeline, cache, prompt, SamplingParams(max_tokens=40), spec, drafter, max_tokens=40, others=busy
    ):
        got.append(int(token))
    assert got == want, name
    # At most 3 passes of 3 tokens were in flight at token 8: from token 17 on, plain steps only,
    # until it is alone again at 24.
    assert not [n for n in checked if 17 <= n < 24], checked
    assert [n for n in checked if n >= 24], checked  # guessing resumed
    pipeline.close()


def test_the_next_pass_is_in_flight_while_a_pass_s_tokens_are_handed_on(model_case):
    """The stages compute the next pass while the consumer detokenizes and streams the tokens of the
    last one (on the head's core): each pass after the first is sent before those tokens are yielded."""
    name, path, model, tokenizer = model_case
    from meshnode.serving.speculative import speculative_tokens

    prompt = tokenizer.encode(TEXT)
    want = plain(model, prompt, 30)
    pipeline = PipelineModel(stages_of(path, [0, 2, 4]), "t")
    pipes = []
    opened = pipeline.passes
    pipeline.passes = lambda held: pipes.append(opened(held)) or pipes[-1]
    for depth, fixed_depth in ((3, None), (3, 2)):  # the placement's depth; the test drafter's
        pipes.clear()
        cache = pipeline.make_cache()
        mx.eval(pipeline(mx.array([prompt[:-1]], dtype=mx.uint32), cache))
        drafter = ReferenceDrafter(prompt, [prompt + want], 1.0, 7, model.args.vocab_size, 2, fixed_depth)
        got, in_flight = [], []
        for token in speculative_tokens(
            pipeline,
            cache,
            prompt,
            SamplingParams(max_tokens=30),
            Speculation(drafter=None, k_max=4, depth=depth),
            drafter,
            max_tokens=30,
        ):
            got.append(int(token))
            in_flight.append(len(pipes[0]))
        assert got == want, name
        # Every guess is right: passes of 3 tokens, each yielded with the pipe already full again
        # (3 passes in flight, not the 2 left behind it), until no pass is sent that could yield
        # more than max_tokens.
        full = fixed_depth or depth
        assert in_flight[:21] == [full] * 21, (fixed_depth, in_flight)
        pipeline.close()


def test_a_request_sending_passes_counts_as_decoding_so_another_batches_with_it(model_case):
    """A speculating request whose first steps are passes (never a plain step) is still one that
    decodes: a request that starts beside it sees it and batches, and it then stops sending passes
    (else two speculating chats never batch)."""
    name, path, model, tokenizer = model_case
    from meshnode.serving.lockstep import LockstepGroups

    stages = stages_of(path, [0, 2, 4])
    batcher = LockstepGroups(stages)
    first, second = PipelineModel(stages, "a", batcher=batcher), PipelineModel(stages, "b", batcher=batcher)
    first.make_cache()
    assert not second.others_decoding()
    first.alone()  # what speculative_tokens does before each pass it sends
    assert second.others_decoding() and not first.others_decoding()
    first.close()
    assert not second.others_decoding()


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_tokens_are_mlx_lms_in_bfloat16_where_rounding_decides(tmp_path, depth):
    """mlx-lm picks the argmax of the log probabilities; in bfloat16 subtracting the log-sum-exp
    rounds, so the argmax of the raw logits may be another token. This model and prompt are where
    it is, from the answer's 2nd token on."""
    from meshnode.model.build import build_model

    path = build_model(
        tmp_path / "qwen3", "qwen3", num_layers=6, hidden_size=64, intermediate_size=128, dtype="bfloat16", seed=5
    )
    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the sea."}], add_generation_prompt=True
    )
    want = plain(model, prompt, 24)
    reference = prompt + want
    for drafter in (PromptLookup, lambda h: ReferenceDrafter(h, [reference], 0.5, 2, model.args.vocab_size, 3)):
        got = speculate(stages_of(path, [0, 3, 6]), prompt, SamplingParams(max_tokens=24), drafter, depth=depth)
        assert got == want


def test_a_drafter_that_finds_nothing_pauses_the_request_each_time_twice_as_long():
    length = DraftLength(PassCosts(one=0.1, extra=0.005), k_max=4)  # guesses pay (a GPU's costs)
    for _ in range(DRY_RUN - 1):
        assert length.choose() > 0
        length.dry()
        assert not length.paused()
    length.dry()  # DRY_RUN times in a row: a pause
    assert length.plain_left == REMEASURE and length.paused()
    for _ in range(REMEASURE):
        assert length.choose() == 0
        length.observe(0, 0)
    assert length.choose() == 1  # the pause over: one guess, to see
    length.dry()  # still nothing: paused again at once, twice as long
    assert length.plain_left == 2 * REMEASURE
    for _ in range(2 * REMEASURE):
        length.observe(0, 0)
    assert length.choose() == 1
    length.observe(1, 1)  # it guessed (right): the count of nothing and the pauses start over
    for _ in range(DRY_RUN - 1):
        length.dry()
        assert not length.paused()
    length.dry()
    assert length.plain_left == REMEASURE


@pytest.mark.slow
@pytest.mark.parametrize("cuts", [[0, 4], [0, 2, 4]])
@pytest.mark.parametrize("depth,costs", [(1, None), (3, None), (3, "dear")])
def test_paused_for_a_drafter_that_finds_nothing_the_steps_built_ahead_give_the_same_tokens(
    model_case, cuts, depth, costs, monkeypatch
):
    """Local stages in a pause run their plain steps built ahead (speculative._plain_run, as
    mlx-lm's generate_step): the same greedy tokens and the same seeded draws as without
    speculation, through drafts that stop and start again (the steps built ahead end where a
    pause ends), also where a failover replay starts at an offset. ``dear``: a further position
    costs a whole step (as a loaded CPU may measure; one stage with passes behind it must still ask
    the drafter after the guesses, and build its steps ahead)."""
    from meshnode.serving import speculative

    runs: list[int] = []
    real = speculative._plain_run

    def counted(model, cache, y, steps, *args):
        runs.append(steps)
        return real(model, cache, y, steps, *args)

    monkeypatch.setattr(speculative, "_plain_run", counted)
    name, path, model, tokenizer = model_case
    prompt = tokenizer.encode(TEXT)
    n = 60
    for params in (SamplingParams(max_tokens=n), SamplingParams(max_tokens=n, temperature=0.8, seed=77)):
        want = plain(model, prompt, n, params if params.temperature else None)
        reference = prompt + want
        at = len(prompt)
        # Nothing ever; guesses for 12 tokens from the 20th (the first pause ends there).
        for windows in ([], [(at + 20, at + 32)]):
            runs.clear()
            got = speculate(
                stages_of(path, cuts),
                prompt,
                params,
                lambda h, reference=reference, windows=windows: Patchy(h, reference, windows),
                depth=depth,
                costs=FixedCosts(0.1, 0.1) if costs == "dear" else None,
            )
            assert got == want, (name, windows, params)
            assert runs and sum(runs) >= n // 2, runs  # most steps were built ahead
        again = SamplingParams(max_tokens=n - 9, temperature=params.temperature, seed=params.seed, offset=9)
        got = speculate(
            stages_of(path, cuts),
            prompt + want[:9],
            again,
            lambda h, reference=reference: Patchy(h, reference, []),
            depth=depth,
        )
        assert got == want[9:], (name, params)
