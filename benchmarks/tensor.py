"""Issue 4 benchmark: single vs pipeline vs tensor on two namespace hosts, at injected link
latencies, and meshnode's tensor group against mlx-lm's own sharded generate on the same hosts.

Same ~100M-parameter float32 model and prompt as benchmarks/pipeline.py, same run. For each
injected latency (added to every Forward reply, link probe and echo, and to every collective of a
tensor group: what a link with that much more round-trip time would cost; ``tc netem`` is missing
here), two `meshnode run` processes on two hosts are started with each strategy forced, and a
client namespace streams from the head. Prints, per latency: decode tokens/s of each strategy,
the planner's estimate for each, and what the planner picks on its own (``auto``) from the
figures it measured. Every node starts with the compute figures this machine measured once,
quietly, before the runs (as an installed node has them cached), rather than timing its layers
while the other host does the same on this 2-core machine. Then mlx-lm's sharded model
(``model.shard()`` over an ``mx.distributed`` ring between the same two hosts, ``stream_generate``
on both ranks) against meshnode's tensor pair at no injected latency (target: within 1.2x). Needs
root (network namespaces).

    sudo .venv/bin/python benchmarks/tensor.py [--tokens 64] [--latencies 0,50,300]

``--json PATH`` writes the figures for benchmarks/suite.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import BENCH_MODEL, bench_model_dir, param_count  # noqa: E402
from harness.cluster import in_ns, node_argv, wait_mesh  # noqa: E402
from harness.netns import netns_mesh  # noqa: E402
from meshnode.weights.profile import profile_model  # noqa: E402

HTTP, GRPC, RING = 8470, 8471, 9300
CTX = 1024
PROBE_INTERVAL = 3  # seconds: the coordinator re-weighs its plan this often here
STRATEGIES = ("single", "pipeline", "tensor")


def wait_plan(client, url: str, strategy: str | None, timeout: float = 240) -> dict:
    """/v1/mesh once the mesh is healthy with both nodes, links measured and (if given) the strategy."""

    def ok(v: dict) -> bool:
        return (
            v["healthy"]
            and len(v["nodes"]) == 2
            and all(n["links"] for n in v["nodes"])
            and (strategy is None or v["plan"]["strategy"] == strategy)
        )

    return wait_mesh(
        url,
        ok,
        client=client,
        timeout=timeout,
        interval=0.3,
        what=f"a healthy 2-node mesh, links measured, strategy {strategy or 'any'}",
    )


def stream_tps(client, url: str, model_id: str, tokens: int, repeats: int = 3) -> float:
    return in_ns(
        client,
        f"import sys,json; sys.path.insert(0,{str(ROOT)!r})\n"
        "from benchmarks.common import http_decode_tps\n"
        f"tps,n=http_decode_tps({url!r}, {model_id!r}, {tokens}, {repeats})\n"
        "print(json.dumps({'tps':tps,'n':n}))",
    )["tps"]


def measure_compute(host, path: Path, seed: Path) -> dict:
    """This machine's layer and two-way split timings, measured in alternation with nothing else
    running (best of three each), into ``seed/compute.json`` (what a node caches in its state folder)."""
    seed.mkdir(exist_ok=True)
    return in_ns(
        host,
        f"import sys,json; sys.path.insert(0,{str(ROOT)!r})\n"
        "from pathlib import Path\n"
        "from meshnode.model.compute import seed_figures, collective_overhead\n"
        "from meshnode.weights.profile import profile_model\n"
        f"p=Path({str(path)!r}); prof=profile_model(p)\n"
        f"one, two = seed_figures(p, prof.num_layers, Path({str(seed)!r}), max(prof.layer_bytes))\n"
        "print(json.dumps({'layer_s': one, 'split_s': two, 'collective_s': collective_overhead(one, two)}))",
    )


def run_mesh(
    mesh, path: Path, tmp: Path, strategy: str, inject_us: float, budget: int, tokens: int, seed: Path | None = None
) -> dict:
    a, b, client = mesh.hosts
    procs = []
    for h in (a, b):
        state = tmp / f"{strategy}-{int(inject_us)}-{h.name}"
        state.mkdir()
        if seed is not None:
            shutil.copy(seed / "compute.json", state / "compute.json")
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MESHNODE_STRATEGY": strategy,
            "MESHNODE_INJECT_LATENCY_US": str(inject_us),
            "MESHNODE_LINK_PROBE_INTERVAL": str(PROBE_INTERVAL),
            "MESHNODE_REBALANCE_DWELL": "1",
        }
        procs.append(
            h.popen(
                node_argv(
                    path,
                    http_port=HTTP,
                    grpc_port=GRPC,
                    node_id=h.name,
                    budget=budget,
                    state_dir=state,
                    max_context=CTX,
                    kv_requests=1,
                ),
                env=env,
                log_path=state / "node.log",
            )
        )
    try:
        view = wait_plan(client, f"http://{a.ip}:{HTTP}", None if strategy == "auto" else strategy)
        if strategy == "auto":  # the first plan predates the link figures: let the coordinator re-weigh
            time.sleep(4 * PROBE_INTERVAL)
            view = wait_plan(client, f"http://{a.ip}:{HTTP}", None)
        head = view["plan"]["stages"][-1]["nodes"][0]
        url = f"http://{(a if head == a.name else b).ip}:{HTTP}"
        stream_tps(client, url, path.name, 8, 1)  # warm-up: kernels compiled on every host
        tps = stream_tps(client, url, path.name, tokens) if strategy != "auto" else None
        if strategy != "auto":  # links measured by now: the plan's estimate by today's figures
            view = wait_plan(client, f"http://{a.ip}:{HTTP}", strategy)
        return {"tps": tps, "view": view}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


SHARDED = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm import load, stream_generate
sys.path.insert(0, {root!r})
from benchmarks.common import PROMPT
group = mx.distributed.init(backend="ring", strict=True)
model, tok = load({path!r})
model.shard(group)
mx.eval(model.parameters())
prompt = tok.apply_chat_template([{{"role": "user", "content": PROMPT}}], add_generation_prompt=True)
best = 0.0
for _ in range(3):
    times = [time.perf_counter() for _ in stream_generate(model, tok, prompt, max_tokens={tokens})]
    best = max(best, (len(times) - 1) / (times[-1] - times[0]))
if group.rank() == 0:
    print(json.dumps({{"tps": best}}))
"""


