"""Pipelined chunked prefill: a prompt flows through the stages like an assembly line.

The head runs every prompt token but the last through the stages in chunks; mlx-lm's
``generate_step`` then runs the last token and samples, as it always does. Each stage sees one
request's chunks in order (its KV cache grows chunk by chunk), but the head never waits for
chunk k to leave the last stage before sending chunk k+1 into the first: while stage 2 works on
chunk k, stage 1 already works on k+1. No chunk's logits are used, only the caches they fill.

:class:`ChunkSizer` picks each chunk's size from every stage's measured seconds per position:
small enough that no stage's step runs longer than ``max_step`` (Apple's GPU kills a command that
runs too long), and small enough that the prompt is cut into several chunks per stage, so the
pipe fills quickly and drains quickly (its idle bubble is about one chunk per stage).
"""

from __future__ import annotations

import concurrent.futures
import math
import select
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx

# Chunks per stage a prompt is cut into when it is long enough: the bubble of a pipe of S stages
# fed n chunks costs (S - 1) / n of the ideal time.
CHUNKS_PER_STAGE = 4
MIN_CHUNK = 16  # positions: smaller chunks cost more in per-message overhead than they save
FIRST_CHUNK = 64  # before any stage has been timed
IN_FLIGHT = 2  # chunks queued at one stage: one running, one waiting behind it


class Ticket(Protocol):
    """One chunk submitted to one stage."""

    positions: int
    deadline: float | None  # time.perf_counter() by which result() must have it (None: already has it)

    def done(self) -> bool: ...

    def result(self) -> mx.array: ...

    def wait_handle(self) -> object | None: ...  # see wait_first


class PipelinedSession(Protocol):
    remote: bool

    def submit(self, x: mx.array) -> Ticket: ...


class DoneTicket:
    """A chunk a local stage has already run (on the generation's own thread)."""

    deadline = None

    def __init__(self, out: mx.array, positions: int):
        self._out, self.positions = out, positions

    def done(self) -> bool:
        return True

    def result(self) -> mx.array:
        return self._out

    def wait_handle(self) -> None:
        return None


class ChunkSizer:
    """Chunk sizes from each stage's measured seconds per position."""

    def __init__(self, stages: int, *, max_step: float, max_chunk: int, min_chunk: int = MIN_CHUNK):
        self.stages = stages
        self.max_step = max_step
        self.max_chunk = max_chunk
        self.min_chunk = min(min_chunk, max_chunk)
        self.per_position: list[float | None] = [None] * stages

    def observe(self, stage: int, positions: int, seconds: float) -> None:
        rate = seconds / max(positions, 1)
        old = self.per_position[stage]
        self.per_position[stage] = rate if old is None else 0.5 * old + 0.5 * rate

    def next(self, remaining: int, total: int) -> int:
        size = self.max_chunk
        known = [r for r in self.per_position if r]
        if known:
            size = min(size, int(self.max_step / max(known)))
        else:
            size = min(size, FIRST_CHUNK)
        if self.stages > 1:
            size = min(size, math.ceil(total / (CHUNKS_PER_STAGE * self.stages)))
        return max(1, min(remaining, max(size, self.min_chunk)))


def pipelined_prefill(
    sessions: Sequence[PipelinedSession],
    tokens: Sequence[int],
    sizer: ChunkSizer,
    *,
    wait: "WaitFn | None" = None,
    between_steps=None,
) -> int:
    """Fill every stage's cache with ``tokens``; returns the number of chunks sent.

    ``wait(futures, timeout)`` blocks until one of them is done (the caller may hand the MLX
    thread to other work meanwhile); ``between_steps()`` runs after each local step (fairness).
    """
    n = len(sessions)
    total = len(tokens)
    ready: list[deque] = [deque() for _ in range(n)]  # inputs that can go into stage i
    running: list[deque] = [deque() for _ in range(n)]  # (ticket, started) in order, per stage
    sent = chunks = 0
    wait = wait or wait_first

    while True:
        # Results leave each stage in order; a stage's next chunk starts when its last one ends.
        for i in range(n):
            while running[i] and running[i][0][0].done():
                ticket, started = running[i].popleft()
                now = time.perf_counter()
                out = ticket.result()
                if sessions[i].remote:
                    sizer.observe(i, ticket.positions, now - started)
                    if running[i]:  # the next one started (at the latest) when this one ended
                        nxt, nxt_started = running[i][0]
                        running[i][0] = (nxt, max(nxt_started, now))
                if i + 1 < n:
                    ready[i + 1].append(out)
        if sent < total and len(ready[0]) + len(running[0]) < IN_FLIGHT:
            size = sizer.next(total - sent, total)
            ready[0].append(mx.array(list(tokens[sent:sent + size]), dtype=mx.int32)[None])
            sent += size
            chunks += 1
        # Remote stages first: sending does not block, so they work while this thread computes.
        for i in range(n):
            while sessions[i].remote and ready[i] and len(running[i]) < IN_FLIGHT:
                running[i].append((sessions[i].submit(ready[i].popleft()), time.perf_counter()))
        local = [i for i in range(n) if not sessions[i].remote and ready[i]]
        if local:
            i = local[-1]  # the deepest first: it drains the pipe
            x = ready[i].popleft()
            started = time.perf_counter()
            ticket = sessions[i].submit(x)
            sizer.observe(i, ticket.positions, time.perf_counter() - started)
            running[i].append((ticket, started))
            if between_steps is not None:
                between_steps()
            continue
        heads = [q[0][0] for q in running if q and q[0][0].wait_handle() is not None]
        if heads:
            deadline = min(t.deadline for t in heads)
            wait([t.wait_handle() for t in heads], max(0.0, deadline - time.perf_counter()))
            for t in heads:
                if not t.done() and time.perf_counter() >= t.deadline:
                    t.result()  # raises: the stage did not answer in time
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

    A handle is a ``concurrent.futures.Future`` (a reply the event loop receives: gRPC) or an
    object with ``fileno()`` (a stream the generation thread reads itself: the data port), which
    is ready when it has bytes to read.
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
