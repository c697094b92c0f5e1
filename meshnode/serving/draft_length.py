"""How many tokens to guess per speculative pass, and whether to send passes behind the one in flight.

What the head measures:

- A request's acceptance: the share of its guesses confirmed, averaged over about its last
  :data:`WINDOW` guessing passes, from :data:`PRIOR`.
- A pass's price by its n positions (:class:`PassCosts`, per placement), in plain steps: passes
  timed alone, each against the steps' median then, so a shared load cancels. Noise only slows, so
  a size timed twice costs the lower median of its last WINDOW, else ``1 + slope * (n - 1)`` with
  the kept passes' lower median slope (1 until measured); never under a step. A size's first pass
  builds MLX's kernels and is dropped; one under ``1 - NOISE`` steps means a load has gone: steps and
  prices start over.
- The filled share: a full pipeline's time between passes over a lone traversal (about 1 / stages;
  near 1 on one device), the lower median of the last WINDOW measures with the prior 1 / stages in
  the gaps, so a stall does not rule filling out. Measures lapse after WINDOW * REMEASURE passes,
  so a share that ruled filling out is measured again.

What it chooses:

- k maximizes tokens per second (:func:`filled_rate`), each further guess gaining :data:`MIN_GAIN`.
- Passes fill the pipeline only where the share is at most ``1 - NOISE``. A pass kept with
  probability q goes behind those in flight if q >= NOISE, up to one per stage (it uses a waiting
  stage); beyond that if q * MIN_GAIN >= 1 - q (it saves the first stage about MIN_GAIN of a step; a
  cancelled one costs it a step).
- Where nothing pays, the request pauses: :data:`REMEASURE` plain steps, built ahead by the stages,
  twice as many each time until a guess is confirmed. Then a probe guesses once: in a pass behind a
  plain one where passes fill the pipeline, else in a pass of its own (timing that size again).
- :data:`DRY_RUN` drafter misses in a row (one right after a pause) pause the request too; that pause
  ends one step after the drafter has a guess again (a free drafter, prompt lookup, is asked at every
  step of it).
- Filled passes are not timed, so every REMEASURE-th pass of a placement goes alone: in turn the
  size in use, a plain step and one guess longer.

Pure logic; meshnode.serving.speculative runs the passes.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from typing import Final, Literal

from meshnode.tracing import mark

WINDOW = 5  # measures kept per series; the acceptance's span in passes
PRIOR = 0.6  # a new request's acceptance, worth one guess
REMEASURE = 16  # passes before an estimate is measured again; a first pause's steps
DRY_RUN = 4  # drafter misses before a pause (prompt lookup misses a few per change it copies)
NOISE = 0.1  # how far a measure strays, as a share, with nothing changed
MIN_GAIN = 0.02  # the least gain, as a share of a step, worth a risk

# What the next pass is for:
NextPass = Literal["probe", "alone", "behind"]
PROBE: Final = "probe"  # a pause ended: measure the acceptance
ALONE: Final = "alone"  # timed alone: nothing goes behind it
BEHIND: Final = "behind"  # a probe with a pass behind it, until a guess is checked


class PassCosts:
    """A placement's pass prices by positions (a plain step is one), filled share and pass count."""

    def __init__(self, one: float | None = None, extra: float | None = None, share: float | None = None):
        """``one``, ``extra``, ``share``: a starting fit (tests)."""
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=WINDOW)  # one-position passes' seconds
        self._relative: dict[int, deque[float]] = {}  # positions -> recent passes' times in steps
        self._times: dict[int, deque[float]] = {}  # positions -> recent passes' seconds (from the second)
        # (passes counted when measured, share)
        self._shares: deque[tuple[int, float]] = deque(
            [(0, share)] * WINDOW if share is not None else (), maxlen=WINDOW
        )
        self._passes = 0  # passes chosen
        if one is not None:
            self._keep(1, one)
            if extra is not None:
                self._keep(2, one + extra)

    def observe(self, positions: int, seconds: float) -> None:
        """A pass of ``positions`` took ``seconds`` alone."""
        with self._lock:
            if positions not in self._times:
                self._times[positions] = deque(maxlen=WINDOW)
                return
        self._keep(positions, seconds)

    def _keep(self, positions: int, seconds: float) -> None:
        with self._lock:
            self._times.setdefault(positions, deque(maxlen=WINDOW)).append(seconds)
            if positions <= 1:
                self._steps.append(seconds)
            elif self._steps:
                relative = seconds / statistics.median(self._steps)
                if relative < 1.0 - NOISE:  # the steps were timed under a load since gone
                    self._steps.clear()
                    self._relative.clear()
                    return
                self._relative.setdefault(positions, deque(maxlen=WINDOW)).append(relative)

    def _medians(self) -> tuple[float | None, dict[int, float], float | None]:
        """The steps' median, each size's own price, and the slope (None: none kept)."""
        with self._lock:
            step = statistics.median(self._steps) if self._steps else None
            sizes = {n: statistics.median_low(r) for n, r in self._relative.items() if len(r) >= 2}
            slopes = [(rel - 1.0) / (n - 1) for n, r in self._relative.items() for rel in r]
        return step, sizes, (statistics.median_low(slopes) if slopes else None)

    @staticmethod
    def _relative_of(positions: int, sizes: dict[int, float], slope: float | None) -> float:
        """A pass in steps, at least 1; an unmeasured further position costs a step."""
        if positions <= 1:
            return 1.0
        if positions in sizes:
            return max(1.0, sizes[positions])
        return 1.0 + (1.0 if slope is None else max(0.0, slope)) * (positions - 1)

    def fit(self) -> tuple[float | None, float | None]:
        """(one, extra): a step's seconds and a further position's; None until measured."""
        step, _, slope = self._medians()
        return step, (slope * step if step is not None and slope is not None else None)

    def relative(self, positions: int) -> float:
        """A pass of ``positions`` in steps."""
        _, sizes, slope = self._medians()
        return self._relative_of(positions, sizes, slope)

    def relatives(self, most: int) -> list[float]:
        """:meth:`relative` of 0 to ``most`` positions."""
        _, sizes, slope = self._medians()
        return [self._relative_of(n, sizes, slope) for n in range(most + 1)]

    def cost(self, positions: int) -> float | None:
        """Seconds of a lone pass of ``positions``; with no step timed (a fixed k), that size's median."""
        step, sizes, slope = self._medians()
        if step is not None:
            return step * self._relative_of(positions, sizes, slope)
        with self._lock:
            times = self._times.get(positions)
            return statistics.median(times) if times else None

    def count_pass(self) -> int:
        """Counts a chosen pass; returns the count."""
        with self._lock:
            self._passes += 1
            return self._passes

    def observe_filled(self, positions: int, seconds: float) -> None:
        """A pass of ``positions`` came out ``seconds`` after the one ahead in a full pipeline."""
        traversal = self.cost(positions)
        if traversal is None or traversal <= 0:
            return
        with self._lock:
            self._shares.append((self._passes, seconds / traversal))
        mark("spec.share")

    def _current_shares(self) -> list[float]:
        """The share's unlapsed measures."""
        with self._lock:
            return [share for at, share in self._shares if self._passes - at < WINDOW * REMEASURE]

    @property
    def measured_share(self) -> float | None:
        """The measures' lower median (None: none)."""
        shares = self._current_shares()
        return statistics.median_low(shares) if shares else None

    def filled_share(self, stages: int) -> float:
        """A full pipeline's time between passes over a lone pass's traversal (the module docstring)."""
        shares = self._current_shares()
        return statistics.median_low(shares + [1.0 / max(stages, 1)] * (WINDOW - len(shares)))

    def ratio(self) -> float:
        """A further position's cost in steps (1 until measured)."""
        return self._relative_of(2, {}, self._medians()[2]) - 1.0


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a pass of k guesses yields, each confirmed with probability ``alpha``."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def filled_rate(alpha: float, k: int, cost: float, share: float) -> float:
    """Tokens per step's time of k-guess passes costing ``cost`` steps, one every ``share`` of that
    in a full pipeline (1: nothing behind); a miss cancels those behind, so the next takes a traversal."""
    kept = alpha ** (k + 1)
    return expected_tokens(alpha, k) / (cost * (kept * share + 1.0 - kept))


