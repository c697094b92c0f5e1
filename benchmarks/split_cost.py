"""Issue 14, part 1: what a 2-stage split adds to each decoded token, where it goes, and llama.cpp's beside it.

    sudo .venv/bin/python -m benchmarks.split_cost [--tokens 96] [--rounds 5] [--size small|bench]
        [--llamacpp BIN_DIR --gguf MODEL.gguf]

The same model on the same machine, one core per process (as ../shared/peers/llamacpp-rpc.md
measures llama.cpp's RPC split), in rounds that take turns so this machine's drift falls on all
alike:

- mlx-lm's ``stream_generate`` on the whole model, in this process, pinned to one core (the bare
  split's own copy of it: benchmarks.floor.Split.reference);
- the bare split of benchmarks/floor.py: mlx-lm's modules for the two halves in two processes, a
  core each, one loopback socket between them, nothing else;
- a 2-stage mesh: two ``meshnode run`` processes on namespace hosts, a core each, the client
  streaming from the head (on the head's core: a user's client lives on the machine it asks).

Per token is the median interval between consecutive tokens (robust to this machine's hiccups);
"added per token" is a split's median minus mlx-lm's in the same round, and the figure is the
median over rounds. The mesh runs with ``MESHNODE_TRACE`` (meshnode.tracing): timestamps on both
processes, one clock, cut every decoded token into its segments (the head's serialization and
send, the stage's wake-up, its compute, the way back, the copy into the step built ahead, the
head's own compute and Python). Their medians are printed.

With ``--llamacpp`` (the folder of a llama.cpp build with ``llama-bench`` and ``rpc-server`` or
``ggml-rpc-server``) and
``--gguf`` (the same model converted: see ../shared/peers/llamacpp-rpc.md), each round also runs
llama.cpp on one host and split over the same two namespace hosts (``rpc-server`` holding the
second half), and prints its added time per token beside meshnode's.

``--size small`` (default): llama, hidden 512, 8 layers, float32 (24.6M parameters), where what
the split adds is a large part of a token and so measured most precisely;
``--size bench``: the 101M-parameter model of the other benchmarks. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import BENCH_MODEL, PROMPT, param_count  # noqa: E402
from meshnode import tracing  # noqa: E402

SIZES = {
    "small": dict(BENCH_MODEL, num_layers=8, hidden_size=512, intermediate_size=1408, num_heads=8, num_kv_heads=4),
    "bench": BENCH_MODEL,
}
HTTP, GRPC, RPC = 8490, 8491, 50052
CTX = 1024

# One decoded token on the mesh, from the head's step being evaluated to the next one's: the head
# sends the token to the first stage, which answers with its activation; the head's own step (its
# layers, the output projection, sampling) was built ahead and runs on it. (event, name of the time
# from the event before it). The head's marks are in meshnode.transport.hop and
# meshnode.serving.generation; the stage's in meshnode.transport.hop.serve_forward.
CYCLE = [
    ("head.evaluated", None),
    ("head.serialized", "head: token into its frame"),
    ("head.sent", "head: send"),
    ("stage.arrived", "wake-up and read, head -> stage"),
    ("stage.running", "stage: parse, take the MLX baton"),
    ("stage.computed", "stage: copy in, compute its layers, copy out"),
    ("stage.sent", "stage: send"),
    ("head.readable", "wake-up, stage -> head"),
    ("head.copied", "head: read, copy into the step built ahead"),
    ("head.built", "head: start the step built ahead"),
    ("head.token", "head: sampler, start evaluating"),
    ("head.submit", "head: hand the token on, next step"),
    ("head.evaluated", "head: wait for its own step (its layers, output projection, sampling)"),
]
# The segments of a token that are neither compute nor overlapped with it: what the split itself
# costs on the token's path (the head's Python after its step started runs beside that step).
SPLIT_ONLY = [what for _, what in CYCLE[1:10] if what != "stage: copy in, compute its layers, copy out"]


def segments(traces: dict[int, list[tuple[int, str, str]]]) -> dict[str, list[float]]:
    """Seconds of each CYCLE segment for every complete decoded token in ``traces`` (tracing.read of
    one head and one stage), and "token" (the whole cycle). Tokens that take over 3x the median (a
    request's first, or a hiccup) are left out."""
    events = sorted((ns, name) for rows in traces.values() for ns, name, _ in rows)
    starts = [i for i, (_, name) in enumerate(events) if name == CYCLE[0][0]]
    cycles = []
    for a, b in zip(starts, starts[1:]):
        want, found = 1, [events[a][0]]
        for ns, name in events[a + 1 : b + 1]:
            if want < len(CYCLE) and name == CYCLE[want][0]:
                found.append(ns)
                want += 1
        if want == len(CYCLE):
            cycles.append(found)
    if not cycles:
        return {}
    typical = statistics.median(c[-1] - c[0] for c in cycles)
    out: dict[str, list[float]] = {"token": []}
    for c in cycles:
        if c[-1] - c[0] > 3 * typical:
            continue
        out["token"].append((c[-1] - c[0]) / 1e9)
        for i, (_, what) in enumerate(CYCLE[1:], start=1):
            out.setdefault(what, []).append((c[i] - c[i - 1]) / 1e9)
    return out


def _cpu_seconds(stat: str) -> float:
    fields = stat[stat.rindex(")") + 2 :].split()  # from the state on: utime, stime are 11, 12
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) each living thread of process ``pid`` has used so far, by native
    id; under 0 the whole process's, ended threads included (a generation's thread ends with it)."""
    out = {0: _cpu_seconds(Path(f"/proc/{pid}/stat").read_text())}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = _cpu_seconds((task / "stat").read_text())
        except OSError:  # the thread ended
            continue
    return out


def cpu_by_thread(
    cpu: dict[tuple[int, int], float], tokens: int, traces: dict[int, list[tuple[int, str, str]]]
) -> dict[str, dict[str, float]]:
    """CPU ms per token of each node's threads, named by the thread names in its trace (threads
    that marked nothing, MLX's own among them, summed as "other")."""
    names = {pid: {int(t.rsplit("/", 1)[1]): t.rsplit("/", 1)[0] for _, _, t in rows} for pid, rows in traces.items()}
    out: dict[str, dict[str, float]] = {}
    for pid in {pid for pid, _ in cpu}:
        rows = traces.get(pid, [])
        role = "head" if any(e == "head.token" for _, e, _ in rows) else "stage" if rows else f"pid {pid}"
        threads = out.setdefault(role, {})
        living = 0.0
        for (p, tid), seconds in cpu.items():
            if p != pid or tid == 0:
                continue
            living += seconds
            name = names.get(pid, {}).get(tid, "other threads (MLX's, gRPC's, ...)")
            threads[name] = threads.get(name, 0.0) + seconds * 1e3 / max(tokens, 1)
        threads["threads that ended (each generation's own)"] = (cpu.get((pid, 0), 0.0) - living) * 1e3 / max(tokens, 1)
    return out


