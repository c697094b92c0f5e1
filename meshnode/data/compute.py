"""How fast this machine runs the served model: seconds for one decode step of one layer.

The planner weighs compute against links, so it needs this figure for the model actually
served, not a generic FLOP count. One layer of the model is loaded on its own (the shard
machinery reads only that layer's tensors), a short context is prefilled, then a few
single-token steps are timed; the median is kept. The result is cached per model, machine and
MLX version in the node's state folder, so a restart costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from meshnode.data.shard import Shard

log = logging.getLogger(__name__)

CONTEXT = 64  # tokens in the cache while timing, like an early decode step
STEPS = 12


def _cache_key(model_path: Path) -> str:
    config = (model_path / "config.json").read_bytes()
    ident = [hashlib.sha256(config).hexdigest(), platform.machine(), platform.system(), mx.__version__,
             str(mx.default_device())]
    return hashlib.sha256("|".join(ident).encode()).hexdigest()[:24]


def measure_layer_seconds(model_path: Path, num_layers: int) -> float:
    """Time decode steps through one layer (run on the MLX thread)."""
    start = 1 if num_layers > 1 else 0  # layer 1 alone reads no embedding from disk
    shard = Shard(model_path, start, start + 1)
    cache = shard.make_cache()
    if shard.spec.is_first:
        step = lambda: shard.forward(mx.zeros((1, 1), dtype=mx.int32), cache)  # noqa: E731
        mx.eval(shard.forward(mx.zeros((1, CONTEXT), dtype=mx.int32), cache))
    else:
        step = lambda: shard.forward(mx.zeros((1, 1, shard.hidden_size), dtype=shard.dtype), cache)  # noqa: E731
        mx.eval(shard.forward(mx.zeros((1, CONTEXT, shard.hidden_size), dtype=shard.dtype), cache))
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        mx.eval(step())
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def layer_seconds(model_path: Path, num_layers: int, state_dir: Path) -> float:
    """The cached figure for this model on this machine, measuring it the first time."""
    cache_file = state_dir / "compute.json"
    key = _cache_key(model_path)
    try:
        known = json.loads(cache_file.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    value = known.get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    t0 = time.monotonic()
    value = measure_layer_seconds(model_path, num_layers)
    log.info("compute: one layer of %s decodes in %.3f ms here (measured in %.1f s)", model_path.name,
             value * 1e3, time.monotonic() - t0)
    known[key] = value
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache_file)
    except OSError as exc:
        log.warning("could not cache the compute figure in %s: %s", cache_file, exc)
    return value
