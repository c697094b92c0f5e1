"""What a test run makes once and its parallel workers share (standard library only)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def made_once(final: Path, ready: str, make: Callable[[Path], object]) -> Path:
    """``final``, made by ``make(folder)`` in the first process that asks (the others wait on a lock,
    then read it); it counts as made once ``final / ready`` exists. The folder is renamed into place
    whole, so a failed make leaves nothing behind."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / ready).exists():
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
            try:
                make(tmp / "made")
                os.replace(tmp / "made", final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return final
