"""Speculative decoding across the pipeline: a drafter's guesses checked by every stage in one pass.

With one request in flight a pipeline's stages take turns: each waits for the hop while another
computes. A drafter on the head (meshnode.serving.drafting) guesses the next k tokens; the last
token and the k guesses go through every stage as one step of k+1 positions (one hop per stage for
up to k+1 tokens), and the head keeps the guesses the model confirms, plus the model's own next
token. Each stage then drops the positions of the rejected guesses from its KV cache
(meshnode.model.rewind), with the next pass's message.

Exactness: the model's token at every position is drawn as one-at-a-time decoding would draw it
(greedy: the argmax; sampling: mlx-lm's sampler, a seeded request's draw ``i`` from its own key
(seed, i), meshnode.serving.sampler), and a guess is kept only when it equals that token. The
answer is therefore the same tokens as without speculation, for greedy and for seeded sampling
(failover replays included), and unseeded sampling keeps its distribution: for a drafter that
proposes one token per position, accepting when the model's draw equals it is the standard
speculative acceptance rule (accept x with probability p(x); otherwise a draw from p without x).

How many to guess (:class:`DraftLength`): the acceptance rate is measured per request, the cost
of a pass by its positions per placement (:class:`PassCosts`); k maximizes the expected tokens per
second (where passes fill the pipeline, of the pipeline kept full: :func:`filled_rate`), and is 0
(plain decoding, the stages building each step ahead again) where guessing does not pay. It is
probed again with one guess after :data:`PROBE_AFTER` plain steps (a pass of its own behind the
plain one where passes may fill the pipeline, else a pass of two positions), then after twice as
many each time it still does not pay. A drafter that finds nothing to guess (:data:`DRY_RUN` times
in a row, or at once when a pause has just ended) pauses the request the same way. In a pause the
steps are plain: the stages build each one ahead (a remote stage) or, where every stage is local,
each step's graph is built while the one before computes, as mlx-lm's ``generate_step`` does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from meshnode.model.shard import any_thread_stream
from meshnode.serving.drafting import Drafter
from meshnode.serving.sampler import make_indexed_sampler, sampled
from meshnode.serving.sampling import SamplingParams
from meshnode.tracing import mark

K_MAX = 8  # the most tokens guessed per pass
PROBE_AFTER = 16  # plain steps before guessing is tried again where it did not pay (doubling to PROBE_MAX)
PROBE_MAX = 256
# The least chance that a pass sent behind the one in flight is kept, to send it. Low: one guess
# two deep cost 2 % of the speed where none was kept (p = 0, the benchmark's test drafter) and
# gave 1.31x where half were (p = 0.5), so it pays from about 0.04; 0.1 leaves room for the
# estimate's noise. (At 0.4 three misses in a row paused a request at p = 0.5, or 0.8.)
FILL_MIN = 0.1
# ... for the pass beyond one per stage (pipe_depth): it only saves the first stage its wait for the
# hops and the head's turn, and a cancelled one delays the pass that replaces it by a whole step at
# the first stage; kept with chance q it pays where q * gain > (1 - q) * step. Measured
# (benchmarks.speculative --fixed 0,2 0,3): it gained 3 % where every guess was right (p = 1.0) and
# cost 12 % at p = 0.8, sent from 0.85 (the running estimate passes that after a few right guesses
# in a row), so a gain of 0.03 step: 0.97. The estimate (capped at 0.99) reaches it only where
# nearly every guess comes right, one guess ahead (0.99 ** 2).
FILL_DEEP = 0.97
EMA = 0.2  # weight of the newest observation in the running estimates
# Times in a row a drafter finds nothing before the request pauses drafting (plain steps are cheaper
# in a pause: built ahead). A few: prompt lookup finds nothing for a position or two after each
# change to what it copies.
DRY_RUN = 4


class PassCosts:
    """What a pass through a placement's stages costs by its positions n: ``one + extra * (n - 1)``
    seconds, fitted to the passes seen (least squares, recent passes weighing most), shared by the
    placement's requests. Where extra positions come almost free (a GPU streaming the weights once
    for all of them) guessing pays at modest acceptance; where each costs nearly a step of its own
    (a CPU computing every position: ~0.9 here) it pays only when nearly every guess is right."""

    DECAY = 0.95  # weight left to the older passes at each new one

    def __init__(self, one: float | None = None, extra: float | None = None):
        self._lock = threading.Lock()
        self._sums = [0.0] * 5  # weight, x, y, x*x, x*y (x: positions - 1, y: seconds)
        if one is not None:  # a starting fit (tests)
            self.observe(1, one)
            if extra is not None:
                self.observe(2, one + extra)

    def observe(self, positions: int, seconds: float) -> None:
        x, y = positions - 1, seconds
        with self._lock:
            self._sums = [self.DECAY * s + v for s, v in zip(self._sums, (1.0, x, y, x * x, x * y))]

    def fit(self) -> tuple[float | None, float | None]:
        """(one, extra): None where the passes seen cannot tell yet."""
        w, sx, sy, sxx, sxy = self._sums
        if w == 0:
            return None, None
        spread = sxx * w - sx * sx
        if spread <= 1e-9 * w * w:  # every pass had the same positions
            return (sy / w, None) if sx == 0 else (None, None)
        extra = (sxy * w - sx * sy) / spread
        return (sy - extra * sx) / w, extra

    def ratio(self) -> float:
        """A further position's cost against a one-position step's (0.25 until measured)."""
        one, extra = self.fit()
        if one is None or extra is None or one <= 0:
            return 0.25
        return max(0.0, extra / one)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one pass yields with k guesses each confirmed with probability ``alpha`` (until the first
    that is not): the confirmed prefix plus the model's own token."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class DraftLength:
    """k for a request's next pass: the acceptance rate measured on its passes (a running count
    of confirmed guesses against guesses up to the first rejection), the cost from ``costs``."""

    def __init__(self, costs: PassCosts, k_max: int = K_MAX, prior: float = 0.6, fills: bool = False,
                 stages: int = 1):
        """``fills``: passes of guesses may follow the one in flight (a pipeline of ``stages`` with
        remote ones): k is then chosen for a pipeline kept full (:func:`filled_rate`)."""
        self.costs, self.k_max, self.fills, self.stages = costs, k_max, fills, stages
        self._hits, self._trials = prior * 2, 2.0  # a prior of two guesses at ``prior``
        self._plain_left = 0  # plain steps before trying again
        self._probe = False  # the next pass guesses whatever the estimate says (it measures again)
        self._probe_fill = False  # the probe is a pass behind the one in flight (fill_ok), until observed
        self._pause = PROBE_AFTER  # plain steps of the next pause
        self._dry = 0  # times in a row the drafter found nothing to guess
        self._dry_pause = PROBE_AFTER  # plain steps of the next pause for finding nothing
        self._after_pause = False  # a pause ended and nothing was guessed since
        # The next pass measures the placement's costs: it goes alone, nothing sent behind it (only a
        # pass alone in the stages times what its positions cost; PassCosts).
        self._measuring = False

    @property
    def alpha(self) -> float:
        return self._hits / self._trials if self._trials else 0.0

    def choose(self) -> int:
        self._measuring = False
        if self._plain_left > 0:
            return 0
        if self._probe:  # one guess: the cheapest measure of whether they come right now
            self._probe = False
            if self.fills and self.stages > 1:  # a pass behind the plain one, which costs a stage's wait at most
                self._probe_fill = True
                return 0
            return 1
        one, extra = self.costs.fit()
        if extra is None:  # the placement's cost of a guess is not measured yet: measure it cheaply,
            # a plain step, then a pass with one guess, each alone (where passes fill the pipeline,
            # one with a pass behind it would never be measured, and k stay 1 for good)
            self._measuring = True
            return 0 if one is None else 1
        ratio, alpha = self.costs.ratio(), min(self.alpha, 0.99)
        # Where passes fill the pipeline, against one-position passes keeping it full; else (one
        # stage's formula) against plain steps.
        stages = self.stages if self.fills else 1
        best_k, best = 0, filled_rate(alpha, 0, ratio, stages)
        for k in range(1, self.k_max + 1):
            rate = filled_rate(alpha, k, ratio, stages)
            if rate > best * 1.02:  # a guess must pay for itself with a margin
                best_k, best = k, rate
        if best_k == 0 and self.fill_ok(0):
            # Guesses pay as passes behind the one in flight, not inside it. (With one stage every
            # pass behind is one beyond a pass per stage: where none would be sent, a 0 here
            # without a pause would leave the drafter never asked, and steps never built ahead.)
            return 0
        if best_k == 0:  # plain steps, then a probe; each probe that does not pay waits twice as long
            self._plain_left = self._pause
            self._pause = min(self._pause * 2, PROBE_MAX)
        else:
            self._pause = PROBE_AFTER
        return best_k

    def fill_ok(self, ahead: int, in_flight: int = 1) -> bool:
        """Whether a pass of guesses behind ``in_flight`` passes holding ``ahead`` guesses is worth
        sending: it is kept only if they and its own first guess are all confirmed. A cancelled one
        costs little (the first stage computes it while it would wait anyway; the others never see
        it, or see it while the head computes the pass that replaces it). A pass beyond one per
        stage (``in_flight >= stages``) is worth it only when nearly sure (FILL_DEEP)."""
        if not self.fills or self._plain_left > 0 or self._measuring:
            return False
        deep = in_flight >= self.stages
        if self._probe_fill and ahead == 0 and not deep:
            return True
        return min(self.alpha, 0.99) ** (ahead + 1) >= (FILL_DEEP if deep else FILL_MIN)

    def paused(self) -> bool:
        """Whether the next step is surely plain (the stages may build it ahead)."""
        return self._plain_left > 1

    @property
    def plain_left(self) -> int:
        """Plain steps left in the pause (0: none)."""
        return self._plain_left

    def dry(self) -> None:
        """The drafter was asked and found nothing to guess: :data:`DRY_RUN` times in a row, or the
        first time after a pause, the request pauses (twice as long each time)."""
        self._dry += 1
        if self._dry >= DRY_RUN or self._after_pause:
            self._dry, self._after_pause = 0, False
            self._plain_left = self._dry_pause
            self._dry_pause = min(self._dry_pause * 2, PROBE_MAX)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            if self._plain_left > 0:
                self._plain_left -= 1
                self._probe = self._after_pause = self._plain_left == 0
            return
        self._probe_fill = False
        self._dry, self._after_pause, self._dry_pause = 0, False, PROBE_AFTER
        trials = accepted + (accepted < drafted)
        self._hits = (1 - EMA) * self._hits + accepted
        self._trials = (1 - EMA) * self._trials + trials


@dataclass
class Speculation:
    """What a placement gives its requests to speculate with."""

    # A drafter for a request's tokens so far (None: that request decodes without speculation).
    drafter: Callable[[Sequence[int]], Drafter | None]
    costs: PassCosts = field(default_factory=PassCosts)
    # Told of every pass that checked guesses: (guessed, confirmed, tokens yielded, passes behind it
    # cancelled by its rejection) (meshnode.metrics).
    on_pass: Callable[[int, int, int, int], None] | None = None
    k_max: int = K_MAX
    depth: int | None = None  # passes in flight at once (None: meshnode.serving.speculative.pipe_depth)


def why_not(params: SamplingParams, limit: tuple[int | None, str]) -> str:
    """Why a request cannot speculate ('' when it can)."""
    if params.processed:
        return "logits processors (penalties, a bias, a grammar) see one token at a time"
    if limit[0] == 0:
        return limit[1] or "the cache cannot be cut back"
    return ""


def speculative_tokens(model, cache, history: list[int], params: SamplingParams, spec: Speculation,
                       drafter: Drafter, *, max_tokens: int, others: Callable[[], bool] = lambda: False) -> Iterator:
    """Token ids (or Sampled) of a request whose stages hold every position of ``history`` but the
    last (prefilled); ``model`` is the request's PipelineModel, ``cache`` its cache list, ``drafter``
    its guesser (``spec.drafter(history)``). ``others()``: other requests decode on the placement
    now (steps are then plain: they batch).

    Passes go through a :class:`~meshnode.serving.passes.PassPipe`: up to ``depth`` of them in
    flight, each after the first made of guesses that assume the ones ahead are confirmed. A pass's
    logits check its own guesses and the first token of the pass behind it; at the first rejection
    the passes behind are cancelled and every stage cut back to the confirmed positions."""
    sample = make_indexed_sampler(params)
    greedy, top = params.temperature == 0, params.top_logprobs
    stages = len(model.state.sessions)
    depth = spec.depth if spec.depth is not None else pipe_depth(model.state.sessions)
    depth = max(1, getattr(drafter, "fixed_depth", None) or depth)  # the test drafter's, where it sets one
    length = DraftLength(spec.costs, spec.k_max, fills=depth > 1, stages=stages)
    fixed = getattr(drafter, "fixed_k", None)  # the test drafter's: that many guesses, whatever they cost
    window = model.rewind_limit()[0]  # a sliding window: guesses only while the cut stays inside it
    held = len(history) - 1  # confirmed positions in the stages' caches
    local = not any(s.remote for s in model.state.sessions)
    pipe = model.passes(held)
    y, n = history[-1], 0
    # Tokens drawn and not yet yielded: the next passes are sent first, so that the stages compute
    # while the consumer detokenizes and streams these (on the head's core, between two passes).
    drawn: list = []
    try:
        while n < max_tokens:
            room = max_tokens - n  # positions that may still yield a token
            if window is not None:
                room = min(room, window - held - 1)
            k = 0 if others() else min(length.choose() if fixed is None else fixed, room - 1)
            dry = False  # the drafter found nothing for this position (told to ``length`` once)
            if not pipe:
                drafts = drafter.propose(k) if k > 0 else []
                if k > 0 and not drafts:
                    dry = True
                    length.dry()
                fill = depth > 1 and not others() and (fixed is not None or length.fill_ok(0))
                if not drafts and not fill and not pipe.cut_pending:  # a plain step (it may batch)
                    yield from drawn
                    drawn = []
                    if local and length.paused() and not others():
                        # A pause: its steps built ahead, as generate_step does.
                        for y, logprobs in _plain_run(model, cache, y, min(length.plain_left, max_tokens - n),
                                                      greedy, sample, params.offset + n, others):
                            length.observe(0, 0)
                            held += 1
                            n += 1
                            drafter.extend([y])
                            yield sampled(y, logprobs[0], top) if top >= 0 else y
                        continue
                    model.may_promise = length.paused()
                    started = time.perf_counter()
                    logits = model(mx.array([[y]], dtype=mx.uint32), cache)[0]
                    out, logprobs = _draws(logits, [], greedy, sample, params.offset + n)
                    spec.costs.observe(1, time.perf_counter() - started)
                    length.observe(0, 0)
                    held += 1
                    y = out[-1]
                    yield sampled(y, logprobs[0], top) if top >= 0 else y
                    n += 1
                    drafter.extend(out)
                    continue
                model.alone()
                pipe.send([y, *drafts])
            # Fill: passes of guesses behind the ones in flight, while each may well be confirmed.
            while len(pipe) < depth and not others():
                ahead = pipe.in_flight()[1:]  # guesses in flight (the first token is confirmed)
                size = 1 + max(k, 0)
                if len(ahead) + 1 + size > room or not (fixed is not None or length.fill_ok(len(ahead), len(pipe))):
                    break
                guesses = drafter.propose(len(ahead) + size)
                if guesses[:len(ahead)] != ahead or len(guesses) <= len(ahead):
                    if not ahead and not guesses and not dry:
                        length.dry()
                    break  # the drafter has nothing more (or changed its mind)
                model.alone()
                pipe.send(guesses[len(ahead):])
            yield from drawn
            drawn = []
            mark("spec.wait")
            p, logits = pipe.result()
            behind = pipe.in_flight()[:1]
            checks = p.tokens[1:] + behind  # the guesses this pass's logits check
            out, logprobs = _draws(logits, checks, greedy, sample, params.offset + n)
            mark("spec.drawn")
            # out stops at the first draw that differs from its check: the ones before it are confirmed
            accepted = next((j for j, (a, b) in enumerate(zip(out, checks)) if a != b), min(len(out), len(checks)))
            if p.alone:
                spec.costs.observe(len(p.tokens), time.perf_counter() - p.sent)
            length.observe(len(checks), accepted)
            held = p.start + len(out)
            cancelled = 0
            if accepted < len(checks):  # a rejection: what is behind it is cancelled
                cancelled = len(pipe)
                pipe.cancel(held)
            if checks and spec.on_pass is not None:
                spec.on_pass(len(checks), accepted, len(out), cancelled)
            y = out[-1]
            out = out[:max_tokens - n]
            drawn = [sampled(token, logprobs[j], top) if top >= 0 else token for j, token in enumerate(out)]
            n += len(out)
            drafter.extend(out)
        yield from drawn
    finally:
        if len(pipe):  # the consumer stopped early: nothing waits for the passes in flight
            pipe.cancel(held)


def _draws(logits: mx.array, checks: list[int], greedy: bool, sample, offset: int) -> tuple[list[int], mx.array]:
    """The model's tokens at a pass's positions (and the log probabilities of every position),
    drawn as one-at-a-time decoding would draw them (draw ``offset + j`` at position j), up to the
    first that differs from ``checks[j]`` (the guessed input of the position after), or all of them.
    Greedy is the argmax of the log probabilities, as mlx-lm's: in bfloat16, subtracting the
    log-sum-exp rounds, and the argmax of the raw logits can be another token."""
    out: list[int] = []
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if greedy:
        picks = mx.argmax(logprobs, axis=-1).tolist()
        for j, pick in enumerate(picks):
            out.append(pick)
            if j >= len(checks) or pick != checks[j]:
                break
        return out, logprobs
    for j in range(logits.shape[0]):
        # (1, vocab), as generate_step samples: MLX draws differently from a (vocab,) row
        out.append(sample(logprobs[j:j + 1], offset + j).item())
        if j >= len(checks) or out[-1] != checks[j]:
            break
    return out, logprobs


def _plain_run(model, cache, y: int, steps: int, greedy: bool, sample, offset: int,
               others: Callable[[], bool]) -> Iterator[tuple[int, mx.array]]:
    """Up to ``steps`` plain one-position steps from token ``y`` on stages that are all local, each
    step's graph built and its evaluation started while the one before computes (as mlx-lm's
    ``generate_step``); yields (token, its log probabilities). Draw ``offset + i`` at step i, as
    :func:`_draws`. Stops building ahead once ``others()`` (another request decodes)."""

    def step(token: mx.array, index: int) -> tuple[mx.array, mx.array]:
        logits = model(token.reshape(1, 1), cache)[0]
        with mx.stream(any_thread_stream()):  # the shards' stream: the draw is built where they are
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return (mx.argmax(logprobs, axis=-1) if greedy else sample(logprobs, index)), logprobs

    if steps <= 0:
        return
    current = step(mx.array([y], dtype=mx.uint32), offset)
    mx.async_eval(*current)
    for i in range(steps):
        after = None
        if i + 1 < steps and not others():
            after = step(current[0], offset + i + 1)
            mx.async_eval(*after)
        yield current[0].item(), current[1]
        if after is None:
            return
        current = after


def filled_rate(alpha: float, k: int, ratio: float, stages: int) -> float:
    """Tokens per one-position step's time of a pipeline of ``stages`` kept full of passes of k + 1
    positions: each stage spends ``1 + ratio * k`` steps on a pass, which yields
    :func:`expected_tokens`; when a pass's k guesses and the first of the pass behind are not all
    confirmed (1 - alpha^(k+1)), the passes behind are cancelled and the next token comes after a
    whole traversal, ``stages - 1`` passes' time more. With one stage (or no fill): the rate of
    passes against plain steps."""
    refill = 1.0 + (stages - 1) * (1.0 - alpha ** (k + 1))
    return expected_tokens(alpha, k) / ((1.0 + ratio * k) * refill)


def pipe_depth(sessions) -> int:
    """Passes in flight at once where a stage is remote: one per stage (each computes one while the
    others compute theirs) and one more, waiting at the first stage, so that it starts its next
    pass as soon as it ends one, not a hop after the head hears of the last stage's result. One
    where every stage is local (they share this thread)."""
    return len(sessions) + 1 if any(s.remote for s in sessions) else 1
