"""A child process of a node dies with it.

A node starts worker processes (a tensor group's member, the ring that times a split layer). When
the node is killed (kill -9, a crash, launchd or systemd stopping it hard) nothing tells them, and a
worker stuck in a collective would spin for minutes, holding a core and its ports, when the service
manager starts the node again. Each such child calls :func:`die_with_parent` first thing.

Two watchers, because a worker can be stuck where Python cannot run: MLX's ring holds the GIL while
it waits for its peers to connect (``mx.distributed.init``), so a thread polling the parent never
gets to run there. A tiny ``sh`` process therefore watches too and kills the worker when the node
is gone; the thread covers the rest and needs no process. Linux's PR_SET_PDEATHSIG is not used: it
fires when the *thread* that forked exits, and workers are started from threads that end.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

POLL_S = 0.5
PARENT_ENV = "MESHNODE_PARENT_PID"  # set by the parent: it may die before the child asks for its pid


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that will call :func:`die_with_parent`: names this process."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def die_with_parent(exit_code: int = 3) -> None:
    """Exit at once (no clean-up: the parent that would want it is gone) when the process that
    started this one exits; checks every half second. A parent already gone (it died while this
    process was importing) ends it now."""
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())
    if os.getppid() != parent:
        os._exit(exit_code)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os._exit(exit_code)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    # $1 the node, $2 this worker: ends with the worker, kills it when the node is gone.
    script = f'while kill -0 "$1" 2>/dev/null; do kill -0 "$2" 2>/dev/null || exit 0; sleep {POLL_S}; done; ' \
             'kill -9 "$2" 2>/dev/null'
    subprocess.Popen(["/bin/sh", "-c", script, "meshnode-lifeline", str(parent), str(os.getpid())],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