def mlx_lm_sharded_tps(mesh, path: Path, tmp: Path, tokens: int, port: int = RING) -> float:
    """mlx-lm's own tensor parallelism: both ranks generate over a ring between the two hosts."""
    a, b, _ = mesh.hosts
    hostfile = tmp / "ring.json"
    hostfile.write_text(json.dumps([[f"{a.ip}:{port}"], [f"{b.ip}:{port}"]]))
    code = SHARDED.format(root=str(ROOT), path=str(path), tokens=tokens)
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
    follower = b.popen([sys.executable, "-c", code], env={**env, "MLX_RANK": "1"}, log_path=tmp / "rank1.log")
    try:
        return in_ns(a, code, env={**env, "MLX_RANK": "0"}, timeout=600)["tps"]
    finally:
        follower.wait(60)


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    ap.add_argument("--latencies", default="0,50,300", help="injected µs per round trip, comma-separated")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    path = bench_model_dir(args.cache)
    profile = profile_model(path)
    budget = int(profile.total_bytes(CTX) * 1.5)  # either host holds it: every strategy is possible
    print(
        f"model: {path.name}, {param_count(path) / 1e6:.0f}M parameters, float32, "
        f"hidden {BENCH_MODEL['hidden_size']}, {BENCH_MODEL['num_layers']} layers"
    )
    latencies = [float(x) for x in args.latencies.split(",")]
    rows = []
    with netns_mesh(3) as mesh, tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        seed = tmp / "compute"
        compute = measure_compute(mesh.hosts[0], path, seed)
        print(
            f"compute here: one layer {compute['layer_s'] * 1e3:.2f} ms, split two ways "
            f"{compute['split_s'] * 1e3:.2f} ms, each all-reduce adds {compute['collective_s'] * 1e6:.0f} µs",
            flush=True,
        )
        sharded = mlx_lm_sharded_tps(mesh, path, tmp, args.tokens)
        for inject in latencies:
            row = {"inject_us": inject}
            for strategy in (*STRATEGIES, "auto"):
                out = run_mesh(mesh, path, tmp, strategy, inject, budget, args.tokens, seed)
                plan = out["view"]["plan"]
                plan["tokens_per_s"] = plan.get("tokens_per_s_now") or plan["tokens_per_s"]
                if strategy == "auto":
                    row["planner_pick"] = plan["strategy"]
                    row["planner_reason"] = plan["reason"]
                else:
                    row[strategy] = out["tps"]
                    row[f"{strategy}_estimate"] = plan["tokens_per_s"]
                print(
                    f"  {inject:>5.0f} µs {strategy:<8} {out['tps'] or 0:8.2f} tok/s  "
                    f"(planner est. {plan['tokens_per_s'] or 0:.1f} tok/s as {plan['strategy']})",
                    flush=True,
                )
            row["measured_best"] = max(STRATEGIES, key=lambda s: row[s])
            rows.append(row)
        sharded = max(
            sharded, mlx_lm_sharded_tps(mesh, path, tmp, args.tokens, RING + 10)
        )  # again, at the end: best of two
    print()
    print(
        "| injected latency (µs per round trip) | single tok/s | pipeline tok/s | tensor tok/s "
        "| fastest measured | planner's pick |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['inject_us']:.0f} | {r['single']:.2f} | {r['pipeline']:.2f} | {r['tensor']:.2f} "
            f"| {r['measured_best']} | {r['planner_pick']} |"
        )
    tensor0 = next((r["tensor"] for r in rows if r["inject_us"] == 0), None)
    print(f"\nmlx-lm sharded generate (ring, same 2 hosts): {sharded:.2f} tok/s")
    if tensor0:
        print(
            f"meshnode tensor pair at 0 µs: {tensor0:.2f} tok/s; mlx-lm / meshnode = {sharded / tensor0:.3f} "
            f"(target <= 1.2)"
        )
    figures = {
        "compute": compute,
        "rows": rows,
        "mlx_lm_sharded_tps": sharded,
        "tensor_tps": tensor0,
        "sharded_over_tensor": sharded / tensor0 if tensor0 else None,
    }
    print(json.dumps(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
