"""Take memory back from a running process, as the owner's browser does: a memory cgroup (v1 at
/sys/fs/cgroup/memory, else v2) holding only that process, its charges moved with it, limited to
what it uses now plus some headroom (where the kernel no longer moves a process's charges into a
cgroup, what it allocates from then on). Removed afterwards, the process moved back first. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from harness.cpulimit import remove_group

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


def available() -> str | None:
    """None if a process's memory can be limited here, else why not."""
    if os.geteuid() != 0:
        return "limiting a process's memory needs root"
    if (V1 / "memory.limit_in_bytes").exists() or "memory" in _v2_controllers():
        return None
    return "no cgroup memory controller on this machine"


def _v2_controllers() -> list[str]:
    try:
        return (V2 / "cgroup.controllers").read_text().split()
    except OSError:
        return []


class Limit:
    """A process's memory cgroup: ``squeeze(headroom)`` limits it to its use plus ``headroom`` bytes,
    ``lift()`` takes the limit off; ``oom_kills()`` counts the kernel's OOM kills in it."""

    def __init__(self, group: Path, v1: bool):
        self.group, self.v1 = group, v1

    def usage(self) -> int:
        return int((self.group / ("memory.usage_in_bytes" if self.v1 else "memory.current")).read_text())

    def squeeze(self, headroom: int) -> int:
        limit = self.usage() + headroom
        (self.group / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text(str(limit))
        return limit

    def lift(self) -> None:
        (self.group / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text("-1" if self.v1 else "max")

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.v1 else "memory.events"
        for line in (self.group / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


@contextlib.contextmanager
def memory_cgroup(pid: int):
    """While open, process ``pid`` lives in a memory cgroup of its own (no limit yet); yields its :class:`Limit`."""
    v1 = (V1 / "memory.limit_in_bytes").exists()
    root = V1 if v1 else V2
    group = root / f"mn-test-{os.getpid()}-{secrets.token_hex(3)}"
    group.mkdir()
    try:
        if v1:  # its pages come with it; kernels that dropped this charge only what it allocates from now
            with contextlib.suppress(OSError):
                (group / "memory.move_charge_at_immigrate").write_text("3")
        (group / "cgroup.procs").write_text(str(pid))
        yield Limit(group, v1)
    finally:
        remove_group(group, root)