class DraftLength:
    """Chooses k for a request's next pass and runs its pauses and probes (the module docstring)."""

    def __init__(self, costs: PassCosts, k_max: int, prior: float = PRIOR, fills: bool = False, stages: int = 1):
        """``fills``: passes may follow the one in flight."""
        self.costs, self.k_max, self.fills, self.stages = costs, k_max, fills, stages
        self._hits, self._trials = prior, 1.0
        self._plain_left = 0  # plain steps left in the pause
        self._pause = REMEASURE  # plain steps of the next pause
        self._dry = 0  # drafter misses in a row (DRY_RUN: their pause is under way)
        self._next: NextPass | None = None  # None: an ordinary pass

    @property
    def alpha(self) -> float:
        return self._hits / self._trials

    def choose(self) -> int:
        passes = self.costs.count_pass()
        if self._next == ALONE:
            self._next = None
        if self._plain_left > 0:
            return 0
        if self._next == PROBE:
            self._next = BEHIND if self.stages > 1 and self._filling() else None
            return 0 if self._next == BEHIND else 1
        one, extra = self.costs.fit()
        if extra is None:  # measure a step, then one guess, each alone
            self._next = ALONE
            return 0 if one is None else 1
        k = self._best()
        if passes % REMEASURE == 0 and (k > 0 or self.fill_ok(0)) and self._filling():
            self._next = ALONE
            sizes = list(dict.fromkeys((k, 0, k + 1)))
            return min(sizes[(passes // REMEASURE - 1) % len(sizes)], self.k_max)
        if k == 0 and not self.fill_ok(0):
            self._start_pause()
        return k

    def _best(self) -> int:
        """The k with the most tokens per second, each further guess gaining MIN_GAIN."""
        alpha = self.alpha
        share = self.costs.filled_share(self.stages) if self._filling() else 1.0
        prices = self.costs.relatives(self.k_max + 1)
        best_k, best = 0, filled_rate(alpha, 0, 1.0, share)
        for k in range(1, self.k_max + 1):
            rate = filled_rate(alpha, k, prices[k + 1], share)
            if rate > best * (1.0 + MIN_GAIN):
                best_k, best = k, rate
        return best_k

    def fill_ok(self, ahead: int, in_flight: int = 1) -> bool:
        """Whether to send a pass behind ``in_flight`` passes holding ``ahead`` guesses."""
        if not self.fills or self._plain_left > 0 or self._next == ALONE:
            return False
        deep = in_flight >= self.stages
        if self._next == BEHIND and ahead == 0 and not deep:
            return True
        if not self._filling():
            return False
        kept = self.alpha ** (ahead + 1)
        return kept * MIN_GAIN >= 1.0 - kept if deep else kept >= NOISE

    def _filling(self) -> bool:
        """Whether filling the pipeline saves more than NOISE."""
        return self.fills and (self.stages < 2 or self.costs.filled_share(self.stages) <= 1.0 - NOISE)

    def _start_pause(self) -> None:
        self._plain_left = self._pause
        self._pause *= 2

    def paused(self) -> bool:
        """Whether the next step is surely plain (the stages may build it ahead)."""
        return self._plain_left > 1

    @property
    def plain_left(self) -> int:
        """Plain steps left in the pause (0: none)."""
        return self._plain_left

    def dry(self) -> None:
        """The drafter found nothing."""
        self._dry += 1
        if self._dry == DRY_RUN:
            self._start_pause()

    @property
    def dry_paused(self) -> bool:
        """Whether a pause for drafter misses is under way (``found`` may end it)."""
        return self._dry >= DRY_RUN and self._plain_left > 1

    def found(self) -> None:
        """The drafter has a guess again: a pause for its misses ends after one more step."""
        if self.dry_paused:
            self._plain_left = 1

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            if self._plain_left > 0:
                self._plain_left -= 1
                if self._plain_left == 0:  # one more miss pauses again
                    self._next, self._dry = PROBE, DRY_RUN - 1
            return
        if self._next == BEHIND:
            self._next = None
        self._dry = 0
        if accepted:
            self._pause = REMEASURE
        fade = 1.0 - 1.0 / WINDOW
        self._hits = fade * self._hits + accepted
        self._trials = fade * self._trials + accepted + (accepted < drafted)
