"""Pipelined chunked prefill: every prompt token but the last goes through the stages in chunks,
chunk k+1 entering the first stage before chunk k leaves the last; only the filled caches are used.
"""

from __future__ import annotations

import concurrent.futures
import math
import select
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import mlx.core as mx

from meshnode.transport.remote_stage import POLL
from meshnode.transport.streams import WaitHandle

# Chunks per stage: a pipe of S stages fed n chunks loses (S - 1) / n of the ideal time.
CHUNKS_PER_STAGE = 4
MIN_CHUNK = 16  # positions: smaller chunks cost more in overhead than they save
FIRST_CHUNK = 64  # before any stage has been timed
SHARED_STEP = 0.010  # seconds a chunk may take at the slowest stage while other generations run
# Seconds a chunk may take alone: bounds a long prompt's delay to a newcomer.
TURN = 0.05
BUSY_MIN_CHUNK = 4  # positions
BUSY_FIRST_CHUNK = 16  # FIRST_CHUNK while other generations run
IN_FLIGHT = 2  # chunks queued at one stage: one running, one waiting behind it


class Ticket(Protocol):
    """One chunk submitted to one stage."""

    positions: int

    def done(self) -> bool: ...

    def check(self) -> None: ...  # raises when the stage is lost, not when slow

    def result(self) -> mx.array: ...

    def wait_handle(self) -> WaitHandle | None: ...  # see wait_first


class PipelinedSession(Protocol):
    @property
    def remote(self) -> bool: ...  # read only, so sessions may declare a Literal

    def submit(self, x: mx.array, *, work: int = 0) -> Ticket: ...  # work: see pipelined_prefill


class DoneTicket:
    """A chunk a local stage has run (on the generation's thread)."""

    def __init__(self, out: mx.array, positions: int):
        self._out, self.positions = out, positions

    def done(self) -> bool:
        return True

    def check(self) -> None:
        pass

    def result(self) -> mx.array:
        return self._out

    def wait_handle(self) -> None:
        return None


class ChunkSizer:
    """Chunk sizes from each stage's seconds per position: under ``max_step`` (Apple's GPU kills long
    commands) and ``TURN``, several per stage, about ``SHARED_STEP`` while others run."""

    def __init__(
        self,
        stages: int,
        *,
        max_step: float,
        max_chunk: int,
        min_chunk: int = MIN_CHUNK,
        seed: Sequence[float | None] | None = None,
        busy: Callable[[], bool] | None = None,
    ):
        """``seed``: seconds per position from earlier requests; ``busy()``: others run now."""
        self.stages = stages
        self.max_step = max_step
        self.max_chunk = max_chunk
        self.min_chunk = min(min_chunk, max_chunk)
        self.per_position: list[float | None] = list(seed) if seed is not None else [None] * stages
        self.busy = busy

    def observe(self, stage: int, positions: int, seconds: float) -> None:
        rate = seconds / max(positions, 1)
        old = self.per_position[stage]
        self.per_position[stage] = rate if old is None else 0.5 * old + 0.5 * rate

    def next(self, remaining: int, total: int) -> int:
        size = self.max_chunk
        known = [r for r in self.per_position if r]
        busy = self.busy is not None and self.busy()
        if known:
            size = min(size, int((SHARED_STEP if busy else min(self.max_step, TURN)) / max(known)))
        else:
            size = min(size, BUSY_FIRST_CHUNK if busy else FIRST_CHUNK)
        if self.stages > 1:
            size = min(size, math.ceil(total / (CHUNKS_PER_STAGE * self.stages)))
        floor = min(BUSY_MIN_CHUNK, self.max_chunk) if busy else self.min_chunk
        return max(1, min(remaining, max(size, floor)))


def pipelined_prefill(
    sessions: Sequence[PipelinedSession],
    tokens: Sequence[int],
    sizer: ChunkSizer,
    *,
    wait: WaitFn | None = None,
    between_steps: Callable[[], None] | None = None,
    on_cut: Callable[[int], None] | None = None,
) -> int:
    """Fills every stage's cache with ``tokens``; returns the chunks sent.

    Each chunk carries its ``work`` (positions left): stages serve the least first. ``between_steps()``
    runs after each local step but the last; a stage is awaited while alive.
    """
    n = len(sessions)
    total = len(tokens)
    ready: list[deque[tuple[mx.array, int]]] = [deque() for _ in range(n)]  # (input, work) that can go into stage i
    running: list[deque[tuple[Ticket, float, int]]] = [
        deque() for _ in range(n)
    ]  # (ticket, started, work) in order, per stage
    sent = chunks = 0
    wait = wait or wait_first

    while True:
        # Results leave each stage in order; its next chunk starts when the last ends.
        for i in range(n):
            while running[i] and running[i][0][0].done():
                ticket, started, work = running[i].popleft()
                now = time.perf_counter()
                out = ticket.result()
                if sessions[i].remote:
                    sizer.observe(i, ticket.positions, now - started)
                    if running[i]:  # the next started when this ended, at the latest
                        nxt, nxt_started, nxt_work = running[i][0]
                        running[i][0] = (nxt, max(nxt_started, now), nxt_work)
                if i + 1 < n:
                    ready[i + 1].append((out, work))
        if sent < total and len(ready[0]) + len(running[0]) < IN_FLIGHT:
            size = sizer.next(total - sent, total)
            ready[0].append((mx.array(list(tokens[sent : sent + size]), dtype=mx.int32)[None], total - sent))
            sent += size
            chunks += 1
            if on_cut is not None:
                on_cut(total - sent)
        # Remote stages first: sending does not block, so they work while this thread computes.
        for i in range(n):
            while sessions[i].remote and ready[i] and len(running[i]) < IN_FLIGHT:
                x, work = ready[i].popleft()
                running[i].append((sessions[i].submit(x, work=work), time.perf_counter(), work))
        local = [i for i in range(n) if not sessions[i].remote and ready[i]]
        if local:
            i = local[-1]  # the deepest first: it drains the pipe
            x, work = ready[i].popleft()
            started = time.perf_counter()
            ticket = sessions[i].submit(x, work=work)
            sizer.observe(i, ticket.positions, time.perf_counter() - started)
            running[i].append((ticket, started, work))
            last = sent >= total and not any(ready) and all(t.done() for q in running for t, _, _ in q)
            if between_steps is not None and not last:
                between_steps()
            continue
        heads = [q[0][0] for q in running if q and q[0][0].wait_handle() is not None]
        if heads:
            wait([h for t in heads if (h := t.wait_handle()) is not None], POLL)
            for t in heads:
                if not t.done():
                    t.check()  # raises if the stage is lost, not merely busy
            continue
        if sent >= total and not any(ready) and not any(running):
            return chunks
        if sent < total:
            continue
        raise RuntimeError("prefill stalled")  # pragma: no cover - every path above progresses


class WaitFn(Protocol):
    def __call__(self, handles: Sequence[WaitHandle], timeout: float) -> None: ...


def wait_first(handles: Sequence[WaitHandle], timeout: float) -> None:
    """Blocks until one of ``handles`` (Futures, or objects with ``fileno()``) is ready, or ``timeout``."""
    futures = [h for h in handles if isinstance(h, concurrent.futures.Future)]
    streams = [h for h in handles if not isinstance(h, concurrent.futures.Future)]
    if not streams:
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        return
    if not futures:
        select.select(streams, [], [], timeout)
        return
    end = time.perf_counter() + timeout  # both kinds: look at each in turn
    while time.perf_counter() < end and not any(f.done() for f in futures):
        if select.select(streams, [], [], 0.0005)[0]:
            return
