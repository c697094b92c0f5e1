"""A node's worker processes die with it rather than spin in a collective holding ports: a thread
watches, and a tiny ``sh`` in case MLX's ring holds the GIL (PR_SET_PDEATHSIG fires when the forking
*thread* exits)."""

from __future__ import annotations

import os
import subprocess
import threading
import time

POLL_S = 0.5
PARENT_ENV = "MESHNODE_PARENT_PID"  # the parent may die before the child asks for its pid


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that will call :func:`die_with_parent`."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def die_with_parent(exit_code: int = 3) -> None:
    """Exits at once, without clean-up, when the parent exits (or has)."""
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())
    if os.getppid() != parent:
        os._exit(exit_code)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os._exit(exit_code)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    # $1 the node, $2 this worker: kills the worker when the node is gone.
    script = (
        f'while kill -0 "$1" 2>/dev/null; do kill -0 "$2" 2>/dev/null || exit 0; sleep {POLL_S}; done; '
        'kill -9 "$2" 2>/dev/null'
    )
    subprocess.Popen(
        ["/bin/sh", "-c", script, "meshnode-lifeline", str(parent), str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
