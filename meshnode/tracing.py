"""Timestamps on the token path, to see where a token's time goes between processes (off by default).

With ``MESHNODE_TRACE`` naming a folder, each process appends ``<folder>/<pid>.trace`` lines:
CLOCK_MONOTONIC nanoseconds (shared by the processes of a machine), the event, and the thread's
name and native id; ``benchmarks/split_cost.py`` reads them back. Unset, :func:`mark` costs a lookup.
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


def enable(folder: str | os.PathLike[str]) -> None:
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
    """Append the events noted so far to this process's file (the list is cut, never swapped)."""
    events = _events
    if events is None or _path is None:
        return
    with _lock:
        n = len(events)
        if n:
            with open(_path, "a") as f:
                f.writelines(f"{ns} {event} {thread}\n" for ns, event, thread in events[:n])
            del events[:n]


def read(folder: str | os.PathLike[str]) -> dict[int, list[tuple[int, str, str]]]:
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
