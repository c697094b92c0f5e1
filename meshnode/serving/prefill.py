"""Pipelined chunked prefill: a prompt flows through the stages like an assembly line.

The head sends every prompt token but the last through the stages in chunks, without waiting
for chunk k to leave the last stage before sending k+1 into the first; ``generate_step`` then runs
the last token and samples. Only the caches the chunks fill are used, not their logits.

:class:`ChunkSizer` sizes chunks from each stage's measured seconds per position: no step longer
than ``max_step`` (Apple's GPU kills long commands) or ``TURN``, several chunks per stage so the
pipe fills and drains quickly, and about ``SHARED_STEP`` while generations with less prompt left
run (``busy``), so their steps never wait long behind a long prompt. Measured speeds carry over
between requests (``seed``).

A chunk is awaited as long as its stage is alive (``Ticket.check``), however long it takes.
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

# Chunks per stage a prompt is cut into when it is long enough: the bubble of a pipe of S stages
# fed n chunks costs (S - 1) / n of the ideal time.
CHUNKS_PER_STAGE = 4
MIN_CHUNK = 16  # positions: smaller chunks cost more in per-message overhead than they save
FIRST_CHUNK = 64  # before any stage has been timed
SHARED_STEP = 0.010  # seconds a chunk may take at the slowest stage while other generations run
# Seconds a chunk may take even alone: bounds what a long prompt adds to a newcomer's first token.
TURN = 0.05
BUSY_MIN_CHUNK = 4  # positions: the smallest chunk then (per-message overhead)
BUSY_FIRST_CHUNK = 16  # before any stage has been timed, while other generations run
POLL = 0.25  # seconds between two looks at the liveness of the stages being waited for
IN_FLIGHT = 2  # chunks queued at one stage: one running, one waiting behind it


class Ticket(Protocol):
    """One chunk submitted to one stage."""

    positions: int

    def done(self) -> bool: ...

    def check(self) -> None: ...  # raises when the stage is lost (not when it is slow)

    def result(self) -> mx.array: ...

    def wait_handle(self) -> object | None: ...  # see wait_first


class PipelinedSession(Protocol):
    @property
    def remote(self) -> bool: ...  # read only, so each kind of session may declare its own Literal

    def submit(self, x: mx.array, *, work: int = 0) -> Ticket: ...  # work: see pipelined_prefill


class DoneTicket:
    """A chunk a local stage has already run (on the generation's own thread)."""

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
    """Chunk sizes from each stage's measured seconds per position."""

    def __init__(self, stages: int, *, max_step: float, max_chunk: int, min_chunk: int = MIN_CHUNK,
                 seed: Sequence[float | None] | None = None, busy=None):
        """``seed``: each stage's seconds per position from earlier requests; ``busy()``: generations
        with less prompt left run here now (chunks are cut to SHARED_STEP)."""
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
    between_steps=None,
    on_cut: Callable[[int], None] | None = None,
) -> int:
    """Fill every stage's cache with ``tokens``; returns the number of chunks sent.

    ``wait(futures, timeout)`` blocks until one is done; ``between_steps()`` runs after each local
    step but the last, so others take their turn; ``on_cut(remaining)`` after each chunk is cut.
    Each chunk carries its ``work`` (prompt positions left), so every stage serves the request with
    the least left first. A stage is waited for while it is alive, however long it takes.
    """
    n = len(sessions)
    total = len(tokens)
    ready: list[deque] = [deque() for _ in range(n)]  # (input, work) that can go into stage i
    running: list[deque] = [deque() for _ in range(n)]  # (ticket, started, work) in order, per stage
    sent = chunks = 0
    wait = wait or wait_first

    while True:
        # Results leave each stage in order; a stage's next chunk starts when its last one ends.
        for i in range(n):
            while running[i] and running[i][0][0].done():
                ticket, started, work = running[i].popleft()
                now = time.perf_counter()
                out = ticket.result()
                if sessions[i].remote:
                    sizer.observe(i, ticket.positions, now - started)
                    if running[i]:  # the next one started (at the latest) when this one ended
                        nxt, nxt_started, nxt_work = running[i][0]
                        running[i][0] = (nxt, max(nxt_started, now), nxt_work)
                if i + 1 < n:
                    ready[i + 1].append((out, work))
        if sent < total and len(ready[0]) + len(running[0]) < IN_FLIGHT:
            size = sizer.next(total - sent, total)
            ready[0].append((mx.array(list(tokens[sent:sent + size]), dtype=mx.int32)[None], total - sent))
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
            wait([t.wait_handle() for t in heads], POLL)
            for t in heads:
                if not t.done():
                    t.check()  # raises: the stage is lost (stopped heartbeating), not merely busy
            continue
        if sent >= total and not any(ready) and not any(running):
            return chunks
        if sent < total:
            continue
        raise RuntimeError("prefill stalled")  # pragma: no cover - every path above progresses


class WaitFn(Protocol):
    def __call__(self, handles: list, timeout: float) -> None: ...


def wait_first(handles: list, timeout: float) -> None:
    """Block until one of ``handles`` is ready or ``timeout`` passes.

    A handle is a ``concurrent.futures.Future`` (gRPC) or an object with ``fileno()`` (the data
    port), ready when it has bytes to read.
    """
    futures = [h for h in handles if isinstance(h, concurrent.futures.Future)]
    streams = [h for h in handles if not isinstance(h, concurrent.futures.Future)]
    if not streams:
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        return
    if not futures:
        select.select(streams, [], [], timeout)
        return
    end = time.perf_counter() + timeout  # both kinds (a stage on an old peer): look at each in turn
    while time.perf_counter() < end and not any(f.done() for f in futures):
        if select.select(streams, [], [], 0.0005)[0]:
            return
