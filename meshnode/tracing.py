"""Timestamps on the token path, to see where a token's time goes between processes (off by default).

With ``MESHNODE_TRACE`` naming a folder, each process appends one line per event to
``<folder>/<pid>.trace``: monotonic nanoseconds (CLOCK_MONOTONIC, the same clock in every process of
one machine, so a head's and a stage's events line up), the event's name, and the thread's name and
native id (``name/id``: what /proc/<pid>/task/<id> shows of its CPU time).
``benchmarks/split_cost.py`` reads them back into a per-token breakdown. With the variable unset,
:func:`mark` is one global lookup and a return.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path

ENV = "MESHNODE_TRACE"
_FLUSH_EVERY = 2048

_events: list[tuple[int, str, str]] | None = None
_path: Path | None = None
_lock = threading.Lock()


def enable(folder: str | os.PathLike) -> None:
    """Record events of this process into ``folder`` (made if missing)."""
    global _events, _path
    Path(folder).mkdir(parents=True, exist_ok=True)
    _path = Path(folder) / f"{os.getpid()}.trace"
    _events = []
    atexit.register(flush)


def mark(event: str) -> None:
    """Note that ``event`` happens now on this thread (nothing unless tracing is enabled)."""
    events = _events
    if events is None:
        return
    events.append((time.monotonic_ns(), event, f"{threading.current_thread().name}/{threading.get_native_id()}"))
    if len(events) >= _FLUSH_EVERY:
        flush()


def flush() -> None:
    """Append the events noted so far to this process's file (events other threads note meanwhile
    stay in the list for the next flush: it is cut, never swapped for a new one)."""
    events = _events
    if events is None or _path is None:
        return
    with _lock:
        n = len(events)
        if n:
            with open(_path, "a") as f:
                f.writelines(f"{ns} {event} {thread}\n" for ns, event, thread in events[:n])
            del events[:n]


def read(folder: str | os.PathLike) -> dict[int, list[tuple[int, str, str]]]:
    """Every process's events in ``folder``: pid -> [(ns, event, thread)] in time order."""
    out: dict[int, list[tuple[int, str, str]]] = {}
    for f in sorted(Path(folder).glob("*.trace")):
        rows = []
        for line in f.read_text().splitlines():
            ns, event, thread = line.split(" ", 2)
            rows.append((int(ns), event, thread))
        out[int(f.stem)] = sorted(rows)
    return out


if os.environ.get(ENV):
    enable(os.environ[ENV])
