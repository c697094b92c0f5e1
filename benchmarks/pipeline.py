"""Issue 2 benchmark: a 2-stage pipeline on two namespace hosts vs mlx_lm.stream_generate.

Same ~100M-parameter float32 model, same prompt, same run. Two `meshnode run` processes on two
network-namespace hosts (each offered 60 % of the model, so both are needed) and a client
namespace that streams from the head. Prints:
  - decode tokens/s of both and the ratio (target >= 0.95),
  - added latency per hop in µs: (pipeline time per token - mlx-lm time per token) / hops,
  - bytes on the wire per token per hop (from the veth counters, idle heartbeat traffic
    subtracted), against the activation size (target <= activation + 256).
Needs root (network namespaces).

    sudo .venv/bin/python benchmarks/pipeline.py [--tokens 64]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    BENCH_MODEL,
    bench_model_dir,
    mlx_lm_decode_tps,
    param_count,
    parse_args,
)
from harness.cluster import in_ns, node_argv, wait_mesh  # noqa: E402
from harness.netns import netns_mesh  # noqa: E402
from meshnode.weights.profile import profile_model  # noqa: E402

HTTP, GRPC = 8470, 8471


def counters(host) -> int:
    stats = json.loads(host.run(["ip", "-s", "-j", "link", "show", host.dev]).stdout)[0]["stats64"]
    return stats["rx"]["bytes"] + stats["tx"]["bytes"]


def main() -> int:
    args = parse_args(__doc__)
    path = bench_model_dir(args.cache)
    profile = profile_model(path)
    ctx = 1024
    print(
        f"model: {path.name}, {param_count(path) / 1e6:.0f}M parameters, float32, hidden {BENCH_MODEL['hidden_size']}"
    )
    ref = mlx_lm_decode_tps(path, args.tokens)
    print(f"mlx_lm.stream_generate (in process): {ref:.2f} tok/s")
    budget = int(profile.total_bytes(ctx) * 0.6)
    with netns_mesh(3) as mesh, tempfile.TemporaryDirectory() as tmp:
        a, b, client = mesh.hosts
        for h in (a, b):
            state = Path(tmp) / h.name
            state.mkdir()
            h.popen(
                node_argv(
                    path,
                    http_port=HTTP,
                    grpc_port=GRPC,
                    node_id=h.name,
                    budget=budget,
                    state_dir=state,
                    max_context=ctx,
                    kv_requests=1,
                ),
                env={
                    **os.environ,
                    "PYTHONPATH": str(ROOT),
                    "MESHNODE_CLUSTER_KEY": "bench",
                    # a pipeline, though the planner may prefer a tensor pair on these fast links;
                    # links measured once, so no bandwidth probe lands in the byte counts
                    "MESHNODE_STRATEGY": "pipeline",
                    "MESHNODE_LINK_PROBE_INTERVAL": "3600",
                },
                log_path=state / "node.log",
            )
        view = wait_mesh(
            f"http://{a.ip}:{HTTP}",
            lambda v: v["healthy"] and len(v["plan"]["stages"]) == 2,
            client=client,
            timeout=180,
            what="a 2-stage plan",
        )
        head_id = view["plan"]["stages"][-1]["nodes"][0]
        head = a if head_id == a.name else b
        other = b if head is a else a
        print(
            "plan:",
            ", ".join(
                f"layers {s['start_layer']}-{s['end_layer'] - 1} on {s['nodes'][0]}" for s in view["plan"]["stages"]
            ),
        )

        def stream(tokens: int, repeats: int = 3) -> dict:
            return in_ns(
                client,
                f"import sys,json; sys.path.insert(0,{str(ROOT)!r})\n"
                "from benchmarks.common import http_decode_tps\n"
                f"tps,n=http_decode_tps('http://{head.ip}:{HTTP}', {path.name!r}, {tokens}, "
                f"{repeats})\n"
                "print(json.dumps({'tps':tps,'n':n}))",
            )

        def traffic(tokens: int) -> tuple[float, int]:
            """Bytes through stage 0's link for one request, idle heartbeat traffic subtracted."""
            before, t0 = counters(other), time.monotonic()
            n = stream(tokens, repeats=1)["n"]
            return counters(other) - before - idle_rate * (time.monotonic() - t0), n

        stream(8, 1)  # warm-up (first-use kernel compilation on both hosts)
        idle0, t0 = counters(other), time.monotonic()
        time.sleep(3)
        idle_rate = (counters(other) - idle0) / (time.monotonic() - t0)
        result = stream(args.tokens)
        # Decode-only bytes: the same prompt with two lengths; the difference is pure decode traffic.
        short, n_short = traffic(16)
        long, n_long = traffic(args.tokens)
    tps, n = result["tps"], result["n"]
    hops = 2  # per token: head -> stage 0 (token id), stage 0 -> head (activation)
    added_us = (1 / tps - 1 / ref) / hops * 1e6
    activation = BENCH_MODEL["hidden_size"] * 4
    per_hop = (long - short) / (n_long - n_short) / hops
    print(f"meshnode, 2 stages on 2 hosts:       {tps:.2f} tok/s ({n} tokens)")
    print(f"ratio: {tps / ref:.3f} (target >= 0.95)")
    print(f"added latency per hop: {added_us:.0f} µs (target <= 150)")
    print(
        f"bytes on the wire per decoded token per hop (the two hops averaged, TCP/IP and ACKs included): "
        f"{per_hop:.0f} (activation {activation} bytes; target <= {activation + 256})"
    )
    print(
        json.dumps(
            {
                "mlx_lm_tps": ref,
                "pipeline_tps": tps,
                "ratio": tps / ref,
                "added_us_per_hop": added_us,
                "bytes_per_token_per_hop": per_hop,
                "activation_bytes": activation,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
