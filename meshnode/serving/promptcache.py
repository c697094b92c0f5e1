"""The prompt cache's head side: which prefixes the stages keep, and which to resume from. A request
that would resume more of a closed generation's tokens waits for that one alone, so an agent's
parallel calls run side by side."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from meshnode.model.prefixes import CANNOT_CUT, prefix_key

if TYPE_CHECKING:
    from meshnode.model.prefix_disk import PrefixDisk

log = logging.getLogger(__name__)

# A shorter shared start is prefilled again: a resume that misses costs a round trip.
MIN_REUSE = 16
ENTRIES = 32  # bounds the search; the stages bound prefixes by memory
# Seconds an answer waits for its prefix to be kept, and a head for a relay's given-up generations.
SETTLE_WAIT = 2.0
WAIT_SLICE = 1.0  # seconds an unbounded wait holds a worker thread at a time


def common_start(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


async def _wait_all(events: Sequence[threading.Event], timeout: float | None) -> bool:
    """Waits off the event loop for every event or ``timeout``; whether all were set."""
    if timeout is not None:
        deadline = time.monotonic() + timeout
        return await asyncio.to_thread(lambda: all(e.wait(max(0.0, deadline - time.monotonic())) for e in events))
    for event in events:
        while not event.is_set():
            await asyncio.to_thread(event.wait, WAIT_SLICE)
    return True


class PrefixIndex:
    """The prefixes this head asked its stages to keep, most recently used last; thread-safe."""

    def __init__(self, entries: int = ENTRIES, disk: PrefixDisk | None = None):
        """``disk``: where prefix tokens are written, and read back from at start."""
        self._entries = entries
        self._disk = disk
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, np.ndarray] = OrderedDict()
        self._relayed: dict[str, threading.Event] = {}  # relayed generations here: set once over
        # Closed generations maybe still keeping their prefix: (tokens, end).
        self._closed: list[tuple[np.ndarray, threading.Event]] = []
        self.partial = True  # False once a stage could not cut a kept prefix
        if disk is not None:
            self._read_back(disk)

    def _read_back(self, disk: PrefixDisk) -> None:
        """A restarted head's index: the prefixes most recently kept on disk."""
        for key, tokens in disk.recent_tokens(self._entries):
            if prefix_key(tokens.tolist()) == key:
                self._kept[key] = tokens
            else:
                log.warning("prompt cache: deleted prefix %s from disk: its tokens do not hash to its name", key)
                disk.discard(key)

    async def until_kept(
        self, ended: threading.Event, tokens: Sequence[int] | None = None, timeout: float | None = None
    ) -> bool:
        """Waits up to ``timeout`` for ``ended``; meanwhile a request that would resume more of
        ``tokens`` waits too."""
        if ended.is_set():
            return True
        if tokens is not None and len(tokens) >= MIN_REUSE:
            with self._lock:
                self._closed = [c for c in self._closed if not c[1].is_set()]
                self._closed.append((np.asarray(tokens, dtype=np.int64), ended))
        return await _wait_all([ended], SETTLE_WAIT if timeout is None else timeout)

    async def settled_match(self, prompt: Sequence[int]) -> tuple[str, int] | None:
        """:meth:`match`, once every closed generation giving ``prompt`` a longer start ends."""
        want = np.asarray(prompt, dtype=np.int64)
        t0, waited = time.monotonic(), False
        while True:
            with self._lock:  # one that ends after the match is waited for
                self._closed = [c for c in self._closed if not c[1].is_set()]
                closed = list(self._closed)
            best = self.match(prompt)
            have = best[1] if best is not None else 0
            pending = [
                ended
                for tokens, ended in closed
                if max(have + 1, MIN_REUSE) <= min(common_start(tokens, want), len(want) - 1)
            ]
            if not pending:
                if waited:
                    log.debug(
                        "prompt cache: waited %.3f s for closed generations to keep their prefixes",
                        time.monotonic() - t0,
                    )
                return best
            await _wait_all(pending, None)
            waited = True

    def relayed(self, request_id: str) -> threading.Event:
        """A relay's generation runs here: the event is set when it ends."""
        ended = threading.Event()
        with self._lock:
            self._relayed = {r: e for r, e in self._relayed.items() if not e.is_set()}
            self._relayed[request_id] = ended
        return ended

    async def after(self, request_ids: Sequence[str], timeout: float | None = None) -> None:
        """Waits up to ``timeout`` for the generations a relay gave up to end."""
        with self._lock:
            pending = [e for r in request_ids if (e := self._relayed.get(r)) is not None and not e.is_set()]
        if pending:
            t0 = time.monotonic()
            over = await _wait_all(pending, SETTLE_WAIT if timeout is None else timeout)
            log.debug(
                "prompt cache: waited %.3f s for %d generation(s) given up by their relay%s",
                time.monotonic() - t0,
                len(pending),
                "" if over else " (gave up)",
            )

    def match(self, prompt: Sequence[int]) -> tuple[str, int] | None:
        """(key, positions) to resume ``prompt`` from, or None; the last prompt token is always
        computed (its logits give the first new token)."""
        want = np.asarray(prompt, dtype=np.int64)
        best: tuple[str, int] | None = None
        with self._lock:
            entries = list(self._kept.items())
        whole = False
        # Ties: a prefix resumed whole (nothing to cut), then the most recent (stages drop the oldest).
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
        """Remembers that the stages keep exactly ``tokens``; returns the key."""
        key = key or prefix_key(tokens)
        with self._lock:
            self._kept.pop(key, None)
            self._kept[key] = np.asarray(tokens, dtype=np.int64)
            while len(self._kept) > self._entries:
                self._kept.popitem(last=False)
        if self._disk is not None:
            self._disk.keep_tokens(key, tokens)
        return key

    def forget(self, key: str, why: str = "") -> None:
        """A stage did not hold ``key``; after CANNOT_CUT only whole kept prefixes are resumed."""
        with self._lock:
            self._kept.pop(key, None)
        if CANNOT_CUT in why:
            self.partial = False

    def __len__(self) -> int:
        return len(self._kept)
