"""How many tokens to guess per speculative pass, and whether to send passes behind the one in flight.

How many to guess (:class:`DraftLength`): the acceptance rate is measured per request, the cost
of a pass by its positions per placement (:class:`PassCosts`); k maximizes the expected tokens per
second (where passes fill the pipeline, of the pipeline kept full: :func:`filled_rate`), and is 0
(plain decoding, the stages building each step ahead again) where guessing does not pay. It is
probed again with one guess after :data:`PROBE_AFTER` plain steps (a pass of its own behind the
plain one where passes may fill the pipeline, else a pass of two positions), then after twice as
many each time it still does not pay. A drafter that finds nothing to guess (:data:`DRY_RUN` times
in a row, or at once when a pause has just ended) pauses the request the same way; a drafter that
costs nothing to ask (prompt lookup: ``free``) is asked again at every token of such a pause, and
the pause ends as soon as it has a guess (:meth:`DraftLength.found`). In a pause the steps are
plain: the stages build each one ahead (a remote stage) or, where every stage is local, each
step's graph is built while the one before computes, as mlx-lm's ``generate_step`` does.

Whether passes go behind the one in flight is measured as well: only where a full pipeline yields
a pass in at most :data:`FILL_SHARE` of a lone pass's traversal (:meth:`PassCosts.filled_share`).
Stages on machines of their own compute at once (about 1 / stages); two nodes on one GPU cannot,
and there a pass's guesses go inside it.

Pure logic: what the passes measured goes in (PassCosts, DraftLength.observe), k comes out; the
passes themselves run in meshnode.serving.speculative.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

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
# Where passes fill the pipeline, one in this many goes alone to be timed (PassCosts): only a lone
# pass times what its positions cost, and what a placement timed first may have been timed under a
# load since gone (a peer's start-up measurements).
RETIME_EVERY = 16
# A pass timed below this share of the steps' median tells that the steps' time is out of date (a
# pass costs at least the step it also is; noise puts some at 0.95).
STALE = 0.9
EMA = 0.2  # weight of the newest observation in the running estimates
# Where a full pipeline's time between passes is above this share of one pass's traversal, passes
# are not sent behind the one in flight (their guesses go inside it, where they pay): it gains
# little, and a cancelled pass behind takes its stage's time from the others where they share a
# device.
FILL_SHARE = 0.9
SHARE_MAX = 2.0  # a measured share is capped (a stall of the machine must not rule filling out for long)
SHARE_WINDOW = 5  # recent measures of the share kept (PassCosts.filled_share: their lower median)
# Where the share rules filling out, nothing measures it again; each pass moves its recent measures
# this much toward the prior (1 / stages), so that a share measured under a passing load (a busy
# Mac) is measured again after some hundred passes: where stages truly cannot work at once, passes
# go behind about three in a few hundred (three new measures are the window's lower median again;
# each computes while the one ahead would, and costs little kept or not).
SHARE_RELAX = 0.002
# Times in a row a drafter finds nothing before the request pauses drafting (plain steps are cheaper
# in a pause: built ahead). A few: prompt lookup finds nothing for a position or two after each
# change to what it copies.
DRY_RUN = 4


class PassCosts:
    """What a pass through a placement's stages costs by its positions n, from the passes timed
    alone (and plain steps, n = 1), shared by the placement's requests.

    A step's time is kept (its last :data:`WINDOW`), and each larger pass is kept as its time
    against the step's median when it came: a load that comes and goes (a peer's start-up
    measurements, a busy Mac) slows both alike, so a pass timed under it is not compared with
    steps timed without it (on this CPU every time was 2-2.5x for the first seconds of a mesh's
    life). Each size is priced by the lower median of its last :data:`WINDOW`: a pass that met a
    garbage collection is one sample of eight (of two passes in the middle, the faster: a pass's
    time is only ever slowed; a size of two positions timed at 1.06, 1.18, 1.41 and 2.18 steps was
    priced at 1.3, and no guess paid at p = 0.8). A size timed fewer than :data:`OWN_MIN` times is
    priced by a line, ``1 + ratio * (n - 1)`` steps, whose slope is the lower median of every kept
    pass's own ((relative - 1) / (n - 1)): a time is only ever slowed (a load, a collection), so one
    slow pass must not price every guess (a least-squares line through a size timed twice, at 1.05
    and 2.03 steps, priced a further position at 0.54 of a step where it costs 0.05, and the head
    stopped guessing for the rest of a benchmark's run: 34 against 62 tok/s at p = 0.8). On a CPU
    with a tuned BLAS a further position is not a line (here 40/45/55/42/53 ms for 1-5 positions),
    so the sizes in use are priced by what they measured. Where extra
    positions come almost free (a GPU streaming the weights once for all of them) guessing pays at
    modest acceptance; where each costs nearly a step of its own (a CPU computing every position on
    the reference BLAS: ~0.9) it pays only when nearly every guess is right. Also the time between
    two passes where they fill the pipeline, against a lone pass's (:meth:`filled_share`)."""

    WINDOW = 8  # a size's most recent lone passes kept
    OWN_MIN = 3  # times of a size before its own median prices it (else the line does)

    def __init__(self, one: float | None = None, extra: float | None = None, share: float | None = None):
        """``one``, ``extra``, ``share``: a starting fit (tests)."""
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=self.WINDOW)  # one-position passes' seconds
        self._relative: dict[int, deque[float]] = {}  # positions -> recent passes' times in steps
        self._times: dict[int, deque[float]] = {}  # positions -> recent passes' seconds (no step timed: a fixed k)
        self._seen: set[int] = set()  # sizes whose first pass came (and was not kept)
        self._stale = False  # the steps are out of date (STALE): fit() says nothing until one is timed
        self._since_timed = 0  # passes chosen where they fill the pipeline since one was timed
        self._retimed = 0  # passes timed so (which of RETIME_EVERY's turns is next)
        # filled_share's recent measures (a starting one fills the window)
        self._shares: deque[float] = deque([share] * SHARE_WINDOW if share is not None else (), maxlen=SHARE_WINDOW)
        if one is not None:
            self._keep(1, one)
            if extra is not None:
                self._keep(2, one + extra)

    def observe(self, positions: int, seconds: float) -> None:
        """A pass of ``positions`` took ``seconds`` alone in the stages. A size's first pass on a
        placement is not kept: it built MLX's kernels for its shapes. A larger pass that comes
        before any step is timed has nothing to be priced against: only its seconds are kept (a
        fixed k's traversal, :meth:`cost`)."""
        with self._lock:
            if positions not in self._seen:
                self._seen.add(positions)
                return
        self._keep(positions, seconds)

    def _keep(self, positions: int, seconds: float) -> None:
        with self._lock:
            self._seen.add(positions)
            self._times.setdefault(positions, deque(maxlen=self.WINDOW)).append(seconds)
            if positions <= 1:
                if self._stale:
                    self._steps.clear()
                    self._stale = False
                self._steps.append(seconds)
            elif self._steps:
                relative = seconds / statistics.median(self._steps)
                if relative < STALE:
                    # Faster than the steps timed: they were timed under a load since gone (the
                    # first seconds of a mesh's life, here at twice the time), and so were the
                    # sizes priced against them. Priced again from the next step on (the old steps
                    # still time a traversal for filled_share meanwhile).
                    self._relative.clear()
                    self._stale = True
                    return
                self._relative.setdefault(positions, deque(maxlen=self.WINDOW)).append(relative)

    def _medians(self) -> tuple[float | None, dict[int, tuple[float, int]], float | None]:
        """The steps' median, each size's (median, count), and the line's slope (:meth:`_slope`)."""
        with self._lock:
            step = statistics.median(self._steps) if self._steps else None
            sizes = {n: (statistics.median_low(r), len(r)) for n, r in self._relative.items() if r}
            slopes = [(rel - 1.0) / (n - 1) for n, r in self._relative.items() if n > 1 for rel in r]
        return step, sizes, self._slope(slopes)

    @staticmethod
    def _slope(slopes: list[float]) -> float | None:
        """A further position's cost in steps, from every kept pass's own: their lower median (of
        two, the faster: noise only ever slows a pass); None with none timed."""
        return statistics.median_low(slopes) if slopes else None

    @staticmethod
    def _ratio(slope: float | None) -> float:
        """:meth:`ratio` from the line's slope."""
        return 0.25 if slope is None else max(0.0, slope)

    def fit(self) -> tuple[float | None, float | None]:
        """(one, extra): a step's seconds and a further position's; None where not measured yet."""
        step, _, slope = self._medians()
        if step is None or self._stale:
            return None, None
        return step, (slope * step if slope is not None else None)

    def relative(self, positions: int) -> float:
        """A pass of ``positions`` against a one-position step: its own median where timed
        :data:`OWN_MIN` times, else the line's (:meth:`ratio` until any is timed); never less than
        1: a pass costs at least the step it also is (a size priced cheaper is one whose times are
        off, and guessing would seem to pay even where no guess comes right)."""
        _, sizes, slope = self._medians()
        return self._relative_of(positions, sizes, slope)

    def relatives(self, most: int) -> list[float]:
        """:meth:`relative` of 0 to ``most`` positions (the medians taken once)."""
        _, sizes, slope = self._medians()
        return [self._relative_of(n, sizes, slope) for n in range(most + 1)]

    def _relative_of(self, positions: int, sizes: dict[int, tuple[float, int]], slope: float | None) -> float:
        if positions <= 1:
            return 1.0
        own = sizes.get(positions)
        if own is not None and own[1] >= self.OWN_MIN:
            return max(1.0, own[0])
        return max(1.0, 1.0 + self._ratio(slope) * (positions - 1))

    def cost(self, positions: int) -> float | None:
        """Seconds a lone pass of ``positions`` takes now; where no step is timed (a fixed k sends
        passes of one size only), the median of that size's own; else None."""
        step, sizes, slope = self._medians()
        if step is not None:
            return step * self._relative_of(positions, sizes, slope)
        with self._lock:
            times = self._times.get(positions)
            return statistics.median(times) if times else None

    def retime_turn(self) -> int | None:
        """A pass is chosen where passes fill the pipeline: None, or every :data:`RETIME_EVERY`-th
        time, how many were timed so before (which size this one times alone is its turn:
        :meth:`DraftLength.choose`). Counted per placement, not per request: a request of 48 tokens
        at p = 0.8 makes about 14 such passes, and counted per request none was ever timed (one
        pass of two positions timed at 1.28 steps priced every guess at 0.28 of a step, where they
        cost 0.05, for the rest of a run)."""
        with self._lock:
            self._since_timed += 1
            if self._since_timed < RETIME_EVERY:
                return None
            self._since_timed, self._retimed = 0, self._retimed + 1
            return self._retimed - 1

    def observe_filled(self, positions: int, seconds: float) -> None:
        """A pass of ``positions`` came out ``seconds`` after the one ahead of it, having been in flight
        behind it (the pipeline kept full): what a pass costs where passes fill the pipeline."""
        traversal = self.cost(positions)
        if traversal is None or traversal <= 0:
            return
        share = min(seconds / traversal, SHARE_MAX)
        with self._lock:
            self._shares.append(share)
        mark("spec.share")

    def relax_share(self, stages: int) -> None:
        """Move the measured shares a little toward the prior (SHARE_RELAX)."""
        prior = 1.0 / max(stages, 1)
        with self._lock:
            for i, share in enumerate(self._shares):
                self._shares[i] = share - SHARE_RELAX * (share - prior)

    @property
    def measured_share(self) -> float | None:
        """The lower median of the recent measures (None: none yet)."""
        with self._lock:
            return statistics.median_low(self._shares) if self._shares else None

    def filled_share(self, stages: int) -> float:
        """A full pipeline's time between two passes against one pass's time through every stage:
        about 1 / stages where each stage computes on its own machine while the others compute
        (the prior, until measured), near 1 where they cannot work at once (two nodes on one GPU,
        a link slower than the stages' work): filling the pipeline then gains nothing.

        The lower median of the last :data:`SHARE_WINDOW` measures, the prior standing for those
        not made yet: a stall or a passing load (a mesh's first seconds) measures a share of 1.5 to
        2 for a pass or two (the steps the traversal is priced by were timed without it), and a
        running average ruled filling out for some hundred passes after two such (34 against 62
        tok/s at p = 0.8); where stages truly cannot work at once, every measure says so, and the
        third rules it out."""
        prior = 1.0 / max(stages, 1)
        with self._lock:
            shares = list(self._shares)
        return statistics.median_low(shares + [prior] * (SHARE_WINDOW - len(shares)))

    def ratio(self) -> float:
        """A further position's cost against a one-position step (0.25 until measured)."""
        return self._ratio(self._medians()[2])


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
        self._dry_paused = False  # the pause under way is for a drafter that found nothing (found() ends it)
        # The next pass measures the placement's costs: it goes alone, nothing sent behind it (only a
        # pass alone in the stages times what its positions cost; PassCosts).
        self._measuring = False

    @property
    def alpha(self) -> float:
        return self._hits / self._trials if self._trials else 0.0

    def choose(self) -> int:
        self._measuring = False
        self._relax()
        if self._plain_left > 0:
            return 0
        if self._probe:  # one guess: the cheapest measure of whether they come right now
            self._probe = False
            if self.stages > 1 and self._filling():  # a pass behind the plain one, which costs a stage's wait at most
                self._probe_fill = True
                return 0
            return 1
        one, extra = self.costs.fit()
        if extra is None:  # the placement's cost of a guess is not measured yet: measure it cheaply,
            # a plain step, then a pass with one guess, each alone (where passes fill the pipeline,
            # one with a pass behind it would never be measured, and k stay 1 for good)
            self._measuring = True
            return 0 if one is None else 1
        alpha = min(self.alpha, 0.99)
        # Where passes fill the pipeline, against one-position passes keeping it full; else
        # against plain steps (a share of 1: nothing gained between passes).
        share = self.costs.filled_share(self.stages) if self._filling() else 1.0
        prices = self.costs.relatives(self.k_max + 1)
        best_k, best = 0, filled_rate(alpha, 0, 1.0, share)
        for k in range(1, self.k_max + 1):
            rate = filled_rate(alpha, k, prices[k + 1], share)
            if rate > best * 1.02:  # a guess must pay for itself with a margin
                best_k, best = k, rate
        if self._filling() and (best_k > 0 or self.fill_ok(0)):
            # Passes fill the pipeline, and those are never timed (another is in flight with each):
            # every RETIME_EVERY-th goes alone, in turn the size in use, a plain step (what the
            # others are priced against) and one guess longer, so they are priced by what they
            # cost now. (Where the size in use is the plain step, the two alternate: one pass of
            # two positions timed at 1.21 steps, before, went 48 passes before the next.)
            turn = self.costs.retime_turn()
            if turn is not None:
                self._measuring = True
                sizes = list(dict.fromkeys((best_k, 0, best_k + 1)))
                return min(sizes[turn % len(sizes)], self.k_max)
        if best_k == 0 and self.fill_ok(0):
            # Guesses pay as passes behind the one in flight, not inside it. (With one stage every
            # pass behind is one beyond a pass per stage: where none would be sent, a 0 here
            # without a pause would leave the drafter never asked, and steps never built ahead.)
            return 0
        if best_k == 0:  # plain steps, then a probe; each probe that does not pay waits twice as long
            self._plain_left, self._dry_paused = self._pause, False
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
        if not self._filling() or self._plain_left > 0 or self._measuring:
            return False
        deep = in_flight >= self.stages
        if self._probe_fill and ahead == 0 and not deep:
            return True
        return min(self.alpha, 0.99) ** (ahead + 1) >= (FILL_DEEP if deep else FILL_MIN)

    def _filling(self) -> bool:
        """Whether passes may go behind the one in flight: the pipeline has room for them, and where
        it has stages to fill, a full one was not measured to gain little (FILL_SHARE). A single
        stage's pass behind (``fill_ok``'s ``deep`` one) only saves it the hop."""
        if not self.fills:
            return False
        return self.stages < 2 or self.costs.filled_share(self.stages) <= FILL_SHARE

    def _relax(self) -> None:
        if self.fills and self.stages > 1 and not self._filling():
            self.costs.relax_share(self.stages)

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
            self._plain_left, self._dry_paused = self._dry_pause, True
            self._dry_pause = min(self._dry_pause * 2, PROBE_MAX)

    @property
    def dry_paused(self) -> bool:
        """Whether a pause for a drafter that found nothing is under way (``found`` may end it)."""
        return self._dry_paused and self._plain_left > 1

    def found(self) -> None:
        """The drafter, asked again during a pause for finding nothing, has a guess now (a model
        starting to quote its context, past the first pause's length): the pause ends after the
        step already in flight or promised (one more plain step, then a probe). A pause because
        guesses did not pay goes on: its end is the measure of whether they pay again."""
        if self.dry_paused:
            self._plain_left = 1

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


def filled_rate(alpha: float, k: int, cost: float, share: float) -> float:
    """Tokens per plain step's time (one position through every stage) of passes of k + 1
    positions, each costing ``cost`` steps (PassCosts.relative), kept coming every ``share`` of that
    (a full pipeline: PassCosts.filled_share; 1 where nothing goes behind the pass in flight). A pass
    yields :func:`expected_tokens`; when its k guesses and the first of the pass behind are not all
    confirmed (1 - alpha^(k+1)), the passes behind are cancelled and the next pass takes a whole
    traversal."""
    kept = alpha ** (k + 1)
    return expected_tokens(alpha, k) / (cost * (kept * share + 1.0 - kept))
