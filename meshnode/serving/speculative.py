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
second, and is 0 (plain decoding, the stages building each step ahead again) where guessing does
not pay. It is probed again with one guess after :data:`PROBE_AFTER` plain steps, then after twice
as many each time it still does not pay.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from meshnode.serving.drafting import Drafter
from meshnode.serving.sampler import make_indexed_sampler, sampled
from meshnode.serving.sampling import SamplingParams

K_MAX = 8  # the most tokens guessed per pass
PROBE_AFTER = 16  # plain steps before guessing is tried again where it did not pay (doubling to PROBE_MAX)
PROBE_MAX = 256
EMA = 0.2  # weight of the newest observation in the running estimates


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

    def __init__(self, costs: PassCosts, k_max: int = K_MAX, prior: float = 0.6):
        self.costs, self.k_max = costs, k_max
        self._hits, self._trials = prior * 2, 2.0  # a prior of two guesses at ``prior``
        self._plain_left = 0  # plain steps before trying again
        self._probe = False  # the next pass guesses whatever the estimate says (it measures again)
        self._pause = PROBE_AFTER  # plain steps of the next pause

    @property
    def alpha(self) -> float:
        return self._hits / self._trials if self._trials else 0.0

    def choose(self) -> int:
        if self._plain_left > 0:
            return 0
        if self._probe:  # one guess: the cheapest measure of whether they come right now
            self._probe = False
            return 1
        one, extra = self.costs.fit()
        if extra is None:  # the placement's cost of a guess is not measured yet: measure it cheaply
            return 0 if one is None else 1  # a plain step, then a pass with one guess
        ratio, alpha = self.costs.ratio(), min(self.alpha, 0.99)
        best_k, best = 0, 1.0
        for k in range(1, self.k_max + 1):
            rate = expected_tokens(alpha, k) / (1.0 + ratio * k)
            if rate > best * 1.02:  # a guess must pay for itself with a margin
                best_k, best = k, rate
        if best_k == 0:  # plain steps, then a probe; each probe that does not pay waits twice as long
            self._plain_left = self._pause
            self._pause = min(self._pause * 2, PROBE_MAX)
        else:
            self._pause = PROBE_AFTER
        return best_k

    def paused(self) -> bool:
        """Whether the next step is surely plain (the stages may build it ahead)."""
        return self._plain_left > 1

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            if self._plain_left > 0:
                self._plain_left -= 1
                self._probe = self._plain_left == 0
            return
        trials = accepted + (accepted < drafted)
        self._hits = (1 - EMA) * self._hits + accepted
        self._trials = (1 - EMA) * self._trials + trials


@dataclass
class Speculation:
    """What a placement gives its requests to speculate with."""

    # A drafter for a request's tokens so far (None: that request decodes without speculation).
    drafter: Callable[[Sequence[int]], Drafter | None]
    costs: PassCosts = field(default_factory=PassCosts)
    # Told of every pass that carried guesses: (guessed, confirmed, tokens yielded) (meshnode.metrics).
    on_pass: Callable[[int, int, int], None] | None = None
    k_max: int = K_MAX


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
    now (steps are then plain: they batch)."""
    sample = make_indexed_sampler(params)
    greedy, top = params.temperature == 0, params.top_logprobs
    length = DraftLength(spec.costs, spec.k_max)
    fixed = getattr(drafter, "fixed_k", None)  # the test drafter's: that many guesses, whatever they cost
    window = model.rewind_limit()[0]  # a sliding window: guesses only while the cut stays inside it
    held = len(history) - 1  # positions in the stages' caches
    y, n, rewind = history[-1], 0, 0
    while n < max_tokens:
        k = 0 if others() else min(length.choose() if fixed is None else fixed, max_tokens - n - 1)
        if window is not None:
            k = max(0, min(k, window - held - 2))
        drafts = drafter.propose(k) if k > 0 else []
        model.may_promise = length.paused() and not drafts
        started = time.perf_counter()
        if drafts or rewind:
            logits = model.verify(mx.array([[y, *drafts]], dtype=mx.uint32), rewind)[0]
        else:
            logits = model(mx.array([[y]], dtype=mx.uint32), cache)[0]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out: list[int] = []
        if greedy:
            picks = mx.argmax(logprobs, axis=-1).tolist()
            for j, pick in enumerate(picks):
                out.append(pick)
                if j >= len(drafts) or pick != drafts[j]:
                    break
        else:
            for j in range(len(drafts) + 1):
                # (1, vocab), as generate_step samples: MLX draws differently from a (vocab,) row
                out.append(sample(logprobs[j:j + 1], params.offset + n + j).item())
                if j >= len(drafts) or out[-1] != drafts[j]:
                    break
        accepted = len(out) - 1
        spec.costs.observe(len(drafts) + 1, time.perf_counter() - started)
        length.observe(len(drafts), accepted)
        if drafts and spec.on_pass is not None:
            spec.on_pass(len(drafts), accepted, len(out))
        rewind, held = len(drafts) - accepted, held + 1 + accepted
        for j, token in enumerate(out):
            yield sampled(token, logprobs[j], top) if top >= 0 else token
            n += 1
            if n >= max_tokens:
                return
        drafter.extend(out)
        y = out[-1]
