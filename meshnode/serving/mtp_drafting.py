"""Guesses of a model's own MTP head (meshnode.model.mtp) on a node that holds the whole model.

A HiddenTap records the hidden states of each forward pass on the request's thread; each ``extend``
(the tokens one pass confirmed) pairs the oldest record with them, the records before the first call
being the prompt's. A record that does not fit its pass stops the drafting: speed lost, never a
different answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from meshnode.model.mtp import MTPHead
from meshnode.model.mtp_tap import HiddenTap
from meshnode.model.shard import any_thread_stream

log = logging.getLogger(__name__)


class MTPDrafter:
    """Greedy guesses of ``head`` after the request's ``tokens``, with the request's own head cache."""

    free = False  # each guess is a step of the head's block
    fixed_k: int | None = None
    # Its input is the hidden states of the pass before: one pass at a time.
    fixed_depth: int | None = 1

    def __init__(self, head: MTPHead, tap: HiddenTap, tokens: Sequence[int], lock: threading.Lock):
        self._head, self._lock = head, lock
        self._captures = tap.listen()
        self._tokens = list(tokens)
        self._cache = KVCache()
        self._chained = 0  # entries of the last draft chained on its own guesses
        self._rows: list[mx.array] = []  # hidden states of confirmed positions the head has not seen
        self._next: list[int] = []  # the token after each
        self._started = False
        self._expect = 1  # positions of the next forward pass: 1, or 1 + the guesses proposed
        self.stopped = ""  # why it no longer drafts ("" while it does)

    def _stop(self, why: str) -> None:
        if not self.stopped:
            log.debug("MTP drafting stops for this request: %s", why)
        self.stopped = why
        self._rows, self._next = [], []
        self._captures.taken.clear()

    def _start(self, decoded: int) -> None:
        """Take the prompt's records: all but the last ``decoded`` forward passes so far."""
        self._started = True
        taken = self._captures.taken
        prompt = [taken.popleft() for _ in range(len(taken) - decoded)]
        rows = sum(int(h.shape[1]) for h in prompt)
        if any(h.shape[0] != 1 for h in prompt) or rows > len(self._tokens) - 1:
            self._stop(f"the prompt's passes hold {rows} positions, the request has {len(self._tokens)} tokens")
            return
        if rows:  # positions len - 1 - rows .. len - 2, each followed by the next token
            self._rows = [h[0] for h in prompt]
            self._next = self._tokens[len(self._tokens) - rows :]

    def extend(self, tokens: Sequence[int]) -> None:
        """``tokens``: what one forward pass confirmed (its first positions, one token after each)."""
        if not self._started:
            self._start(decoded=1)
        self._tokens.extend(tokens)
        expect, self._expect = self._expect, 1
        if self.stopped or not tokens:
            return
        if not self._captures.taken:
            self._stop("a forward pass of this request was not recorded here")
            return
        hidden = self._captures.taken.popleft()
        if hidden.shape[0] != 1 or hidden.shape[1] != expect or len(tokens) > expect:
            self._stop(f"a pass of {expect} positions confirming {len(tokens)} was recorded as {hidden.shape}")
            return
        self._rows.append(hidden[0, : len(tokens)])
        self._next.extend(tokens)

    def propose(self, k: int) -> list[int]:
        if not self._started:
            self._start(decoded=0)
        if k <= 0 or self.stopped or not self._rows:
            return []
        head = self._head
        with self._lock, mx.stream(any_thread_stream()):
            head.cache, head.chained = self._cache, self._chained
            try:
                head.settle()  # the last draft's chained guesses: the verified positions come in now
                draft = head.draft(mx.concatenate(self._rows, axis=0), self._next, k)
            finally:
                self._cache, self._chained = head.cache, head.chained
        self._rows, self._next = [], []
        self._expect = 1 + len(draft.tokens)
        return draft.tokens


def mtp_drafters(head: MTPHead, model: object) -> Callable[[Sequence[int]], MTPDrafter]:
    """A drafter factory (meshnode.serving.speculative.Speculation.drafter) for ``head`` on the whole
    ``model`` this node runs (an mlx-lm model; its final norm gets a HiddenTap)."""
    tap = HiddenTap.on(model)  # type: ignore[arg-type]
    lock = threading.Lock()
    return lambda tokens: MTPDrafter(head, tap, tokens, lock)