def per_token(times: list[float]) -> float:
    """Median interval between consecutive token times (seconds)."""
    return statistics.median(b - a for a, b in zip(times, times[1:]))


# --------------------------------------------------------------------------- the three setups


def bare_split(path: Path, child_core: int, own_core: int):
    """benchmarks/floor.py's Split, its child on ``child_core`` (set before it starts: MLX's threads
    inherit it) and this process back on ``own_core``."""
    from benchmarks.floor import Split

    os.sched_setaffinity(0, {child_core})
    try:
        return Split(path)
    finally:
        os.sched_setaffinity(0, {own_core})


class Mesh:
    """Two ``meshnode run`` processes on namespace hosts, a core each, MESHNODE_TRACE on, pipelined."""

    def __init__(self, mesh, path: Path, tmp: Path, cores: list[int]):
        from harness.cluster import node_argv, wait_mesh
        from meshnode.weights.profile import profile_model

        self.mesh, self.path, self.trace = mesh, path, tmp / "trace"
        self.cpu: dict[tuple[int, int], float] = {}  # (pid, thread) -> CPU seconds in the timed generations
        self.tokens = 0
        budget = int(profile_model(path).total_bytes(CTX) * 0.6)
        self.hosts, self.client = mesh.hosts[:2], mesh.hosts[2]
        self.procs, self.cores = [], {}
        for i, h in enumerate(self.hosts):
            state = tmp / h.name
            state.mkdir()
            self.cores[h.name] = cores[i % len(cores)]
            self.procs.append(
                h.popen(
                    ["taskset", "-c", str(self.cores[h.name])]
                    + node_argv(
                        path,
                        http_port=HTTP,
                        grpc_port=GRPC,
                        node_id=h.name,
                        budget=budget,
                        state_dir=state,
                        max_context=CTX,
                        kv_requests=1,
                    ),
                    # Speculation off: the split's cost is that of one-token steps, whose marks the
                    # segments below cut (the default speculates where the model is split).
                    env={
                        **os.environ,
                        "PYTHONPATH": str(ROOT),
                        "MESHNODE_CLUSTER_KEY": "bench",
                        "MESHNODE_STRATEGY": "pipeline",
                        "MESHNODE_LINK_PROBE_INTERVAL": "3600",
                        "MESHNODE_SPECULATIVE": "off",
                        tracing.ENV: str(self.trace),
                    },
                    log_path=state / "node.log",
                )
            )
        view = wait_mesh(
            f"http://{self.hosts[0].ip}:{HTTP}",
            lambda v: v["healthy"] and v["plan"] and len(v["plan"]["stages"]) == 2,
            client=self.client,
            timeout=240,
            what="a 2-stage plan",
        )
        head = view["plan"]["stages"][-1]["nodes"][0]
        self.head = next(h for h in self.hosts if h.name == head)
        self.url = f"http://{self.head.ip}:{HTTP}"

    def times(self, tokens: int) -> list[float]:
        """One greedy streamed completion from the head; the client's time of each token's text."""
        code = (
            f"import sys,json; sys.path.insert(0,{str(ROOT)!r})\n"
            "from benchmarks.split_cost import client_times\n"
            "print(json.dumps(client_times(*json.loads(sys.argv[1]))))"
        )
        before = {p.pid: thread_cpu(p.pid) for p in self.procs}
        out = self.client.run(
            [
                "taskset",
                "-c",
                str(self.cores[self.head.name]),
                sys.executable,
                "-c",
                code,
                json.dumps([self.url, self.path.name, tokens]),
            ],
            timeout=900,
        )
        for pid, was in before.items():
            for tid, seconds in thread_cpu(pid).items():
                self.cpu[pid, tid] = self.cpu.get((pid, tid), 0.0) + seconds - was.get(tid, 0.0)
        times = json.loads(out.stdout.strip().splitlines()[-1])
        self.tokens += len(times)
        return times

    def stop(self) -> dict[int, list[tuple[int, str, str]]]:
        """Stop both nodes as a service manager would (SIGTERM: each writes out its trace); the traces."""
        for p in self.procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            p.wait(60)
        return tracing.read(self.trace)


