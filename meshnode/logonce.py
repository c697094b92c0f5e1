"""Log a message once per key: a warning repeated for every request or announcement says nothing new."""

from __future__ import annotations

import threading
from collections.abc import Hashable


class Once:
    """The keys whose message was logged; ``if once.first(key): log...`` logs it the first time only."""

    def __init__(self) -> None:
        self._done: set[Hashable] = set()
        self._lock = threading.Lock()  # the event loop and the MLX thread both log

    def first(self, key: Hashable) -> bool:
        """True the first time ``key`` comes (and from then on it is done), False after."""
        with self._lock:
            if key in self._done:
                return False
            self._done.add(key)
            return True

    def __contains__(self, key: Hashable) -> bool:
        return key in self._done
