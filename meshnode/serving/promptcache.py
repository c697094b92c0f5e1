"""The prompt cache's head side: which conversation prefixes the stages keep, and which to resume.

After a generation, the head asks every stage to keep the request's KV under a key made from the
tokens it holds (meshnode.model.prefixes). Here the head remembers those token sequences; a new
request resumes from the one sharing the longest start with its prompt and prefills only the rest
at every stage. The stages bound what they keep by memory and may have dropped it; they then say
so, and the request is run again with its whole prompt (:class:`PrefixIndex.forget`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from meshnode.model.prefixes import CANNOT_CUT, prefix_key

log = logging.getLogger(__name__)

# A shared start shorter than this is prefilled again: a resume that misses costs a round trip.
MIN_REUSE = 16
ENTRIES = 32  # prefixes remembered (the stages bound them by memory; this bounds the search)
SETTLE_WAIT = 2.0  # seconds a next turn waits for the previous one's prefix to be kept


def common_start(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixIndex:
    """The prefixes this head asked its stages to keep, most recently used last; thread-safe."""

    def __init__(self, entries: int = ENTRIES):
        self._entries = entries
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, np.ndarray] = OrderedDict()
        self._running: list[tuple[np.ndarray, threading.Event]] = []  # generations still going, and their prompts
        self.partial = True  # False once a stage could not cut a kept prefix (its cache cannot trim)

    def running(self, prompt: Sequence[int], ended: threading.Event) -> None:
        """A generation of ``prompt`` runs; ``ended`` is set once it is over and its prefix kept."""
        with self._lock:
            self._running = [r for r in self._running if not r[1].is_set()]
            self._running.append((np.asarray(prompt, dtype=np.int64), ended))

    async def settled(self, prompt: Sequence[int], timeout: float = SETTLE_WAIT) -> None:
        """Wait (at most ``timeout``) for the generations this prompt continues to be kept.

        A chat client sends the next turn as soon as it has the last token of the previous one
        (EOS, a stop string, a relay that counted max_tokens), while that generation may still
        be asking its stages to keep its prefix. A prompt that holds another running prompt whole
        and goes on past it is such a next turn; one that merely shares a start (the same system
        prompt, an agent's parallel calls) does not wait."""
        want = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            pending = [e for p, e in self._running if not e.is_set() and len(want) > len(p) >= MIN_REUSE
                       and common_start(p, want) == len(p)]
        if pending:
            t0 = time.monotonic()
            deadline = t0 + timeout
            kept = await asyncio.to_thread(lambda: all(e.wait(max(0.0, deadline - time.monotonic())) for e in pending))
            log.debug("prompt cache: waited %.3f s for %d running generation(s) this prompt continues%s",
                      time.monotonic() - t0, len(pending), "" if kept else " (gave up)")

    def match(self, prompt: Sequence[int]) -> tuple[str, int] | None:
        """(key, positions) to resume ``prompt`` from, or None. At least the prompt's last token is
        always computed (its logits give the first new token)."""
        want = np.asarray(prompt, dtype=np.int64)
        best: tuple[str, int] | None = None
        with self._lock:
            entries = list(self._kept.items())
        whole = False
        # On a tie, a prefix resumed whole (nothing to cut back, the least to copy), then the most
        # recently kept or used (the stages give up the least recent first).
        for key, tokens in reversed(entries):
            n = min(common_start(tokens, want), len(want) - 1)
            if n < len(tokens) and not self.partial:
                continue
            if n >= MIN_REUSE and (best is None or n > best[1] or (n == best[1] and n == len(tokens) and not whole)):
                best, whole = (key, n), n == len(tokens)
        if best is not None:
            with self._lock:
                if best[0] in self._kept:
                    self._kept.move_to_end(best[0])
        return best

    def add(self, tokens: Sequence[int], key: str | None = None) -> str:
        """Remember that the stages were asked to keep exactly ``tokens`` (under ``key``, their
        :func:`prefix_key`, when the caller has it already); the key."""
        key = key or prefix_key(tokens)
        with self._lock:
            self._kept.pop(key, None)
            self._kept[key] = np.asarray(tokens, dtype=np.int64)
            while len(self._kept) > self._entries:
                self._kept.popitem(last=False)
        return key

    def forget(self, key: str, why: str = "") -> None:
        """A stage did not hold ``key`` (``why``: its refusal). A cache that cannot be cut back
        (meshnode.model.prefixes.CANNOT_CUT) misses that way every time: from then on only whole
        kept prefixes are resumed."""
        with self._lock:
            self._kept.pop(key, None)
        if CANNOT_CUT in why:
            self.partial = False

    def __len__(self) -> int:
        return len(self._kept)
