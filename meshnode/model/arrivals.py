"""Generation requests that have reached a node and are not yet generating: the API counts one from
its arrival (before its prompt is rendered) until a generation takes it in, so a batch about to
start can wait for requests that arrived with the first instead of prefilling that one alone."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator


class _Arrival:
    __slots__ = ("_arrivals", "_done")

    def __init__(self, arrivals: Arrivals):
        self._arrivals, self._done = arrivals, False

    def done(self) -> None:
        self._arrivals._settle(self)

    def _settle_once(self) -> bool:
        done, self._done = self._done, True
        return not done


_current: contextvars.ContextVar[_Arrival | None] = contextvars.ContextVar("meshnode_arrival", default=None)


class Arrivals:
    """How many requests are on their way to a generation; a batch loop waits on it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending = 0

    @property
    def pending(self) -> int:
        return self._pending

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Counts the request this task serves until :func:`taken_in` or the block's end."""
        arrival = _Arrival(self)
        with self._cond:
            self._pending += 1
        token = _current.set(arrival)
        try:
            yield
        finally:
            _current.reset(token)
            arrival.done()

    def _settle(self, arrival: _Arrival) -> None:
        with self._cond:
            if arrival._settle_once():
                self._pending -= 1
                self._cond.notify_all()

    def settled(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s until no request is on its way; whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)


def taken_in() -> None:
    """The request this task serves has reached its generation (a no-op outside :meth:`Arrivals.arriving`)."""
    arrival = _current.get()
    if arrival is not None:
        arrival.done()
