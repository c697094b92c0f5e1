"""Issue 13 benchmark: several models on one mesh -- what a load on demand costs, and whether one
model's traffic slows another model on other nodes.

Real ``meshnode run`` processes on network-namespace hosts (harness.cluster.Cluster), the client on
a host of its own; two models X and Y of the benchmarks' usual size (benchmarks.common.BENCH_MODEL,
~100M parameters, float32 llama) that differ only in their seed (0 and 1). All figures are MLX on
CPU on this machine (no GPU).

1. On demand: 2 nodes offering both models, each with a budget of 0.75 of one model's total bytes
   (weights and KV for ``--ctx``): either model fits the mesh (split over both nodes,
   MESHNODE_STRATEGY=pipeline), both never do. Requests go X X Y Y X X Y Y ...: the first of each
   pair finds its model on demand (the coordinator unloads the other, idle one, and loads it), the
   second finds it loaded. Time to first token of a streamed chat completion, measured at the
   client; each request is counted by its model's state in /v1/models just before it. Every request
   has a short prompt of its own (~24 tokens: no prompt-cache hit, and little prefill beside the load
   on these slow cores). Prints the medians and their ratio.
2. Isolation: 2 nodes of 1.5 models' bytes each, node 1 offering A (= X), node 2 B (= Y),
   MESHNODE_STRATEGY=single: each model fits one node, both never fit one, so A goes whole on one
   node and B on the other. Each node and the client of its model run on a core of their own (CPU
   affinity): on this 2-core machine that is what keeps the two "machines" apart. A's decode
   tokens/s (tokens after the first over the time after the first token) with B idle, and with B
   streaming to another client at the same time (B's stream started first, 3x as long); median over
   ``--rounds``, which of the two comes first alternating. Target: ratio >= 0.95.

Writes benchmarks/results/models.json. Needs root (network namespaces).

    .venv/bin/python -m benchmarks.models [--rounds 5] [--tokens 64] [--ctx 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import bench_model_dir, param_count, sse_events  # noqa: E402
from harness.cluster import HTTP, Cluster, in_ns  # noqa: E402
from harness.netns import netns_mesh  # noqa: E402

DEVICE = "MLX on CPU on this machine (no GPU)"
TTFT_TOKENS = 8  # part 1: the first token is the figure


def client_stream(url: str, model: str, max_tokens: int, tag: int, core: int = -1, announce: bool = False) -> dict:
    """One streamed greedy chat completion from where this runs (``core`` >= 0: on that core only):
    seconds to the first text, decode tokens/s after it (completion tokens from the usage chunk),
    the tokens and the wall-clock end. ``tag`` makes the (short) prompt its own; ``announce``:
    print "first" once the first text arrived."""
    if core >= 0:
        os.sched_setaffinity(0, {core})
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": f"Request {tag}: write a story about the sea."}],
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0, first, last, count = time.perf_counter(), None, None, 0
    with urllib.request.urlopen(req, timeout=900) as r:
        for event in sse_events(r):
            if event.get("usage"):
                count = event["usage"]["completion_tokens"]
            elif any(c["delta"].get("content") for c in event.get("choices") or ()):
                last = time.perf_counter()
                if first is None:
                    first = last
                    if announce:
                        print("first", flush=True)
    if first is None:
        raise RuntimeError(f"{model}: no text streamed")
    return {
        "ttft": first - t0,
        "tps": (count - 1) / (last - first) if last > first else 0.0,
        "tokens": count,
        "end": time.time(),
    }


# client_stream in the client's namespace; argv: root, url, model, max_tokens, tag, core, announce (0/1)
CLIENT = (
    "import json, sys\nsys.path.insert(0, sys.argv[1])\nfrom benchmarks.models import client_stream\n"
    "print(json.dumps(client_stream(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:8]))))"
)


def client_argv(url: str, model: str, tokens: int, tag: int, core: int, announce: bool) -> list:
    return [ROOT, url, model, tokens, tag, core, int(announce)]


def ask(cluster, url: str, model: str, tokens: int, tag: int, core: int = -1) -> dict:
    return in_ns(cluster.client, CLIENT, *client_argv(url, model, tokens, tag, core, False), timeout=1200)


def total_bytes(path: Path, ctx: int) -> int:
    from meshnode.weights.profile import profile_model

    return profile_model(path).total_bytes(ctx)


def states(cluster, host) -> dict[str, str]:
    return {m["id"]: m["state"] for m in cluster.fetch(f"http://{host.ip}:{HTTP}/v1/models")[2]["data"]}


@contextlib.contextmanager
def on_core(core: int | None):
    """Processes started inside inherit this thread's CPU affinity: ``core`` only (None: unchanged)."""
    old = os.sched_getaffinity(0)
    if core is not None:
        os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


