"""The prompt cache's head side: which conversation prefixes the stages keep, and which to resume.

After a generation, the head asks every stage to keep the request's KV under a key made from the
tokens it holds (meshnode.model.prefixes). Here the head remembers those token sequences; a new
request resumes from the one sharing the longest start with its prompt and prefills only the rest
at every stage. The stages bound what they keep by memory and may have dropped it; they then say
so, and the request is run again with its whole prompt (:class:`PrefixIndex.forget`).

A chat client sends the next turn as soon as the previous answer is complete, and an answer is
complete before its generation is over (EOS, a stop string or max_tokens seen by the API; the
stages still run the step built ahead, then keep the prefix). So that the next turn finds the
prefix, nothing tells the client the answer is complete before the prefix is kept:
- on the head, closing a generation's tokens waits for its keep (:meth:`PrefixIndex.until_kept`),
  and the API closes them before it sends the answer's last piece (meshnode.serving.engine);
- a relay (another node the client asked) cannot wait so: it gives the generation up by
  cancelling its stream. It names the generations it gave up in its next request to that head
  (``GenerateRequest.after``), and the head waits for those to be over first
  (:meth:`PrefixIndex.after`).
Waiting on exactly those generations, not on prompts that look alike, leaves an agent's parallel
calls (which share a start) running side by side; every wait is bounded by ``SETTLE_WAIT``.
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
SETTLE_WAIT = 2.0  # seconds an answer or a next turn waits for a generation's prefix to be kept


def common_start(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


async def _wait_all(events: Sequence[threading.Event], timeout: float) -> bool:
    """Wait, off the event loop, until every event is set or ``timeout`` has passed; whether all were."""
    deadline = time.monotonic() + timeout
    return await asyncio.to_thread(lambda: all(e.wait(max(0.0, deadline - time.monotonic())) for e in events))


class PrefixIndex:
    """The prefixes this head asked its stages to keep, most recently used last; thread-safe."""

    def __init__(self, entries: int = ENTRIES):
        self._entries = entries
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, np.ndarray] = OrderedDict()
        self._relayed: dict[str, threading.Event] = {}  # relays' generations running here: set once over
        self.partial = True  # False once a stage could not cut a kept prefix (its cache cannot trim)

    async def until_kept(self, ended: threading.Event, timeout: float = SETTLE_WAIT) -> bool:
        """Wait (at most ``timeout``) for a generation whose tokens are closed to be over: its
        stages have kept its prefix, or it kept none (``ended``, set by the generation's end)."""
        return ended.is_set() or await _wait_all([ended], timeout)

    def relayed(self, request_id: str) -> threading.Event:
        """A relay's generation ``request_id`` runs here: set the event returned once it is over
        (its tokens closed, so its prefix kept: :meth:`until_kept`)."""
        ended = threading.Event()
        with self._lock:
            self._relayed = {r: e for r, e in self._relayed.items() if not e.is_set()}
            self._relayed[request_id] = ended
        return ended

    async def after(self, request_ids: Sequence[str], timeout: float = SETTLE_WAIT) -> None:
        """Wait (at most ``timeout``) for the relayed generations ``request_ids`` still running
        here to be over: the relay gave them up (their answers were complete) before it sent the
        request that waits, which may be their conversation's next turn."""
        with self._lock:
            pending = [e for r in request_ids if (e := self._relayed.get(r)) is not None and not e.is_set()]
        if pending:
            t0 = time.monotonic()
            over = await _wait_all(pending, timeout)
            log.debug("prompt cache: waited %.3f s for %d generation(s) given up by their relay%s",
                      time.monotonic() - t0, len(pending), "" if over else " (gave up)")

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
