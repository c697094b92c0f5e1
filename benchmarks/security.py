"""Issue 6 benchmark: what authentication and encryption of node-to-node gRPC cost per token.

Three 2-stage pipelines of the same ~100M-parameter float32 model, each on two network-namespace
hosts (each node offered 60 % of the model, so both are needed), all running at once, and a client
namespace streaming from their heads:
  (a) auth off     MESHNODE_AUTHENTICATE=false (a tests/benchmarks-only setting),
  (b) auth on      the default: every call signed with the cluster key (HMAC-SHA256),
  (c) auth + TLS   --encrypt: mutual TLS with the certificate derived from the key.
Decode tokens/s are measured interleaved (a, b, c in a rotating order, --rounds times, one
streamed generation each) so that drift of this shared machine hits all three alike; prints the
median and best of each and the ratios of medians to (a) (target for (b): >= 0.98).

Then, to see per-message costs below the noise of a whole token: the round trip of one 3 KiB
message on a bidirectional gRPC stream on loopback (what a pipeline hop is), with no auth, with
the auth client interceptors (meshnode.trust.signed.client_interceptors), with SignedChannel (what
the nodes use: signs once per call) and with SignedChannel over TLS.
Needs root (network namespaces).

    sudo .venv/bin/python benchmarks/security.py [--tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
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

HTTP, GRPC = 8470, 8471
CONFIGS = {  # name -> (extra flags, extra environment)
    "auth off": ([], {"MESHNODE_AUTHENTICATE": "false"}),
    "auth on": ([], {}),
    "auth + encryption": (["--encrypt"], {}),
}


def wait_pipeline(client, host) -> dict:
    return wait_mesh(
        f"http://{host.ip}:{HTTP}",
        lambda v: v["healthy"] and v["plan"] and len(v["plan"]["stages"]) == 2,
        client=client,
        timeout=240,
        what="a 2-stage plan",
    )


def stream(client, head, model_id: str, tokens: int) -> dict:
    return in_ns(
        client,
        f"import sys,json; sys.path.insert(0,{str(ROOT)!r})\n"
        "from benchmarks.common import http_decode_tps\n"
        f"tps,n=http_decode_tps('http://{head.ip}:{HTTP}', {model_id!r}, {tokens}, 1)\n"
        "print(json.dumps({'tps':tps,'n':n}))",
    )


# ---------------------------------------------------------------------------- loopback round trips
async def _echo_rtt(kind: str, n: int) -> float:
    import grpc

    from meshnode.proto import mesh_pb2, mesh_pb2_grpc
    from meshnode.trust import tls
    from meshnode.trust.auth import ClusterAuth
    from meshnode.trust.signed import SignedChannel, client_interceptors

    class Echo(mesh_pb2_grpc.MeshServicer):
        async def Forward(self, requests, context):
            async for r in requests:
                yield mesh_pb2.ForwardReply(output=r.input)

    key = "benchmark key"
    auth = ClusterAuth(key)
    server = grpc.aio.server(interceptors=[auth.server_interceptor()] if kind != "plain" else [])
    mesh_pb2_grpc.add_MeshServicer_to_server(Echo(), server)
    identity = tls.derive_identity(key)
    if kind == "signed + tls":
        port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(identity))
        channel = grpc.aio.secure_channel(
            f"127.0.0.1:{port}", tls.channel_credentials(identity), options=tls.channel_options()
        )
    else:
        port = server.add_insecure_port("127.0.0.1:0")
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=(client_interceptors(auth, "bench") if kind == "interceptors" else None)
        )
    if kind in ("signed", "signed + tls"):
        channel = SignedChannel(channel, auth, "bench")
    await server.start()
    try:
        call = mesh_pb2_grpc.MeshStub(channel).Forward()
        msg = mesh_pb2.ForwardRequest(input=mesh_pb2.Tensor(dtype="float32", shape=[1, 1, 768], data=b"\0" * 3072))
        for _ in range(200):
            await call.write(msg)
            await call.read()
        t0 = time.perf_counter()
        for _ in range(n):
            await call.write(msg)
            await call.read()
        rtt = (time.perf_counter() - t0) / n * 1e6
        call.cancel()
        return rtt
    finally:
        await channel.close()
        await server.stop(None)


def loopback_rtts(rounds: int = 7, n: int = 2000) -> dict[str, float]:
    kinds = ["plain", "interceptors", "signed", "signed + tls"]
    got: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for k in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            got[k].append(asyncio.run(_echo_rtt(k, n)))
    return {k: statistics.median(v) for k, v in got.items()}


# ---------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    args = ap.parse_args()
    path = bench_model_dir(args.cache)
    profile = profile_model(path)
    ctx = 1024
    print(
        f"model: {path.name}, {param_count(path) / 1e6:.0f}M parameters, float32, hidden {BENCH_MODEL['hidden_size']}",
        flush=True,
    )
    budget = int(profile.total_bytes(ctx) * 0.6)
    names = list(CONFIGS)
    results: dict[str, list[float]] = {name: [] for name in names}
    with netns_mesh(2 * len(names) + 1) as mesh, tempfile.TemporaryDirectory() as tmp:
        client = mesh.hosts[-1]
        heads = {}
        for i, name in enumerate(names):
            a, b = mesh.hosts[2 * i], mesh.hosts[2 * i + 1]
            flags, env = CONFIGS[name]
            for h, peer in ((a, b), (b, a)):
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
                        mdns=False,
                        peers=[f"{peer.ip}:{GRPC}"],
                        extra=flags,
                    ),
                    env={**os.environ, "PYTHONPATH": str(ROOT), "MESHNODE_CLUSTER_KEY": f"bench key {i}", **env},
                    log_path=state / "node.log",
                )
        for i, name in enumerate(names):
            a, b = mesh.hosts[2 * i], mesh.hosts[2 * i + 1]
            view = wait_pipeline(client, a)
            head_id = view["plan"]["stages"][-1]["nodes"][0]
            heads[name] = a if head_id == a.name else b
            print(
                f"{name}: "
                + ", ".join(
                    f"layers {s['start_layer']}-{s['end_layer'] - 1} on {s['nodes'][0]}" for s in view["plan"]["stages"]
                ),
                flush=True,
            )
            stream(client, heads[name], path.name, 8)  # warm-up: first-use kernel compilation
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                results[name].append(stream(client, heads[name], path.name, args.tokens)["tps"])
            print(f"round {r + 1}: " + ", ".join(f"{n} {results[n][-1]:.2f}" for n in names), flush=True)
    med = {n: statistics.median(v) for n, v in results.items()}
    base = med[names[0]]
    print()
    for n in names:
        print(f"{n:>18}: median {med[n]:.2f} tok/s, best {max(results[n]):.2f}, ratio to auth off {med[n] / base:.3f}")
    print(
        f"authentication costs {100 * (1 - med['auth on'] / base):+.1f} % (target < 2 %), "
        f"authentication + encryption {100 * (1 - med['auth + encryption'] / base):+.1f} %"
    )
    rtts = loopback_rtts()
    print(
        "loopback round trip of one 3 KiB message on a gRPC stream (median of 7 x 2000): "
        + ", ".join(f"{k} {v:.0f} µs" for k, v in rtts.items())
    )
    print(
        json.dumps(
            {
                "tokens": args.tokens,
                "rounds": args.rounds,
                "tps": results,
                "median_tps": med,
                "ratio_to_auth_off": {n: med[n] / base for n in names},
                "loopback_rtt_us": rtts,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