@contextlib.contextmanager
def two_nodes(offers: list[list[Path]], budget: int, ctx: int, env: dict, logs: tuple, cores=(None, None)):
    """A Cluster of 2 nodes and a client host: node i offers ``offers[i]`` (its first as ``--model``),
    runs on ``cores[i]``; node 1 is up (and coordinates) before node 2 starts. ``logs``: (a folder
    or None, a name): where the nodes' logs are copied at the end."""
    with netns_mesh(2) as mesh, tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(mesh, offers[0][0], Path(tmp), max_context=ctx)
        try:
            for h, offered, core in zip(cluster.hosts, offers, cores):
                more = {"MESHNODE_MODELS": ",".join(map(str, offered[1:]))} if offered[1:] else {}
                with on_core(core):
                    cluster.start(h, budget, env={**env, **more}, model=offered[0])
                if h is cluster.hosts[0]:
                    cluster.wait(lambda h=h: cluster.mesh_view(h)["coordinator"], 120, "the first node up")
            yield cluster
        finally:
            if logs[0] is not None:
                logs[0].mkdir(parents=True, exist_ok=True)
                for h in (h for h in cluster.hosts if cluster.log_path(h).exists()):
                    shutil.copy(cluster.log_path(h), logs[0] / f"{logs[1]}-{h.name}.log")


def on_demand(x: Path, y: Path, rounds: int, ctx: int, logs=None) -> dict:
    budget = int(max(total_bytes(x, ctx), total_bytes(y, ctx)) * 0.75)
    with two_nodes([[x, y], [x, y]], budget, ctx, {"MESHNODE_STRATEGY": "pipeline"}, (logs, "demand")) as cluster:
        h1 = cluster.hosts[0]
        url, ids = f"http://{h1.ip}:{HTTP}", {x.name: "X", y.name: "Y"}
        first = cluster.wait(
            lambda: (s := states(cluster, h1)) and sorted(s.values()) == ["on demand", "ready"] and s,
            300,
            "one model ready, the other on demand",
        )
        ready = next(m for m, s in first.items() if s == "ready")
        other = next(m for m in first if m != ready)
        ask(cluster, url, ready, TTFT_TOKENS, 0)  # warm-up: first-use kernel compilation
        samples: dict[str, list[float]] = {"loaded": [], "on demand": []}
        for i, model in enumerate([other, other, ready, ready] * rounds):
            state = states(cluster, h1)[model]
            ttft = ask(cluster, url, model, TTFT_TOKENS, i + 1)["ttft"]
            print(f"  request {i + 1}: {ids[model]} ({state}) TTFT {ttft * 1000:.0f} ms", flush=True)
            if state in ("ready", "on demand"):
                samples["loaded" if state == "ready" else "on demand"].append(ttft)
    return {"budget": budget, "ttft_s": samples}


