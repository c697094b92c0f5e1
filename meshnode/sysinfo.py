"""Facts about this machine: memory, CPUs, platform and a quick compute figure."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshnode.config import Settings

__all__ = [
    "available_memory",
    "compute_figure",
    "cpu_count",
    "memory_budget",
    "platform_name",
    "total_memory",
]

log = logging.getLogger(__name__)

NO_CGROUP_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63


def platform_name() -> str:
    """``"macos"``, ``"linux"``, or ``sys.platform`` elsewhere."""
    if sys.platform == "darwin":
        return "macos"
    if sys.platform.startswith("linux"):
        return "linux"
    return sys.platform


def cpu_count() -> int:
    """CPUs this process may use."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except OSError:
            pass
    return os.cpu_count() or 1


# --------------------------------------------------------------------------- Linux


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def _cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup (v2, else v1), if it has a limit."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            lines = [line.strip().split(":", 2) for line in fh if line.count(":") >= 2]
    except OSError:
        return None
    for _, controllers, rel in lines:
        if controllers == "":  # v2
            base, names = Path("/sys/fs/cgroup") / rel.lstrip("/"), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        try:
            limit = (base / names[0]).read_text().strip()
            if limit == "max" or int(limit) >= NO_CGROUP_LIMIT:
                continue
            return int(limit), int((base / names[1]).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def _sysconf_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


# --------------------------------------------------------------------------- macOS


def _sysctl_int(name: str) -> int:
    out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=True)
    return int(out.stdout.strip())


def _vm_stat_available() -> int:
    out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5, check=True).stdout
    m = re.search(r"page size of (\d+) bytes", out)
    page = int(m.group(1)) if m else os.sysconf("SC_PAGE_SIZE")
    pages = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        value = value.strip().rstrip(".")
        if value.isdigit():
            pages[key.strip()] = int(value)
    free = pages.get("Pages free", 0) + pages.get("Pages inactive", 0) + pages.get("Pages speculative", 0)
    # purgeable pages are reclaimable too, but are already counted among the above on recent macOS
    return free * page


# --------------------------------------------------------------------------- public


def total_memory() -> int:
    """Physical memory in bytes (capped by a cgroup limit on Linux)."""
    total = 0
    if sys.platform == "darwin":
        try:
            total = _sysctl_int("hw.memsize")
        except (OSError, ValueError, subprocess.SubprocessError):
            total = 0
    elif sys.platform.startswith("linux"):
        try:
            total = _meminfo().get("MemTotal", 0)
        except OSError:
            total = 0
        cg = _cgroup_limit()
        if cg is not None and total:
            total = min(total, cg[0])
    return total or _sysconf_total()


def available_memory() -> int:
    """Bytes usable now without swapping: Linux ``MemAvailable`` (capped by the cgroup), macOS
    free + inactive + speculative pages."""
    avail = 0
    if sys.platform == "darwin":
        try:
            avail = _vm_stat_available()
        except (OSError, ValueError, subprocess.SubprocessError):
            avail = 0
    elif sys.platform.startswith("linux"):
        try:
            info = _meminfo()
            avail = info.get("MemAvailable") or (info.get("MemFree", 0) + info.get("Cached", 0))
        except OSError:
            avail = 0
        cg = _cgroup_limit()
        if cg is not None and avail:
            avail = min(avail, max(0, cg[0] - cg[1]))
    if not avail:
        avail = total_memory() // 2
    return avail


def mlx_memory() -> int:
    """Bytes MLX holds in this process: arrays in use and its cache of freed buffers."""
    import mlx.core as mx

    return mx.get_active_memory() + mx.get_cache_memory()


def working_set_limit() -> int | None:
    """Metal's recommended working set in bytes, or None (MLX's CPU build)."""
    try:
        import mlx.core as mx

        size = mx.device_info().get("max_recommended_working_set_size")
    except Exception:  # noqa: BLE001 - no MLX device information: no limit beyond memory itself
        return None
    return int(size) if size else None


def memory_budget(settings: Settings) -> int:
    """``settings.memory_budget``, else fraction x available memory; never over the GPU's
    recommended working set (beyond it a Mac pages)."""
    if settings.memory_budget is not None:
        return int(settings.memory_budget)
    return capped_budget(int(settings.memory_fraction * available_memory()), working_set_limit())


def capped_budget(budget: int, working_set: int | None) -> int:
    return budget if working_set is None else min(budget, working_set)


def use_recommended_wired_limit() -> None:
    """Wire memory up to the recommended working set for the process's life, as mlx_lm.generate does."""
    if working_set_limit() is not None:
        from mlx_lm.utils import maybe_set_recommended_wired_limit

        maybe_set_recommended_wired_limit()


_compute_lock = threading.Lock()
_compute_cache: float | None = None


def compute_figure() -> float:
    """Matmul GFLOP/s of the default MLX device, once per process; only ratios between nodes
    matter. 1.0 if MLX is unusable."""
    global _compute_cache
    with _compute_lock:
        if _compute_cache is None:
            try:
                _compute_cache = _measure_matmul()
            except Exception as exc:  # noqa: BLE001  # pragma: no cover - only when MLX is broken
                log.warning("could not measure compute speed (%s); assuming 1 GFLOP/s", exc)
                _compute_cache = 1.0
        return _compute_cache


def _measure_matmul(budget_s: float = 0.2) -> float:
    import mlx.core as mx

    start = time.perf_counter()
    deadline = start + budget_s
    key = mx.random.key(0)
    n = 256
    best = 0.0
    while True:
        a = mx.random.normal((n, n), dtype=mx.float32, key=key)
        b = mx.random.normal((n, n), dtype=mx.float32, key=key)
        mx.eval(a, b)
        mx.eval(a @ b)  # warm-up
        took: float | None = None
        for _ in range(3):
            t0 = time.perf_counter()
            mx.eval(a @ b)
            dt = time.perf_counter() - t0
            took = dt if took is None else min(took, dt)
            if time.perf_counter() > deadline:
                break
        assert took is not None
        best = max(best, 2.0 * n**3 / max(took, 1e-9) / 1e9)
        # Small matmuls on a fast GPU measure launch overhead: grow until one takes a few ms.
        if took >= 0.003 or n >= 2048 or time.perf_counter() + 40 * took > deadline:
            break
        n *= 2
    return round(best, 3)
