"""What OpenBLAS under MLX's CPU matmuls gives on Linux (meshnode.blas), against MLX's own reference BLAS.

    .venv/bin/python -m benchmarks.blas [--tokens 48] [--rounds 2] [--cores one|all] [--dtype float32]

Each round runs, in turns, a fresh process with ``MESHNODE_BLAS=reference`` and one with
``MESHNODE_BLAS=auto`` (OpenBLAS), each pinned to one core (``--cores all``: every core), on the
bench llama (101M parameters, float32; ``--dtype bfloat16`` shows that other dtypes do not go
through BLAS). Each process measures with mlx-lm alone: the prefill of the benchmarks' prompt
(113 tokens), decode tokens/s (``stream_generate``), and four identical requests in one
``BatchGenerator`` against one (aggregate tokens/s). Prints a line per figure with both libraries
and their ratio, medians of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURE = r"""
import json, sys, time
import meshnode
from meshnode import blas
from mlx_lm import load, stream_generate
from mlx_lm.generate import BatchGenerator
model, tokenizer = load(sys.argv[1])
tokens = int(sys.argv[2])
prompt = tokenizer.apply_chat_template([{"role": "user", "content": sys.argv[3]}], add_generation_prompt=True)
for _ in range(2):  # the second run is timed: the first compiles what MLX compiles
    t0 = time.perf_counter(); n = 0
    for r in stream_generate(model, tokenizer, prompt, max_tokens=tokens):
        if n == 0:
            first = time.perf_counter()
        n += 1
    end = time.perf_counter()
out = {"blas": blas.in_use(), "prompt": len(prompt), "prefill_s": first - t0, "decode": (n - 1) / (end - first)}
for size in (1, 4):
    gen = BatchGenerator(model, max_tokens=tokens)
    gen.insert([prompt] * size)
    count, start = 0, None
    while True:
        step = gen.next()
        done = step[1] if isinstance(step, tuple) else step
        if not done:
            if start is not None:
                break
            continue
        if start is None:  # from the first token of all: prefill not counted
            start = time.perf_counter()
            continue
        count += len(done)
        if all(r.finish_reason for r in done):
            break
    out[f"batch{size}"] = count / (time.perf_counter() - start)
print(json.dumps(out))
"""


def measure(setting: str, model: Path, tokens: int, pin: bool) -> dict:
    env = {**os.environ, "MESHNODE_BLAS": setting, "PYTHONPATH": str(ROOT)}
    env.pop("OPENBLAS_NUM_THREADS", None)
    core = sorted(os.sched_getaffinity(0))[0]
    cmd = (["taskset", "-c", str(core)] if pin else []) + [
        sys.executable,
        "-c",
        MEASURE,
        str(model),
        str(tokens),
        "Write a long story about a lighthouse keeper and the sea. " * 4,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cores", choices=("one", "all"), default="one")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import bench_model_dir

    model = bench_model_dir(args.cache, **({"dtype": args.dtype} if args.dtype != "float32" else {}))
    import platform
    import time

    print(
        f"# {platform.platform()} ({os.cpu_count()} CPUs), {model.name} ({args.dtype}), {args.tokens} tokens, "
        f"{args.rounds} rounds, {'one core' if args.cores == 'one' else 'every core'}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {"reference": [], "auto": []}
    for r in range(args.rounds):
        for setting in runs:
            runs[setting].append(measure(setting, model, args.tokens, args.cores == "one"))
        print(
            f"round {r + 1}: "
            + "; ".join(
                f"{runs[s][-1]['blas']}: prefill {runs[s][-1]['prefill_s']:.2f} s, "
                f"decode {runs[s][-1]['decode']:.1f} tok/s, 4 batched "
                f"{runs[s][-1]['batch4'] / runs[s][-1]['batch1']:.2f}x one"
                for s in runs
            ),
            flush=True,
        )
    if not runs["auto"][0]["blas"].startswith("OpenBLAS"):
        print("no OpenBLAS here (apt-get install libopenblas0-pthread): both columns are MLX's own BLAS")

    def med(setting: str, key) -> float:
        return statistics.median(key(x) for x in runs[setting])

    rows = [
        (f"prefill of {runs['auto'][0]['prompt']} tokens, s", lambda x: x["prefill_s"]),
        ("decode tok/s", lambda x: x["decode"]),
        ("one request in BatchGenerator, tok/s", lambda x: x["batch1"]),
        ("four requests batched, aggregate tok/s", lambda x: x["batch4"]),
        ("four batched / one", lambda x: x["batch4"] / x["batch1"]),
    ]
    print(f"\n| figure | {runs['reference'][0]['blas']} | {runs['auto'][0]['blas']} | ratio |\n|---|---|---|---|")
    for name, key in rows:
        ref, auto = med("reference", key), med("auto", key)
        print(f"| {name} | {ref:.2f} | {auto:.2f} | {auto / ref:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