def beside_b(cluster, a: tuple, b: tuple, tokens: int, tag: int) -> tuple[dict, dict]:
    """A's stream while B streams 3x as many tokens, started first; ``a``, ``b``: (url, model, core)."""
    proc = subprocess.Popen(
        cluster.client.exec_args(
            [sys.executable, "-c", CLIENT, *map(str, client_argv(*b[:2], 3 * tokens, tag, b[2], True))]
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        if proc.stdout.readline().strip() != "first":
            raise RuntimeError(f"B's stream never started: {proc.stderr.read()[-3000:]}")
        got = ask(cluster, *a[:2], tokens, tag, a[2])
        out, err = proc.communicate(timeout=1200)
        if proc.returncode:
            raise RuntimeError(err[-3000:])
        return got, json.loads(out.strip().splitlines()[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def isolation(a: Path, b: Path, rounds: int, tokens: int, ctx: int, logs=None) -> dict:
    budget = int(max(total_bytes(a, ctx), total_bytes(b, ctx)) * 1.5)
    cpus = sorted(os.sched_getaffinity(0))
    cores = (cpus[0], cpus[1 % len(cpus)])
    with two_nodes([[a], [b]], budget, ctx, {"MESHNODE_STRATEGY": "single"}, (logs, "isolation"), cores) as cluster:
        h1 = cluster.hosts[0]
        cluster.wait(lambda: states(cluster, h1) == {a.name: "ready", b.name: "ready"}, 300, "both models ready")
        where = {
            m["model"]: [n for s in m["plan"]["stages"] for n in s["nodes"]] for m in cluster.mesh_view(h1)["models"]
        }
        assert len(where[a.name]) == len(where[b.name]) == 1 and where[a.name] != where[b.name], where
        at = {}
        for model in (a.name, b.name):
            host = cluster.host(where[model][0])
            at[model] = (f"http://{host.ip}:{HTTP}", model, cores[cluster.hosts.index(host)])
        print(
            f"  A whole on {where[a.name][0]} (core {at[a.name][2]}), B whole on {where[b.name][0]} "
            f"(core {at[b.name][2]}); each model's client on its node's core",
            flush=True,
        )
        for i, model in enumerate((a.name, b.name)):
            ask(cluster, *at[model][:2], TTFT_TOKENS, -1 - i, at[model][2])  # warm-up
        idle, busy, b_tps, outlasted = [], [], [], 0
        for r in range(rounds):
            for phase in ("idle", "busy") if r % 2 == 0 else ("busy", "idle"):
                if phase == "idle":
                    idle.append(ask(cluster, *at[a.name][:2], tokens, 2 * r, at[a.name][2])["tps"])
                    print(f"  round {r + 1}: A alone {idle[-1]:.2f} tok/s", flush=True)
                    continue
                got, other = beside_b(cluster, at[a.name], at[b.name], tokens, 2 * r + 1)
                busy.append(got["tps"])
                b_tps.append(other["tps"])
                outlasted += other["end"] > got["end"]
                print(
                    f"  round {r + 1}: A beside B {busy[-1]:.2f} tok/s ({got['tokens']} tokens; B "
                    f"{other['tps']:.2f} tok/s, {other['tokens']} tokens)",
                    flush=True,
                )
    return {
        "budget": budget,
        "cores": list(cores),
        "placement": where,
        "a_idle_tps": idle,
        "a_busy_tps": busy,
        "b_tps": b_tps,
        "b_outlasted_a": outlasted,
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="on demand: X X Y Y per round; isolation: A alone and A beside B per round",
    )
    ap.add_argument("--tokens", type=int, default=64, help="A's decode length in the isolation part")
    ap.add_argument("--ctx", type=int, default=1024, help="the nodes' --max-context (budgets count its KV)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "models.json")
    ap.add_argument("--logs", type=Path, help="copy the nodes' logs into this folder")
    args = ap.parse_args()
    x, y = bench_model_dir(args.cache), bench_model_dir(args.cache, seed=1)
    print(
        f"{DEVICE}, {os.cpu_count()} cores; models X {x.name} and Y {y.name} ({param_count(x) / 1e6:.0f}M "
        f"parameters each, float32 llama, seeds 0 and 1); context {args.ctx}",
        flush=True,
    )
    t0 = time.monotonic()
    print("1. on-demand load: 2 nodes, either model fits the mesh, never both", flush=True)
    demand = on_demand(x, y, args.rounds, args.ctx, args.logs)
    loaded, cold = median(demand["ttft_s"]["loaded"]), median(demand["ttft_s"]["on demand"])
    print(
        "2. isolation: A (X) on one node, B (Y) on the other; each node and its client pinned to a core of "
        "its own (pinning is what keeps two 'machines' apart on this 2-core box)",
        flush=True,
    )
    iso = isolation(x, y, args.rounds, args.tokens, args.ctx, args.logs)
    alone, beside = median(iso["a_idle_tps"]), median(iso["a_busy_tps"])
    lines = [
        f"TTFT loaded    (median of {len(demand['ttft_s']['loaded'])}): {loaded * 1000:.0f} ms",
        f"TTFT on demand (median of {len(demand['ttft_s']['on demand'])}): {cold * 1000:.0f} ms "
        f"(the load and an eviction included): {cold / loaded:.1f}x loaded; {args.rounds} round(s) of X X Y Y",
        f"A decode with B idle      (median of {len(iso['a_idle_tps'])}): {alone:.2f} tok/s",
        f"A decode with B streaming (median of {len(iso['a_busy_tps'])}): {beside:.2f} tok/s; ratio "
        f"{beside / alone:.3f} (target >= 0.95: {'met' if beside / alone >= 0.95 else 'NOT met'}); B outlasted "
        f"A in {iso['b_outlasted_a']} of {len(iso['a_busy_tps'])} rounds",
    ]
    print(f"\nsummary ({DEVICE}; {time.monotonic() - t0:.0f} s):\n  " + "\n  ".join(lines))
    result = {
        "device": DEVICE,
        "models": {"X": x.name, "Y": y.name},
        "rounds": args.rounds,
        "tokens": args.tokens,
        "ctx": args.ctx,
        "on_demand": {**demand, "median_loaded_s": loaded, "median_on_demand_s": cold, "ratio": cold / loaded},
        "isolation": {**iso, "median_idle_tps": alone, "median_busy_tps": beside, "ratio": beside / alone},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