def client_times(url: str, model_id: str, tokens: int) -> list[float]:
    """(Runs in the client's namespace.) The time each streamed text piece arrived."""
    import urllib.request

    from benchmarks.common import sse_events

    body = json.dumps(
        {
            "model": model_id,
            "messages": [{"role": "user", "content": PROMPT}],
            "stream": True,
            "max_tokens": tokens,
            "temperature": 0,
        }
    ).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for event in sse_events(r):
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    return times


class LlamaCpp:
    """llama.cpp's llama-bench on one host, and split over two with rpc-server holding the second half."""

    def __init__(self, bin_dir: Path, gguf: Path, mesh, cores: list[int], layers: int):
        self.bench, self.gguf, self.cores, self.layers = bin_dir / "llama-bench", gguf, cores, layers
        self.netns, self.host, self.remote = mesh, mesh.hosts[0], mesh.hosts[1]
        # Both of its processes the same kind of memory, as ../shared/peers/llamacpp-rpc.md measures
        # it (with llama-bench -lm none); MLX's processes keep glibc's default: with huge pages,
        # mlx-lm's time per token varies widely from one generation to the next.
        self.env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
        server = next(
            (bin_dir / n for n in ("rpc-server", "ggml-rpc-server") if (bin_dir / n).exists()), bin_dir / "rpc-server"
        )
        self.server = self.remote.popen(
            ["taskset", "-c", str(cores[1]), str(server), "-H", self.remote.ip, "-p", str(RPC), "-t", "1"], env=self.env
        )
        time.sleep(2)

    def tps(self, tokens: int, split: bool) -> float:
        cmd = [
            "taskset",
            "-c",
            str(self.cores[0]),
            str(self.bench),
            "-m",
            str(self.gguf),
            "-t",
            "1",
            "-p",
            "0",
            "-n",
            str(tokens),
            "-r",
            "1",
            "-o",
            "json",
            "-lm",
            "none",
        ]
        if split:  # llama.cpp counts the output projection as a layer: L/2 + 1 on the second host
            cmd += ["-ngl", str(self.layers // 2 + 1), "--rpc", f"{self.remote.ip}:{RPC}"]
        out = self.host.run(cmd, env=self.env, timeout=600)
        return json.loads(out.stdout)[0]["avg_ts"]

    def close(self) -> None:
        self.netns.kill(self.server)


# --------------------------------------------------------------------------- the run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--llamacpp", type=Path, help="folder with llama-bench and rpc-server")
    ap.add_argument("--gguf", type=Path, help="the same model as a GGUF file (for --llamacpp)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--keep-trace", type=Path, help="copy the nodes' trace files (meshnode.tracing) here")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    args = ap.parse_args()
    from harness.netns import netns_mesh

    spec = dict(SIZES[args.size])
    family = spec.pop("family")
    from meshnode.model.build import model_dir_for

    path = model_dir_for(args.cache, family, **spec)
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        print("needs two cores", file=sys.stderr)
        return 1
    print(
        f"model: {path}, {param_count(path) / 1e6:.1f}M parameters, {spec['dtype']}, hidden {spec['hidden_size']}, "
        f"{spec['num_layers']} layers; {args.tokens} tokens per generation, {args.rounds} rounds; cores {cores}",
        flush=True,
    )
    os.sched_setaffinity(0, {cores[0]})
    split = bare_split(path, cores[1], cores[0])  # it holds mlx-lm's whole model too (Split.reference)
    rounds = []
    with netns_mesh(3) as netns, tempfile.TemporaryDirectory() as tmp:
        mesh = Mesh(netns, path, Path(tmp), cores)
        cpp = (
            LlamaCpp(args.llamacpp, args.gguf, netns, cores, spec["num_layers"])
            if args.llamacpp and args.gguf
            else None
        )
        try:
            try:
                split.checked_tps(args.tokens)
            except ValueError as exc:  # the bare split's tokens differ from mlx-lm's
                raise SystemExit(str(exc)) from None
            mesh.times(8)  # kernels compiled on both nodes
            mesh.cpu, mesh.tokens = {}, 0
            for i in range(args.rounds):
                r = {
                    "mlx_lm": per_token(split.reference(args.tokens)[1]),
                    "bare": per_token(split.generate(split.prompt, args.tokens)[1]),
                    "mesh": per_token(mesh.times(args.tokens)),
                }
                if cpp is not None:
                    r["cpp_one"] = 1 / cpp.tps(args.tokens, split=False)
                    r["cpp_two"] = 1 / cpp.tps(args.tokens, split=True)
                rounds.append(r)
                print(
                    f"round {i}: per token mlx-lm {r['mlx_lm'] * 1e3:.2f} ms, bare split {r['bare'] * 1e3:.2f}, "
                    f"mesh {r['mesh'] * 1e3:.2f}"
                    + (f"; llama.cpp 1 host {r['cpp_one'] * 1e3:.2f}, 2 hosts {r['cpp_two'] * 1e3:.2f}" if cpp else ""),
                    flush=True,
                )
        finally:
            split.close()
            if cpp is not None:
                cpp.close()
            traces = mesh.stop()
            if args.keep_trace:
                shutil.copytree(mesh.trace, args.keep_trace, dirs_exist_ok=True)
    parts = segments(traces)
    result = report(rounds, parts)
    result["cpu_ms_per_token"] = cpu_by_thread(mesh.cpu, mesh.tokens, traces)
    print("\nCPU per token by thread, each node on its own core (ms; the client, on the head's core, not counted):")
    for role, threads in sorted(result["cpu_ms_per_token"].items()):
        busiest = sorted(threads.items(), key=lambda kv: -kv[1])
        print(f"  {role}: " + ", ".join(f"{name} {ms:.2f}" for name, ms in busiest))
    result.update(model=path.name, parameters=param_count(path), tokens=args.tokens, size=args.size)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


def report(rounds: list[dict], parts: dict[str, list[float]]) -> dict:
    def median_ms(key: str, base: str | None = None) -> float:
        return statistics.median(r[key] - (r[base] if base else 0) for r in rounds) * 1e3

    out = {
        "per_token_ms": {k: median_ms(k) for k in rounds[0]},
        "added_ms": {
            "bare split": median_ms("bare", "mlx_lm"),
            "mesh": median_ms("mesh", "mlx_lm"),
            "mesh over bare split": median_ms("mesh", "bare"),
        },
    }
    if "cpp_one" in rounds[0]:
        out["added_ms"]["llama.cpp rpc"] = median_ms("cpp_two", "cpp_one")
    print("\nadded per decoded token, 2 stages vs one process (median of rounds):")
    for k, v in out["added_ms"].items():
        print(f"  {k:24s} {v:7.2f} ms")
    if parts:
        print(
            f"\nthe mesh's token cut into segments (median of {len(parts['token'])} tokens, "
            f"from timestamps on both nodes):"
        )
        out["segments_ms"] = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
        for k, v in out["segments_ms"].items():
            print(f"  {v:8.3f} ms  {k}")
        out["split_only_ms"] = sum(out["segments_ms"][k] for k in SPLIT_ONLY)
        print(
            f"  {out['split_only_ms']:8.3f} ms  on the token's path and not compute (the sum of "
            f"{len(SPLIT_ONLY)} segments: the head's frame, send, both wake-ups, the stage's parse and "
            "send, the head's read and copy)"
        )
    out["rounds"] = rounds
    return out


if __name__ == "__main__":
    sys.exit(main())
