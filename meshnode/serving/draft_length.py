"""How many tokens to guess per speculative pass, and whether to send passes behind the one in flight.

:class:`DraftLength` measures a request's acceptance rate; :class:`PassCosts` prices a pass by its
positions per placement. k maximizes expected tokens per second (:func:`filled_rate`) and is 0
(plain decoding, steps built ahead) where guessing does not pay; one guess probes again after
:data:`PROBE_AFTER` plain steps, doubling each time it still does not pay. A drafter that finds
nothing :data:`DRY_RUN` times in a row pauses the request the same way; a free drafter (prompt
lookup) is asked at every token of the pause, which ends when it has a guess.

Passes go behind the one in flight only where a full pipeline yields a pass in at most
:data:`FILL_SHARE` of a lone traversal: stages on separate machines compute at once, two nodes on
one GPU cannot. Pure logic; the passes run in meshnode.serving.speculative.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

from meshnode.tracing import mark

K_MAX = 8  # the most tokens guessed per pass
PROBE_AFTER = 16  # plain steps before guessing is tried again where it did not pay (doubling to PROBE_MAX)
PROBE_MAX = 256
# The least chance that a pass sent behind the one in flight is kept, to send it: a cancelled one
# costs little, so this is low, with room for the estimate's noise.
FILL_MIN = 0.1
# ... for a pass beyond one per stage: it saves little and a cancelled one costs the first stage a
# whole step, so it pays only where nearly every guess comes right (q * gain > (1 - q) * step).
FILL_DEEP = 0.97
# Where passes fill the pipeline, one in this many goes alone to be timed: only a lone pass times
# what its positions cost, and earlier times may reflect a load since gone.
RETIME_EVERY = 16
# A pass timed below this share of the steps' median means the steps' time is out of date (a pass
# costs at least the step it also is; the margin is for noise).
STALE = 0.9
EMA = 0.2  # weight of the newest observation in the running estimates
# Above this share of a lone traversal between passes in a full pipeline, passes are not sent behind
# the one in flight: it gains little, and where stages share a device a cancelled pass costs time.
FILL_SHARE = 0.9
SHARE_MAX = 2.0  # a measured share is capped (a stall of the machine must not rule filling out for long)
SHARE_WINDOW = 5  # recent measures of the share kept (PassCosts.filled_share: their lower median)
# Where the share rules filling out nothing measures it again, so each pass moves the measures this
# much toward the prior (1 / stages): a share measured under a passing load gets measured again.
SHARE_RELAX = 0.002
# Times in a row a drafter finds nothing before the request pauses drafting (paused steps are built
# ahead). Not 1: prompt lookup misses a position or two after each change to what it copies.
DRY_RUN = 4


class PassCosts:
    """What a pass through a placement's stages costs by its positions n, from passes timed alone
    (plain steps are n = 1); shared by the placement's requests.

    Each larger pass is kept relative to the steps' median when it came, so a passing load that
    slows both alike cancels out. A size is priced by the lower median of its last :data:`WINDOW`
    (noise only ever slows a pass); one timed fewer than :data:`OWN_MIN` times by a line,
    ``1 + ratio * (n - 1)`` steps, whose slope is the lower median of every kept pass's own, so
    one slow pass cannot price every guess. Also measures the time between passes that fill the
    pipeline (:meth:`filled_share`)."""

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
        """A pass of ``positions`` took ``seconds`` alone. A size's first pass is dropped (it built
        MLX's kernels); a larger pass before any step is timed keeps only its seconds."""
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
                    # Faster than the steps: they were timed under a load since gone, and so were
                    # the sizes priced against them; re-price from the next step on.
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
        """A further position's cost in steps: the lower median of every kept pass's; None if none."""
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
        """A pass of ``positions`` in steps: its own median once timed :data:`OWN_MIN` times, else
        the line's; never below 1, since a pass costs at least the step it also is."""
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
        """Seconds a lone pass of ``positions`` takes; with no step timed (a fixed k), that size's
        own median; else None."""
        step, sizes, slope = self._medians()
        if step is not None:
            return step * self._relative_of(positions, sizes, slope)
        with self._lock:
            times = self._times.get(positions)
            return statistics.median(times) if times else None

    def retime_turn(self) -> int | None:
        """A filling pass is chosen: None, or every :data:`RETIME_EVERY`-th time, how many were
        retimed before (picks which size goes alone). Counted per placement, since a short request
        makes too few such passes to reach its turn."""
        with self._lock:
            self._since_timed += 1
            if self._since_timed < RETIME_EVERY:
                return None
            self._since_timed, self._retimed = 0, self._retimed + 1
            return self._retimed - 1

    def observe_filled(self, positions: int, seconds: float) -> None:
        """A pass of ``positions`` came out ``seconds`` after the one ahead of it in a full pipeline."""
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
        """A full pipeline's time between passes against one pass's traversal: about 1 / stages
        (the prior) where stages compute at once, near 1 where they cannot (two nodes on one GPU).

        The lower median of the last :data:`SHARE_WINDOW` measures, the prior filling in for those
        not made yet, so a stall or two does not rule filling out."""
        prior = 1.0 / max(stages, 1)
        with self._lock:
            shares = list(self._shares)
        return statistics.median_low(shares + [prior] * (SHARE_WINDOW - len(shares)))

    def ratio(self) -> float:
        """A further position's cost against a one-position step (0.25 until measured)."""
        return self._ratio(self._medians()[2])


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one pass yields with k guesses each confirmed with probability ``alpha``."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class DraftLength:
    """Chooses k for a request's next pass from its running acceptance rate and ``costs``, and
    runs its pauses and probes."""

    def __init__(self, costs: PassCosts, k_max: int = K_MAX, prior: float = 0.6, fills: bool = False,
                 stages: int = 1):
        """``fills``: passes may follow the one in flight, so k is chosen for a full pipeline."""
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
        self._measuring = False

    @property
    def alpha(self) -> float:
        return self._hits / self._trials if self._trials else 0.0

    def choose(self) -> int:
        self._measuring = False
        self._relax()
        if self._plain_left > 0:
            return 0
        if self._probe:
            self._probe = False
            if self.stages > 1 and self._filling():
                self._probe_fill = True
                return 0
            return 1
        one, extra = self.costs.fit()
        if extra is None:  # measure a step, then one guess, each alone
            self._measuring = True
            return 0 if one is None else 1
        alpha = min(self.alpha, 0.99)
        share = self.costs.filled_share(self.stages) if self._filling() else 1.0
        prices = self.costs.relatives(self.k_max + 1)
        best_k, best = 0, filled_rate(alpha, 0, 1.0, share)
        for k in range(1, self.k_max + 1):
            rate = filled_rate(alpha, k, prices[k + 1], share)
            if rate > best * 1.02:  # a guess must pay for itself with a margin
                best_k, best = k, rate
        if self._filling() and (best_k > 0 or self.fill_ok(0)):
            # Filling passes are never timed, so every RETIME_EVERY-th goes alone: in turn the
            # size in use, a plain step and one guess longer.
            turn = self.costs.retime_turn()
            if turn is not None:
                self._measuring = True
                sizes = list(dict.fromkeys((best_k, 0, best_k + 1)))
                return min(sizes[turn % len(sizes)], self.k_max)
        if best_k == 0 and self.fill_ok(0):
            # Guesses pay as passes behind the one in flight, not inside it.
            return 0
        if best_k == 0:  # plain steps, then a probe; each probe that does not pay waits twice as long
            self._plain_left, self._dry_paused = self._pause, False
            self._pause = min(self._pause * 2, PROBE_MAX)
        else:
            self._pause = PROBE_AFTER
        return best_k

    def fill_ok(self, ahead: int, in_flight: int = 1) -> bool:
        """Whether to send a pass behind ``in_flight`` passes holding ``ahead`` guesses: it is kept
        only if those and its own first guess are all confirmed."""
        if not self._filling() or self._plain_left > 0 or self._measuring:
            return False
        deep = in_flight >= self.stages
        if self._probe_fill and ahead == 0 and not deep:
            return True
        return min(self.alpha, 0.99) ** (ahead + 1) >= (FILL_DEEP if deep else FILL_MIN)

    def _filling(self) -> bool:
        """Whether passes may go behind the one in flight (FILL_SHARE)."""
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
        """The drafter found nothing: pause after :data:`DRY_RUN` in a row, or at once after a pause."""
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
        """The drafter has a guess again: a pause for finding nothing ends after one more plain
        step. A pause because guesses did not pay goes on."""
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
    """Tokens per plain step's time of passes of k + 1 positions costing ``cost`` steps each, one
    every ``share`` of that in a full pipeline (1: nothing behind). A miss (1 - alpha^(k+1))
    cancels the passes behind, and the next pass takes a whole traversal."""
    kept = alpha ** (k + 1)
    return expected_tokens(alpha, k) / (cost * (kept * share + 1.0 - kept))
