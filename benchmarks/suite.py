"""Every speed figure of meshnode in one run, each against single-process mlx-lm on the same model.

    sudo .venv/bin/python -m benchmarks.suite [--tokens 64] [--skip failover,tensor] [--out benchmarks/results]

Decode figures use the ~100M-parameter float32 llama of the other benchmarks (hidden 768, 16
layers, built locally and cached): its compute per token dominates a hop's cost, as a real
model's does on a Mac, so what pipelining saves or costs is visible. Prefill figures (TTFT)
use the smaller llama of benchmarks/failover.py (hidden 256, 8 layers): MLX's CPU build multiplies
matrices with a reference BLAS on one core, so a 1,024-token prefill of the 100M model takes
minutes, while this one's takes seconds in mlx-lm, compute still dominating. Real `meshnode run`
processes on network-namespace hosts of this machine, a client in its own namespace; mlx-lm runs
in this process. Figures:

- decode tokens/s of 1-, 2- and 3-stage pipelines / mlx-lm's (stream_generate): five rounds, each
  a generation of mlx-lm then one of the mesh, the ratio the median of the rounds' ratios (this
  machine's speed drifts over minutes);
- at 2 stages, each round also times the bare split of benchmarks/floor.py (mlx-lm's modules for
  the two halves in two processes, a loopback socket between, nothing else): the floor any split
  reaches here, and the mesh's ratio to it; and one hop between two bare processes right after
  45 ms of compute each (benchmarks/floor.py), the floor of a hop whose ends compute on these CPUs;
- added latency per hop, all in: (time per token - mlx-lm's) / hops (the head sends each token to
  the first stage and every activation comes back to it: 2 hops per remote stage); and the
  transport's part of it, as the head times every decode hop (round trip minus the stage's own
  reported time, halved: meshnode_hop_transport_seconds), next to the network's floor (half a bare
  TCP echo round trip between the same hosts);
- bytes on the wire per decoded token per hop (veth counters, idle traffic subtracted; the
  difference between a long and a short generation, so the prompt is not counted);
- time to first token for 128- and 1,024-token prompts on 2 stages, pipelined prefill on and off;
- aggregate tokens/s of 1, 2 and 4 concurrent streams on 2 stages;
- failover stall (benchmarks/failover.py) and tensor vs pipeline at injected latencies
  (benchmarks/tensor.py), run as they are and their JSON taken in.

Writes ``suite.json`` and ``suite.md`` (the table docs/benchmarks.md shows) into ``--out``. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import BENCH_MODEL, PROMPT, bench_model_dir, mlx_lm_decoder, param_count  # noqa: E402
from benchmarks.failover import MODEL as PREFILL_MODEL  # noqa: E402
from benchmarks.floor import Split, hop_after_compute_us  # noqa: E402
from benchmarks.floor import tps as tps_of  # noqa: E402
from benchmarks.pipeline import counters  # noqa: E402
from benchmarks.tensor import measure_compute  # noqa: E402
from harness.cluster import in_ns, node_argv, wait_mesh  # noqa: E402
from harness.netns import netns_mesh  # noqa: E402
from meshnode.config import ECHO_OFFSET  # noqa: E402
from meshnode.model.build import model_dir_for  # noqa: E402
from meshnode.weights.profile import profile_model  # noqa: E402

HTTP, GRPC = 8470, 8471
CTX = 2048
TTFT_PROMPTS = (128, 1024)
STREAMS = (1, 2, 4)
ROUNDS = 5  # decode measurements of the mesh, each right after one of mlx-lm
QUANTIZED = dict(dtype="bfloat16", quantize="4bit", group_size=64)  # the 4-bit rows' model: BENCH_MODEL so made
# The 4-bit rows' prompt: MLX's CPU build prefills 4-bit weights so slowly that the long PROMPT would
# take minutes a request; decode speed does not depend on it.
SHORT_PROMPT = "Write a story about the sea."
TARGETS = {"decode_ratio_2": 0.95, "added_us_per_hop": 150, "ttft_1024_ratio": 0.6, "aggregate_2_over_1": 1.6}


# --------------------------------------------------------------------- run in the client namespace


def client_ttft(url: str, model_id: str, ids: list[int], repeats: int) -> float:
    """Seconds from sending a completion of ``ids`` to having its first token (best of ``repeats``)."""
    import urllib.request

    body = json.dumps({"model": model_id, "prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
        best = min(best, time.perf_counter() - t0)
    return best


def client_stream(url: str, model_id: str, ids: list[int], tokens: int) -> dict:
    """One streamed completion of ``ids``: the time of every text event, and the tokens generated."""
    import urllib.request

    from benchmarks.common import sse_events

    body = json.dumps(
        {
            "model": model_id,
            "prompt": ids,
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    times, count = [], 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for event in sse_events(r):
            if event.get("usage"):
                count = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0].get("text"):
                times.append(time.perf_counter())
    return {"times": times, "tokens": count}


def client_aggregate(url: str, model_id: str, streams: int, tokens: int) -> dict:
    """``streams`` completions at once (short prompts, each its own): tokens/s of all together while
    all of them decode, i.e. from the moment the last one started streaming to the moment the first
    one finished; text events are scaled to tokens by each stream's usage count."""
    import threading

    out: list[dict] = [{}] * streams

    def one(i: int) -> None:
        out[i] = client_stream(url, model_id, [11 + i, 12, 13, 14, 15, 16, 17, 18], tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(o["times"][0] for o in out)
    end = min(o["times"][-1] for o in out)
    in_window = sum(sum(start < t <= end for t in o["times"]) * o["tokens"] / len(o["times"]) for o in out)
    return {
        "aggregate_tps": in_window / (end - start),
        "window_s": end - start,
        "tokens": sum(o["tokens"] for o in out),
        "per_stream_tps": [(len(o["times"]) - 1) / (o["times"][-1] - o["times"][0]) for o in out],
    }


def _client(client, fn: str, *args) -> dict:
    code = (
        f"import sys,json; sys.path.insert(0,{str(ROOT)!r})\n"
        f"from benchmarks.suite import {fn}\n"
        f"print(json.dumps({fn}(*json.loads(sys.argv[1]))))"
    )
    return in_ns(client, code, json.dumps(args), timeout=1200)


# --------------------------------------------------------------------- a mesh of real nodes


class Nodes:
    """``meshnode run`` on the first ``n`` hosts, each offered ``fraction`` of the model, until stopped."""

    def __init__(self, mesh, path: Path, tmp: Path, n: int, fraction: float, env: dict | None = None):
        self.mesh, self.path = mesh, path
        self.hosts, self.client = mesh.hosts[:n], mesh.hosts[-1]
        budget = int(profile_model(path).total_bytes(CTX) * fraction)
        self.procs = []
        for h in self.hosts:
            state = tmp / f"{h.name}-{n}-{time.monotonic_ns()}"
            state.mkdir()
            # Compute figures measured once, before any node ran (main): a node that measures them
            # itself runs its timing subprocesses for a while after it is up, inside the timed window.
            shutil.copy(tmp / "seed" / "compute.json", state / "compute.json")
            self.procs.append(
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
                    # Links are measured once, at the start: a later bandwidth probe (1 MiB each way) would
                    # land in the byte counts of the traffic figure.
                    env={
                        **os.environ,
                        "PYTHONPATH": str(ROOT),
                        "MESHNODE_CLUSTER_KEY": "bench",
                        "MESHNODE_STRATEGY": "pipeline" if n > 1 else "single",
                        "MESHNODE_LINK_PROBE_INTERVAL": "3600",
                        **(env or {}),
                    },
                    log_path=state / "node.log",
                )
            )
        self.view = wait_mesh(
            f"http://{self.hosts[0].ip}:{HTTP}",
            lambda v: (
                v["healthy"] and len({x for s in v["plan"]["stages"] for x in s["nodes"]}) == n and len(v["nodes"]) == n
            ),
            client=self.client,
            timeout=240,
            what=f"a plan over {n} nodes",
        )
        head_id = self.view["plan"]["stages"][-1]["nodes"][0]
        self.head = next(h for h in self.hosts if h.name == head_id)
        self.url = f"http://{self.head.ip}:{HTTP}"
        self.stages = len(self.view["plan"]["stages"])
        _client(self.client, "client_aggregate", self.url, path.name, 1, 8)  # warm-up: kernels compile

    def decode_tps(self, tokens: int, repeats: int = 3, text: str = PROMPT) -> float:
        code = (
            f"import sys,json; sys.path.insert(0,{str(ROOT)!r})\n"
            "from benchmarks.common import http_decode_tps\n"
            f"print(json.dumps(http_decode_tps({self.url!r}, {self.path.name!r}, {tokens}, {repeats}, {text!r})))"
        )
        return in_ns(self.client, code)[0]

    def transport_us_per_hop(self) -> float | None:
        """What each decode hop added beyond the stage's own work, as the head timed it (its
        meshnode_hop_transport_seconds: half of each round trip minus the stage's reported time)."""
        code = (
            f"import urllib.request; print(urllib.request.urlopen('http://{self.head.ip}:{HTTP}/metrics', "
            "timeout=5).read().decode())"
        )
        text = self.client.run([sys.executable, "-c", code], timeout=20).stdout
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith("meshnode_hop_transport_seconds_sum{"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith("meshnode_hop_transport_seconds_count{"):
                count += float(line.rsplit(" ", 1)[1])
        return total / count * 1e6 if count else None

    def network_us_per_hop(self) -> float:
        """Half the median round trip of a bare TCP echo from the head to another node: the floor."""
        other = next(h for h in self.hosts if h is not self.head)
        code = (
            f"import sys,json; sys.path.insert(0,{str(ROOT)!r})\n"
            "from meshnode.control.echo import echo_rtt\n"
            f"print(json.dumps(echo_rtt({other.ip!r}, {GRPC + 1 + ECHO_OFFSET}, samples=200)[0]))"
        )
        return in_ns(self.head, code) / 2 * 1e6

    def bytes_per_token_per_hop(self, tokens: int) -> float:
        """Through the first stage's link (it is not the head: every hop of a 2-stage token crosses it)."""
        other = next(h for h in self.hosts if h is not self.head)

        def traffic(n: int) -> tuple[float, int]:
            before, t0 = counters(other), time.monotonic()
            got = _client(self.client, "client_aggregate", self.url, self.path.name, 1, n)["tokens"]
            return counters(other) - before - idle * (time.monotonic() - t0), got

        idle0, t0 = counters(other), time.monotonic()
        time.sleep(3)
        idle = (counters(other) - idle0) / (time.monotonic() - t0)
        short, n_short = traffic(16)
        long, n_long = traffic(tokens)
        return (long - short) / max(n_long - n_short, 1) / 2

    def ttft(self, length: int) -> float:
        ids = [(7 * i + 3) % 400 + 10 for i in range(length)]
        _client(self.client, "client_ttft", self.url, self.path.name, ids, 1)  # warm-up at this length
        return _client(self.client, "client_ttft", self.url, self.path.name, ids, 3)

    def aggregate(self, streams: int, tokens: int) -> dict:
        return _client(self.client, "client_aggregate", self.url, self.path.name, streams, tokens)

    def stop(self) -> None:
        for p in self.procs:
            self.mesh.stop(p)


# --------------------------------------------------------------------- mlx-lm in this process


def mlx_lm_ttft(path: Path, length: int, repeats: int = 3) -> float:
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(path))
    ids = [(7 * i + 3) % 400 + 10 for i in range(length)]
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        for _r in stream_generate(model, tokenizer, ids, max_tokens=1):
            break
        best = min(best, time.perf_counter() - t0)
    return best


