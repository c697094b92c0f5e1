"""Stage delays and faults injected into a running node, for tests (harness/hooked_node.py).

A node started with ``--stage-delays FILE`` runs its stages' steps through :class:`InjectedDelay`
(meshnode.transport.hop's stream hook): slow or stalled, deterministically, while the node stays
alive (it heartbeats, its data port answers). The file is JSON, read again whenever it changes, so
a test changes the delays of a running node by writing it. Keys (all optional, seconds):

- ``prefill``: added before running each message of more than one position (a prefill chunk);
  with ``prefill_first`` (a count), only the first that many of each request's stream;
- ``prefill_per_position``: added per position of such a message;
- ``decode``: added before running a one-position message (a decode step); with ``decode_at``
  (a list of indexes, from 0, among each stream's one-position messages), only those;
- ``raise_at``: a list of such indexes at which the stage's computation raises, as a bug in a
  model would (a deterministic fault, reported to the head as one);
- ``stall``: seconds the computation of a one-position message hangs, holding the MLX thread as a
  hung GPU command would; with ``stall_at`` (indexes as ``decode_at``), only those.

A delay is waited on the stream's own thread without the MLX baton (other requests go on).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class InjectedDelay:
    """The delays and faults a JSON file asks for (see the module docstring)."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: int | None = None
        self._spec: dict = {}

    def _current(self) -> dict:
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except OSError:
            return {}
        if stamp != self._stamp:
            try:
                with open(self.path) as f:
                    self._spec = json.load(f) or {}
            except (OSError, ValueError):
                self._spec = {}
            self._stamp = stamp
        return self._spec

    def seconds(self, positions: int, prefills: int, decodes: int) -> float:
        """The delay for a message of ``positions`` after ``prefills`` multi-position and
        ``decodes`` one-position messages of its stream."""
        spec = self._current()
        if positions > 1:
            first = spec.get("prefill_first")
            if first is not None and prefills >= first:
                return 0.0
            return float(spec.get("prefill", 0.0)) + float(spec.get("prefill_per_position", 0.0)) * positions
        at = spec.get("decode_at")
        if at is not None and decodes not in at:
            return 0.0
        return float(spec.get("decode", 0.0))

    def stall(self, positions: int, decodes: int) -> float:
        """Seconds the one-position message after ``decodes`` others hangs inside its step (``stall``)."""
        spec = self._current()
        at = spec.get("stall_at")
        if positions != 1 or (at is not None and decodes not in at):
            return 0.0
        return float(spec.get("stall", 0.0))

    def raises(self, positions: int, decodes: int) -> bool:
        """Whether the one-position message after ``decodes`` others is to fail (``raise_at``)."""
        return positions == 1 and decodes in self._current().get("raise_at", ())

    def stream(self, request_id: str) -> Callable[[int], Callable[[], None] | None]:
        """The hook of one request's stream (meshnode.transport.hop.StreamHook): it counts the
        stream's messages, waits out each one's delay and returns its stall or fault, if any."""
        prefills = decodes = 0

        def before(positions: int) -> Callable[[], None] | None:
            nonlocal prefills, decodes
            pause = self.seconds(positions, prefills, decodes)
            raises = self.raises(positions, decodes)
            fault = f"injected fault at decode step {decodes} (harness.faults)" if raises else None
            stall = self.stall(positions, decodes)
            prefills, decodes = prefills + (positions > 1), decodes + (positions == 1)
            if pause > 0:
                log.info("test delay: %.1f s before a %d-position step of %s", pause, positions, request_id)
                time.sleep(pause)
            if not stall and fault is None:
                return None

            def inside() -> None:  # on the MLX thread, inside the stage's step
                if stall:
                    log.warning("test stall: %.1f s inside a step of %s", stall, request_id)
                    time.sleep(stall)
                if fault is not None:
                    raise RuntimeError(fault)

            return inside

        return before
