"""How fast this node computes now against how fast it has computed: timed steps in, a slowdown out.

Every one-position step a stage serves here is timed where it runs, against the fastest step of the
same layers this process ran (on MLX's CPU backend counting the smaller of wall and CPU time, so a
node throttled from its start still shows). A node with no such step to time (the head, whose own
layers run inside mlx-lm's decode loop, or a node the plan left out) times a short probe instead.

The slowdown announced changes only once the median of the last samples has held for ``dwell``
seconds above ``factor`` (slow) or below ``factor * RECOVER`` (recovered), so a spike moves no
layers and a recovery does not flap.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import mlx.core as mx

from meshnode.model.compute import step_seconds

WINDOW_S = 6.0  # the samples a judgement is the median of
RECOVER = 0.6  # under factor * RECOVER the node is as fast as measured again
REPORT_CHANGE = 1.5  # while slow, a new figure is announced once it differs by this factor
PROBE_GAP_S = 2.0  # a probe runs once no step was timed for this long
PROBE_CPU_S = 0.03  # one probe's work: longer than a CFS quota slice, so a throttled node shows
PROBE_SIZE = 256


@dataclass(frozen=True)
class Slowdown:
    """Measured step time over the plan's estimate (1.0: as fast as measured), and since when."""

    factor: float = 1.0
    since: float = 0.0  # wall-clock time it began (0 while 1.0)

    @property
    def slow(self) -> bool:
        return self.factor > 1.0


NORMAL = Slowdown()


class Pace:
    """The samples of one node and the slowdown they show; ``observe`` and ``sample`` may be called
    from any thread, ``update`` from one."""

    def __init__(
        self,
        factor: float,
        dwell: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.factor, self.dwell = factor, dwell
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, float]] = deque()
        self._fastest: dict[object, float] = {}  # by kind of step: the least it took here
        self._last_step = -math.inf
        self._moving_since: float | None = None  # when the median first crossed toward a new state
        self._moving_wall = 0.0
        self.reported = NORMAL

    def observe(self, kind: object, wall: float, cpu: float) -> None:
        """A one-position step of ``kind`` (its layers) that took ``wall`` seconds and the process
        ``cpu`` seconds of CPU time."""
        if wall <= 0:
            return
        now = self._clock()
        with self._lock:
            fastest = self._fastest[kind] = min(self._fastest.get(kind, math.inf), step_seconds(wall, cpu, _on_cpu()))
            self._last_step = now
            self._add(now, wall / fastest)

    def sample(self, ratio: float) -> None:
        """A probe's time over the fastest it ran here."""
        if ratio > 0:
            with self._lock:
                self._add(self._clock(), ratio)

    def needs_probe(self) -> bool:
        """No step was timed lately: only a probe can tell how fast this node is."""
        return self._clock() - self._last_step >= PROBE_GAP_S

    def current(self) -> float | None:
        """The median ratio of the last WINDOW_S seconds (None: no sample)."""
        with self._lock:
            self._expire(self._clock())
            return statistics.median(r for _, r in self._samples) if self._samples else None

    def update(self) -> Slowdown | None:
        """The new slowdown to announce, or None while it stays as reported."""
        now, ratio = self._clock(), self.current()
        if ratio is None:
            return None
        if not self.reported.slow:
            toward = ratio >= self.factor
        else:
            toward = ratio < self.factor * RECOVER
            if not toward and abs(math.log(ratio / self.reported.factor)) > math.log(REPORT_CHANGE):
                self.reported = Slowdown(round(ratio, 2), self.reported.since)
                return self.reported
        if not toward:
            self._moving_since = None
            return None
        if self._moving_since is None:
            self._moving_since, self._moving_wall = now, self._wall()
        if now - self._moving_since < self.dwell:
            return None
        self._moving_since = None
        self.reported = NORMAL if self.reported.slow else Slowdown(round(ratio, 2), self._moving_wall)
        return self.reported

    def _add(self, now: float, ratio: float) -> None:
        self._samples.append((now, ratio))
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._samples and now - self._samples[0][0] > WINDOW_S:
            self._samples.popleft()


class Probe:
    """A fixed piece of MLX work, timed (run on the MLX thread): its wall time over the fastest it
    ran here, so 1.0 is an idle machine and 10 is a node that gets a tenth of it."""

    def __init__(self) -> None:
        self._repeats = 0
        self._best = math.inf

    def __call__(self) -> float:
        a = mx.random.normal((PROBE_SIZE, PROBE_SIZE), key=mx.random.key(0))
        mx.eval(a)
        mx.synchronize()  # a generation's queued work is not the probe's
        if not self._repeats:  # as many matmuls as take PROBE_CPU_S of CPU here
            t0, c0 = time.perf_counter(), time.process_time()
            mx.eval(_work(a, 4))
            one = step_seconds(time.perf_counter() - t0, time.process_time() - c0, _on_cpu()) / 4
            self._repeats = max(4, min(10_000, round(PROBE_CPU_S / max(one, 1e-6))))
        t0, c0 = time.perf_counter(), time.process_time()
        mx.eval(_work(a, self._repeats))
        wall = time.perf_counter() - t0
        # The fastest run counts CPU time where that is less: a first run on a busy machine.
        self._best = min(self._best, step_seconds(wall, time.process_time() - c0, _on_cpu()))
        return wall / self._best


def _work(a: mx.array, repeats: int) -> mx.array:
    out = a
    for _ in range(repeats):  # each evaluated: one lazy graph would be fused or reordered
        out = mx.tanh(out @ a * (1 / PROBE_SIZE))
        mx.eval(out)
    return out


def _on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


async def watch(
    pace: Pace,
    probe: Callable[[], Awaitable[float]],
    *,
    serving: Callable[[], bool],
    announce: Callable[[Slowdown], None],
    interval: float = 1.0,
) -> None:
    """Judge ``pace`` every ``interval`` seconds, probing while it has no step to go by and the
    node ``serving()`` (holds layers) or is slow (a recovery must be seen); ``announce`` each change."""
    while True:
        await asyncio.sleep(interval)
        if pace.needs_probe() and (serving() or pace.reported.slow):
            pace.sample(await probe())
        changed = pace.update()
        if changed is not None:
            announce(changed)
