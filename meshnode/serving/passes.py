"""Speculative passes in flight through a request's stages, filling the pipeline's bubbles; they
leave in order. A rejected guess cancels the passes behind (the head carries them between stages,
so unreached stages never see them), and each stage cuts its KV back: a remote one with its next message.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from meshnode.serving.prefill import WaitFn, wait_first
from meshnode.tracing import mark
from meshnode.transport.remote_stage import POLL

if TYPE_CHECKING:
    from meshnode.serving.local_stage import LocalSession
    from meshnode.transport.streams import StageStream, StreamTicket


@dataclass(eq=False)
class Pass:
    """Tokens that go through every stage as one step, from position ``start``."""

    tokens: list[int]
    start: int
    sent: float = field(default_factory=time.perf_counter)
    alone: bool = True  # nothing else was in flight with it (its time is a pass's cost)
    cancelled: bool = False


class PassPipe:
    """One request's passes in flight through its stage sessions, oldest first; ``held``: the
    positions every stage holds now."""

    def __init__(self, sessions: Sequence[LocalSession | StageStream], held: int, wait: WaitFn | None = None):
        self._sessions = list(sessions)
        n = len(self._sessions)
        self._held = [held] * n  # positions given to each stage, passes in flight included
        self._ready: list[deque[tuple[Pass, mx.array]]] = [deque() for _ in range(n)]  # (pass, input) for stage i
        self._running: list[deque[tuple[Pass, StreamTicket]]] = [
            deque() for _ in range(n)
        ]  # (pass, ticket) at remote stage i
        self._done: deque[tuple[Pass, mx.array]] = deque()  # (pass, logits) through every stage
        self._passes: deque[Pass] = deque()  # in flight, oldest first
        self._wait = wait or wait_first
        self.end = held  # the position after the last token sent
        self.cut_pending = False  # a cut that a remote stage gets with its next message

    def __len__(self) -> int:
        return len(self._passes)

    def in_flight(self) -> list[int]:
        """The tokens of the passes in flight, in order."""
        return [t for p in self._passes for t in p.tokens]

    def send(self, tokens: Sequence[int]) -> None:
        """Sends a pass into the first stage (a remote one gets it now)."""
        # Alone: none of this request's passes, even cancelled, is in the stages.
        busy = any(not ticket.done() for q in self._running for _, ticket in q)
        p = Pass(list(tokens), self.end, alone=not self._passes and not busy)
        for q in self._passes:
            q.alone = False
        self.end += len(p.tokens)
        self._passes.append(p)
        self._ready[0].append((p, mx.array([p.tokens], dtype=mx.uint32)))
        self.cut_pending = False
        mark("pass.sent")
        self._start_remote()

    def result(self) -> tuple[Pass, mx.array]:
        """The oldest pass and its logits (positions, vocab), once it has left the last stage."""
        oldest = self._passes[0]
        while not self._done or self._done[0][0] is not oldest:
            self._pump()
        self._passes.popleft()
        return self._done.popleft()

    def cancel(self, keep: int) -> None:
        """Drops every pass in flight; each stage keeps positions [0, keep) of its cache."""
        for p in self._passes:
            p.cancelled = True
        self._passes.clear()
        self._done.clear()
        for q in self._ready:
            q.clear()
        self.end = keep
        for i, session in enumerate(self._sessions):
            if self._held[i] > keep:
                session.rewind(self._held[i] - keep)
                self._held[i] = keep
                self.cut_pending = self.cut_pending or session.remote

    def _start_remote(self) -> None:
        for i, session in enumerate(self._sessions):
            while session.remote and self._ready[i]:
                p, x = self._ready[i].popleft()
                self._held[i] += len(p.tokens)
                self._running[i].append((p, session.submit(x)))

    def _advance(self, i: int, p: Pass, out: mx.array) -> None:
        if i + 1 < len(self._sessions):
            self._ready[i + 1].append((p, out))
        else:
            self._done.append((p, out[0]))

    def _pump(self) -> None:
        """Takes replies, starts remote stages, runs the deepest local stage, or waits."""
        for i, q in enumerate(self._running):
            while q and q[0][1].done():
                p, ticket = q.popleft()
                out = ticket.result()  # read even when cancelled: replies come in order
                if not p.cancelled:
                    self._advance(i, p, out)
        self._start_remote()
        local = [i for i, s in enumerate(self._sessions) if not s.remote and self._ready[i]]
        if local:
            i = local[-1]
            p, x = self._ready[i].popleft()
            mark("pass.local")
            self._held[i] += len(p.tokens)
            session = self._sessions[i]
            assert not session.remote  # local: only local sessions run on this thread
            last = i + 1 == len(self._sessions)
            self._advance(i, p, session.forward(x, all_positions=True) if last else session.forward(x))
            return
        if self._done and self._done[0][0] is self._passes[0]:
            return
        heads = [q[0][1] for q in self._running if q]
        if not heads:
            raise RuntimeError("no pass in flight")  # pragma: no cover - result() waits for a pass sent
        self._wait([h for t in heads if (h := t.wait_handle()) is not None], POLL)
        for t in heads:
            if not t.done():
                t.check()  # raises if the stage is lost (no heartbeat), not if busy
