"""How fast this machine runs the served model: seconds for one decode step of one layer, cached per
model, machine, MLX version and BLAS. On the CPU a step counts the smaller of wall and CPU time, so
a descheduled moment does not make the node look slow for good."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from meshnode import blas
from meshnode.model.lifeline import child_env
from meshnode.model.shard import Shard
from meshnode.weights.splits import split_boundaries, split_support

log = logging.getLogger(__name__)

CONTEXT = 64  # tokens in the cache while timing, like an early decode step
STEPS = 12
LAYERS = 4  # at most this many layers timed together...
WORKING_SET = 256 * 2**20  # ...enough that their weights do not fit in a CPU cache
VERSION = "layers4-cpu-time"  # in the cache key: a change of method measures again
CACHE_FILE = "compute.json"  # in the node's state folder


def _cache_key(model_path: Path) -> str:
    config = (model_path / "config.json").read_bytes()
    ident = [
        hashlib.sha256(config).hexdigest(),
        platform.machine(),
        platform.system(),
        mx.__version__,  # type: ignore[attr-defined]  # mlx's stubs omit it
        str(mx.default_device()),
        blas.in_use(),
        VERSION,
    ]
    return hashlib.sha256("|".join(ident).encode()).hexdigest()[:24]


def _split_key(model_path: Path) -> str:
    """The cache key of the two-way split figure."""
    return _cache_key(model_path) + "-tp2"


def measure_layer_seconds(model_path: Path, num_layers: int, layer_bytes: int = 0) -> float:
    """Time decode steps through a few layers, per layer (run on the MLX thread)."""
    start, count = _layer_range(num_layers, layer_bytes)
    config = json.loads((Path(model_path) / "config.json").read_text())
    allowed = set(split_boundaries(config)) | {0, num_layers}
    if split_support(config) or start not in allowed or start + count not in allowed:
        start, count = 0, num_layers  # a model that cannot be cut there: time it whole, per layer
    shard = Shard(model_path, start, start + count)
    return _time_steps(shard, shard.make_cache()) / count


def layer_seconds(model_path: Path, num_layers: int, state_dir: Path, layer_bytes: int = 0) -> float:
    """The cached figure for this model on this machine, measuring it the first time."""
    return _cached(
        state_dir,
        _cache_key(model_path),
        lambda: measure_layer_seconds(model_path, num_layers, layer_bytes),
        f"one layer of {model_path.name} decodes in %.3f ms here",
    )


def _cached(state_dir: Path, key: str, measure: Callable[[], float], what: str) -> float:
    """``known[key]`` from compute.json, else ``measure()``, cached when > 0 and logged as ``what``."""
    cache_file = state_dir / CACHE_FILE
    known = _load(cache_file)
    value = known.get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    t0 = time.monotonic()
    value = measure()
    if value <= 0:
        return 0.0
    log.info("compute: " + what + " (measured in %.1f s)", value * 1e3, time.monotonic() - t0)
    known[key] = value
    _save(cache_file, known)
    return value


def _load(cache_file: Path) -> dict[str, object]:
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _save(cache_file: Path, known: dict[str, object]) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache_file)
    except OSError as exc:
        log.warning("could not cache the compute figure in %s: %s", cache_file, exc)


# --------------------------------------------------------------------------- tensor groups


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _layer_range(num_layers: int, layer_bytes: int) -> tuple[int, int]:
    start = 1 if num_layers > 1 else 0  # from layer 1, no embedding is read from disk
    wanted = -(-WORKING_SET // layer_bytes) if layer_bytes > 0 else LAYERS
    return start, max(1, min(LAYERS, wanted, num_layers - start))


def _time_steps(shard: Shard, cache: list[Any], own_work: bool = True) -> float:
    """Median seconds of a single-token step through ``shard``. ``own_work`` False: waiting counts
    (a ring's all-reduces)."""
    step: Callable[[], mx.array]
    if shard.spec.is_first:
        step = lambda: shard.forward(mx.zeros((1, 1), dtype=mx.int32), cache)  # noqa: E731
        mx.eval(shard.forward(mx.zeros((1, CONTEXT), dtype=mx.int32), cache))
    else:
        step = lambda: shard.forward(mx.zeros((1, 1, shard.hidden_size), dtype=shard.dtype), cache)  # noqa: E731
        mx.eval(shard.forward(mx.zeros((1, CONTEXT, shard.hidden_size), dtype=shard.dtype), cache))
    on_cpu = own_work and mx.default_device().type == mx.DeviceType.cpu
    times = []
    for _ in range(STEPS):
        t0, c0 = time.perf_counter(), time.process_time()
        mx.eval(step())
        times.append(step_seconds(time.perf_counter() - t0, time.process_time() - c0, on_cpu))
    return statistics.median(times[2:])


def step_seconds(wall: float, cpu: float, on_cpu: bool) -> float:
    """A step's cost: on MLX's CPU backend the smaller of wall and CPU time, elsewhere wall time."""
    return min(wall, cpu) if on_cpu and cpu > 0 else wall


def measure_tensor_layer_seconds(
    model_path: Path,
    num_layers: int,
    layer_bytes: int = 0,
    timeout: float = 120.0,
    tries: int = 2,
    cancel: threading.Event | None = None,
) -> float:
    """Seconds of one layer's decode step split two ways by mlx-lm's ``shard()`` over a loopback
    ring, all-reduces included; best of ``tries`` rounds, timed in one pair of ring processes (each
    pays the imports and the load once), which are started again only when a probe fails.
    Blocking; 0.0 when unmeasurable or cancelled."""
    for _ in range(tries):
        if cancel is not None and cancel.is_set():
            break
        seconds = _ring_probe(model_path, num_layers, layer_bytes, timeout, cancel, rounds=tries)
        if seconds > 0:
            return seconds
    return 0.0


def _ring_probe(
    model_path: Path,
    num_layers: int,
    layer_bytes: int,
    timeout: float,
    cancel: threading.Event | None = None,
    rounds: int = 1,
) -> float:
    import subprocess
    import sys
    import tempfile

    start, count = _layer_range(num_layers, layer_bytes)
    with tempfile.TemporaryDirectory(prefix="meshnode-tensor-probe-") as tmp:
        hostfile = Path(tmp) / "ring.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
        cmd = [
            sys.executable,
            "-m",
            "meshnode.model.compute",
            "--tensor-layers",
            str(model_path),
            str(start),
            str(count),
            str(rounds),
        ]
        procs = [
            subprocess.Popen(
                cmd,
                env=child_env(
                    {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), **_half_the_threads()}
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for rank in (1, 0)
        ]
        try:
            end = time.monotonic() + timeout
            while procs[1].poll() is None:  # rank 0 prints the figure and exits
                if (cancel is not None and cancel.is_set()) or time.monotonic() > end:
                    return 0.0
                time.sleep(0.1)
            assert procs[1].stdout is not None, "rank 1 runs with stdout=PIPE"
            out = procs[1].stdout.read()
            procs[0].wait(timeout=10)
            return float(out.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            return 0.0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def _half_the_threads() -> dict[str, str]:
    """Half the node's OpenBLAS threads per ring process: waiting threads spin, and oversubscribed
    cores slow the ring."""
    threads = os.environ.get(blas.THREADS_ENV)
    return {blas.THREADS_ENV: str(max(1, int(threads) // 2))} if threads and threads.isdigit() else {}


def tensor_layer_seconds(
    model_path: Path, num_layers: int, state_dir: Path, layer_bytes: int = 0, cancel: threading.Event | None = None
) -> float:
    """The cached two-way tensor-parallel figure (0.0: unmeasurable, or cancelled)."""
    value = _cached(
        state_dir,
        _split_key(model_path),
        lambda: measure_tensor_layer_seconds(model_path, num_layers, layer_bytes, cancel=cancel),
        f"one layer of {model_path.name} split two ways decodes in %.3f ms here, all-reduces included",
    )
    if value <= 0:
        log.warning("compute: could not time a layer split over a ring here; the planner assumes a default")
    return value


def seed_figures(
    model_path: Path, num_layers: int, state_dir: Path, layer_bytes: int = 0, rounds: int = 3, tensor: bool = True
) -> tuple[float, float]:
    """Measure and cache both figures afresh, alternating so a burst of load skews neither.
    Returns (layer seconds, split layer seconds or 0.0)."""
    one, two = [], []
    for _ in range(rounds):
        one.append(measure_layer_seconds(model_path, num_layers, layer_bytes))
        if tensor:
            two.append(measure_tensor_layer_seconds(model_path, num_layers, layer_bytes, tries=1))
    layer_s = min(one)
    split_s = min((t for t in two if t > 0), default=0.0)
    known = _load(state_dir / CACHE_FILE)
    known[_cache_key(model_path)] = layer_s
    if split_s > 0:
        known[_split_key(model_path)] = split_s
    _save(state_dir / CACHE_FILE, known)
    return layer_s, split_s


def collective_overhead(layer_s: float, tensor_layer_s: float) -> float:
    """C, what each all-reduce adds: a split layer takes layer / 2 + 2 C. 0.0 when either is unknown."""
    if layer_s <= 0 or tensor_layer_s <= 0:
        return 0.0
    return max((tensor_layer_s - layer_s / 2) / 2, 1e-6)


def _tensor_layers_main(model_path: str, start: int, count: int, rounds: int) -> None:
    group = mx.distributed.init(backend="ring", strict=True)
    shard = Shard(Path(model_path), start, start + count, group=group)
    # each round on a fresh cache: the best of them, so a burst of load on the machine skews none
    seconds = min(_time_steps(shard, shard.make_cache(), own_work=False) for _ in range(rounds)) / count
    if group.rank() == 0:
        print(seconds, flush=True)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 6 and sys.argv[1] == "--tensor-layers":
        from meshnode.model.lifeline import die_with_parent

        die_with_parent()  # a node killed mid-measurement leaves no ring spinning
        _tensor_layers_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