# --------------------------------------------------------------------- the other benchmarks


def run_script(name: str, args: list[str], json_path: Path | None = None) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / name), *args]
    print(f"running {' '.join(cmd)}", flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    print(out.stdout[-3000:], flush=True)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    if json_path is not None and json_path.exists():
        return json.loads(json_path.read_text())
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------- report


def _f(x, fmt="{:.2f}"):
    return "n/a" if x is None else fmt.format(x)


def table(r: dict) -> str:
    ref = r.get("mlx_lm", {})
    rows = ["| figure | meshnode | mlx-lm (same run) | ratio | target |", "|---|---|---|---|---|"]
    for n in (1, 2, 3):
        d = r["decode"].get(str(n))
        if d:
            target = ">= 0.95" if n == 2 else ""
            rows.append(
                f"| decode tok/s, {n} stage{'s' if n > 1 else ''}, best of {len(d.get('rounds', [1]))} "
                f"(ratio: median of rounds, each right after one of mlx-lm) | {d['tps']:.2f} | "
                f"{d.get('mlx_lm_tps', ref['decode_tps']):.2f} | {d['ratio']:.3f} | {target} |"
            )
    bare = r["decode"].get("2", {}).get("bare_split")
    if bare:
        rows.append(
            f"| decode tok/s, bare 2-process split, best of {len(bare['rounds'])} (mlx-lm's modules, a loopback "
            f"socket, nothing else: the floor for any split here) | {bare['tps']:.2f} | "
            f"{r['decode']['2'].get('mlx_lm_tps', 0):.2f} | {bare['ratio']:.3f} | |"
        )
        rows.append(f"| decode, 2-stage mesh / bare split (median of rounds) | {bare['mesh_over_bare']:.3f} | | | |")
    for n in (2, 3):
        d = r["decode"].get(str(n))
        if d:
            rows.append(
                f"| added latency per hop, all in, {n} stages ({d['hops']} hops/token): (time per token "
                f"- mlx-lm's) / hops | {d['added_us_per_hop']:.0f} µs | | | <= 150 µs |"
            )
            if d.get("transport_us_per_hop") is not None:
                rows.append(
                    f"| added latency per hop, transport, {n} stages: (round trip - stage's own time) / 2 "
                    f"| {d['transport_us_per_hop']:.0f} µs | | | <= 150 µs |"
                )
            if d.get("network_us_per_hop") is not None:
                rows.append(
                    f"| network floor per hop, {n} stages: half a bare TCP echo round trip "
                    f"| {d['network_us_per_hop']:.0f} µs | | | |"
                )
            if d.get("hop_after_compute_us") is not None:
                rows.append(
                    f"| one way between two bare processes, each right after 45 ms of compute through its "
                    f"caches (loopback): a hop's floor when both ends compute on these CPUs "
                    f"| {d['hop_after_compute_us']:.0f} µs | | | |"
                )
            if d.get("bare_split"):
                rows.append(
                    f"| transport per hop, bare split (loopback; timed as the transport row above) "
                    f"| {d['bare_split']['transport_us_per_hop']:.0f} µs | | | |"
                )
    if r.get("bytes_per_token_per_hop") is not None:
        rows.append(
            f"| bytes on the wire per token per hop, 2 stages (TCP/IP included) | "
            f"{r['bytes_per_token_per_hop']:.0f} | activation {r['activation_bytes']} B | | |"
        )
    for length in TTFT_PROMPTS:
        t = r["ttft"].get(str(length))
        if t:
            target = "<= 0.6" if length == 1024 else ""
            rows.append(
                f"| TTFT {length}-token prompt, 2 stages, pipelined prefill | {t['pipelined_s'] * 1e3:.0f} ms "
                f"| {t['mlx_lm_s'] * 1e3:.0f} ms | {t['pipelined_s'] / t['mlx_lm_s']:.2f} | |"
            )
            rows.append(
                f"| TTFT {length}-token prompt, 2 stages, one chunk at a time | {t['sequential_s'] * 1e3:.0f} ms "
                f"| {t['mlx_lm_s'] * 1e3:.0f} ms | {t['sequential_s'] / t['mlx_lm_s']:.2f} | |"
            )
            rows.append(
                f"| TTFT {length}-token prompt: pipelined / one chunk at a time | "
                f"{t['pipelined_s'] / t['sequential_s']:.2f} | | | {target} |"
            )
    agg = r["aggregate"]
    one = agg.get("1", {}).get("aggregate_tps")
    for s in STREAMS:
        a = agg.get(str(s))
        if a:
            target = ">= 1.6" if s == 2 else ""
            rows.append(
                f"| aggregate tok/s, {s} stream{'s' if s > 1 else ''}, 2 stages | {a['aggregate_tps']:.2f} "
                f"| {ref['decode_tps']:.2f} (1 stream) | {a['aggregate_tps'] / one:.2f} × 1 stream | {target} |"
            )
    qd = r.get("quantized")
    if qd:
        for key, what in (("1", "1 node"), ("2", "2 stages"), ("tensor", "tensor pair")):
            d = qd.get(key)
            if d:
                rows.append(
                    f"| decode tok/s, {qd['quantize']} ({qd['dtype']} scales, group {qd['group_size']}), "
                    f"{what}, best of {len(d['rounds'])} (ratio: median of rounds) | {d['tps']:.2f} | "
                    f"{d['mlx_lm_tps']:.2f} | {d['ratio']:.3f} | |"
                )
    fo = r.get("failover")
    if fo and "error" not in fo:
        rows.append(f"| failover stall, a stage killed | {fo['stage_death_stall_s']:.2f} s | | | <= 3 s |")
        rows.append(
            f"| failover stall, the coordinator killed | {fo['coordinator_death_stall_s']:.2f} s | | | <= 3 s |"
        )
    elif fo:
        rows.append("| failover stall | failed: see suite.json | | | |")
    te = r.get("tensor")
    if te and "rows" in te:
        for row in te["rows"]:
            rows.append(
                f"| 2 hosts at +{row['inject_us']:.0f} µs per round trip: single / pipeline / tensor tok/s "
                f"| {row['single']:.2f} / {row['pipeline']:.2f} / {row['tensor']:.2f} | | fastest: "
                f"{row['measured_best']}, planner picks {row['planner_pick']} | |"
            )
        if te.get("sharded_over_tensor"):
            rows.append(
                f"| tensor pair vs mlx-lm's own sharded generate | {te['tensor_tps']:.2f} tok/s | "
                f"{te['mlx_lm_sharded_tps']:.2f} tok/s | {te['sharded_over_tensor']:.2f} | <= 1.2 |"
            )
    elif te and te.get("skipped"):
        rows.append(
            "| tensor vs pipeline at injected latencies | skipped in this run (`--skip tensor`); "
            "`benchmarks/tensor.py` runs it alone | | | |"
        )
    elif te:
        rows.append("| tensor vs pipeline at injected latencies | failed in this run: see benchmarks/tensor.py | | | |")
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--skip", default="", help="comma-separated: float32, failover, tensor, quantized")
    args = ap.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    path = bench_model_dir(args.cache)
    small = model_dir_for(args.cache, "llama", **PREFILL_MODEL)
    hidden = BENCH_MODEL["hidden_size"]
    print(
        f"model: {path.name}, {param_count(path) / 1e6:.0f}M parameters, float32, hidden {hidden}, "
        f"{BENCH_MODEL['num_layers']} layers; prefill model {small.name}, {param_count(small) / 1e6:.1f}M "
        f"parameters",
        flush=True,
    )
    r: dict = {
        "model": path.name,
        "parameters": param_count(path),
        "prefill_model": small.name,
        "prefill_model_parameters": param_count(small),
        "tokens": args.tokens,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "activation_bytes": hidden * 4,
        "decode": {},
        "ttft": {},
        "aggregate": {},
        "targets": TARGETS,
    }
    float32 = "float32" not in skip
    mlx_lm_decode = mlx_lm_decoder(path) if float32 else None
    if float32:
        ref_tps = mlx_lm_decode(args.tokens)
        r["mlx_lm"] = {"decode_tps": ref_tps, "ttft_s": {str(n): mlx_lm_ttft(small, n) for n in TTFT_PROMPTS}}
        print(f"mlx-lm: {ref_tps:.2f} tok/s; TTFT {r['mlx_lm']['ttft_s']}", flush=True)

    def decode(
        nodes: Nodes, decoder=mlx_lm_decode, into: dict | None = None, text: str = PROMPT, rounds: int = ROUNDS
    ) -> None:
        """Decode tokens/s of the mesh and of mlx-lm, measured in turns (this machine's speed drifts
        over minutes, so a reference taken once, earlier, skews the ratio): the ratio
        is the median of the rounds' ratios. At 2 stages each round also times the bare split
        (benchmarks/floor.py): the floor any 2-stage split reaches on this machine."""
        split = Split(path) if nodes.stages == 2 and decoder is mlx_lm_decode else None
        pairs, bare = [], []
        try:
            if split is not None:
                split.checked_tps(8)  # warm, and its tokens are mlx-lm's
            for _ in range(rounds):
                pairs.append((decoder(args.tokens, 1), nodes.decode_tps(args.tokens, 1, text)))
                if split is not None:
                    bare.append(tps_of(split.generate(split.prompt, args.tokens)[1]))
        finally:
            if split is not None:
                split.close()
        ratio = statistics.median(tps / ref for ref, tps in pairs)
        tps, ref = max(t for _, t in pairs), max(f for f, _ in pairs)
        hops = 2 * (nodes.stages - 1)
        d = {
            "tps": tps,
            "mlx_lm_tps": ref,
            "ratio": ratio,
            "rounds": pairs,
            "hops": hops,
            "added_us_per_hop": statistics.median((1 / t - 1 / f) for f, t in pairs) / hops * 1e6 if hops else None,
        }
        if hops:
            d["transport_us_per_hop"] = nodes.transport_us_per_hop()
            d["network_us_per_hop"] = nodes.network_us_per_hop()
        if bare:
            d["bare_split"] = {
                "tps": max(bare),
                "rounds": bare,
                "ratio": statistics.median(b / ref for (ref, _), b in zip(pairs, bare)),
                "mesh_over_bare": statistics.median(t / b for (_, t), b in zip(pairs, bare)),
                "transport_us_per_hop": split.transport_us(),
            }
            d["hop_after_compute_us"] = hop_after_compute_us()
        key = str(nodes.stages) if nodes.view["plan"]["strategy"] != "tensor" else "tensor"
        (r["decode"] if into is None else into)[key] = d
        print(f"{key} stage(s){'' if into is None else ', ' + QUANTIZED['quantize']}: {d}", flush=True)

    def float32_rows(mesh, tmp, decode) -> None:
        """The float32 bench model's rows: decode at 1, 2 and 3 stages, bytes per hop, streams, TTFT."""
        nodes = Nodes(mesh, path, tmp, 1, 1.5)
        decode(nodes)
        nodes.stop()

        nodes = Nodes(mesh, path, tmp, 2, 0.6)
        decode(nodes)
        r["bytes_per_token_per_hop"] = nodes.bytes_per_token_per_hop(args.tokens)
        for s in STREAMS:
            r["aggregate"][str(s)] = nodes.aggregate(s, args.tokens)
            print(f"{s} streams: {r['aggregate'][str(s)]}", flush=True)
        nodes.stop()

        nodes = Nodes(mesh, small, tmp, 2, 0.6)
        for n in TTFT_PROMPTS:
            r["ttft"][str(n)] = {"pipelined_s": nodes.ttft(n), "mlx_lm_s": r["mlx_lm"]["ttft_s"][str(n)]}
        nodes.stop()
        nodes = Nodes(mesh, small, tmp, 2, 0.6, env={"MESHNODE_PIPELINED_PREFILL": "false"})
        for n in TTFT_PROMPTS:
            r["ttft"][str(n)]["sequential_s"] = nodes.ttft(n)
        print(f"TTFT: {r['ttft']}", flush=True)
        nodes.stop()

        nodes = Nodes(mesh, path, tmp, 3, 0.4)
        decode(nodes)
        nodes.stop()

    with netns_mesh(4) as mesh, tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for model in (path, small) if float32 else ():
            print(f"compute of {model.name}: {measure_compute(mesh.hosts[0], model, tmp / 'seed')}", flush=True)
        if float32:
            float32_rows(mesh, tmp, decode)

        if "quantized" not in skip:
            # The same llama, bf16 and quantized to 4 bits as mlx_lm.convert -q does: one node, 2 stages and
            # a tensor pair, each in turns with mlx-lm on the same 4-bit model.
            q = bench_model_dir(args.cache, **QUANTIZED)
            print(f"compute of {q.name}: {measure_compute(mesh.hosts[0], q, tmp / 'seed')}", flush=True)
            r["quantized"] = {"model": q.name, **QUANTIZED}
            q_decode = mlx_lm_decoder(q, SHORT_PROMPT)
            for n, fraction, env in ((1, 1.5, None), (2, 0.6, None), (2, 1.5, {"MESHNODE_STRATEGY": "tensor"})):
                nodes = Nodes(mesh, q, tmp, n, fraction, env=env)
                decode(nodes, q_decode, r["quantized"], SHORT_PROMPT, rounds=3)
                nodes.stop()

    args.out.mkdir(parents=True, exist_ok=True)
    if "failover" not in skip:
        r["failover"] = run_script("failover.py", [])
    if "tensor" not in skip:
        tensor_json = args.out / "tensor.json"
        r["tensor"] = run_script("tensor.py", ["--tokens", str(args.tokens), "--json", str(tensor_json)], tensor_json)
    else:
        r["tensor"] = {"skipped": True}
    (args.out / "suite.json").write_text(json.dumps(r, indent=2))
    command = f"python -m benchmarks.suite --tokens {args.tokens}" + (f" --skip {args.skip}" if skip else "")
    md = (
        f"`{command}` on {r['machine']} ({r['cpus']} CPUs, MLX on CPU), "
        f"{r['started']}; decode: llama {r['parameters'] / 1e6:.0f}M parameters, float32, hidden {hidden}; "
        f"TTFT: llama {r['prefill_model_parameters'] / 1e6:.1f}M parameters, hidden "
        f"{PREFILL_MODEL['hidden_size']}\n\n" + table(r)
    )
    (args.out / "suite.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
