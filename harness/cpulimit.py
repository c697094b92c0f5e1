"""Limit a running process to a fraction of one CPU core, as a machine busy with another job is.

Uses the kernel's CFS bandwidth control through a cgroup of the cpu controller (v1 at
/sys/fs/cgroup/cpu, or v2 where that is the only hierarchy). The cgroup is made for the test and
removed afterwards, the process moved back to the root group first. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def available() -> str | None:
    """None if a process can be limited here, else why not."""
    if os.geteuid() != 0:
        return "limiting a process's CPU needs root"
    if (
        (V1 / "cpu.cfs_quota_us").exists()
        or (V2 / "cgroup.controllers").exists()
        and "cpu" in (V2 / "cgroup.controllers").read_text().split()
    ):
        return None
    return "no cgroup cpu controller on this machine"


def remove_group(group: Path, root: Path) -> None:
    """Move what ``group`` holds back to ``root`` (a cgroup is removed only empty), then remove it."""
    for task in (group / "cgroup.procs").read_text().split() if group.exists() else ():
        with contextlib.suppress(OSError):
            (root / "cgroup.procs").write_text(task)
    with contextlib.suppress(OSError):
        group.rmdir()


@contextlib.contextmanager
def cpu_limited(pid: int, fraction: float, period_us: int = PERIOD_US):
    """While open, process ``pid`` (all its threads, and the children it starts) gets at most
    ``fraction`` of one core in each ``period_us`` (a shorter period: shorter stalls when it is
    throttled); yields a function returning how many CFS periods throttled it so far."""
    v1 = (V1 / "cpu.cfs_quota_us").exists()
    root = V1 if v1 else V2
    group = root / f"mn-test-{os.getpid()}-{secrets.token_hex(3)}"
    group.mkdir()
    try:
        quota = max(1000, int(period_us * fraction))
        if v1:
            (group / "cpu.cfs_period_us").write_text(str(period_us))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {period_us}")
        (group / "cgroup.procs").write_text(str(pid))

        def throttled() -> int:
            for line in (group / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "nr_throttled":
                    return int(value)
            return 0

        yield throttled
    finally:
        remove_group(group, root)
