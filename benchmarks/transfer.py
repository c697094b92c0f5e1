"""Issue 7 benchmark: a multi-GB shard fetched from a peer, as a fraction of raw TCP.

Two network-namespace hosts. Host A serves a generated float32 llama (default ~3 GB) from a
ModelStore behind the cluster's gRPC authentication, as a node does; host B runs fetch_layers
for the first three quarters of its layers (chunked gRPC streams, sha256 per tensor, written to
disk, journaled, published by a rename). In the same run, raw TCP between the same hosts: one
socket, A sends the same number of bytes from memory, B reads them into a buffer and discards
them, then again into a file fsync'd at the end (what this disk allows); and a bare gRPC stream
of the same bytes from memory, dropped on arrival (what the transport the transfer is built on
allows by itself). Prints the throughputs and the ratios (target >= 0.8 of raw TCP). Needs root.

Each is run at several link rates (tc tbf on A's side): home links (1 Gbit/s Ethernet, 2.5 Gbit/s)
and the bare veth link. The bare link between two namespaces of one VM runs at memory speed, so
there the figure says what the CPUs allow (the bare gRPC stream's ratio says how much of that is
the transport itself), not how well a link is used. ``--dest /dev/shm`` takes the disk out.

    sudo .venv/bin/python benchmarks/transfer.py [--layers 16 --hidden 2048] [--rates 1gbit,none] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.cluster import in_ns  # noqa: E402
from harness.netns import netns_mesh  # noqa: E402

KEY = "benchmark-cluster-key"
PORT, TCP_PORT = 8471, 8490
BURST = "4mb"  # tbf bucket: enough for 10 Gbit/s at a 1 ms timer tick

SERVE = """
import asyncio, sys, grpc
from meshnode.trust.auth import ClusterAuth
from meshnode.weights.store import ModelStore
from meshnode.proto import mesh_pb2_grpc
class S(mesh_pb2_grpc.MeshServicer):
    def __init__(self, store): self.store = store
    async def Manifest(self, r, c): return await self.store.Manifest(r, c)
    async def Fetch(self, r, c):
        async for x in self.store.Fetch(r, c): yield x
async def main():
    store = ModelStore(local_models={sys.argv[2]: sys.argv[1]}, chunk_size=int(sys.argv[5]))
    await store.held(sys.argv[2])  # hash the manifest before the clock starts
    srv = grpc.aio.server(interceptors=[ClusterAuth(sys.argv[3]).server_interceptor()],
                          options=[("grpc.max_send_message_length", 64 << 20)])
    mesh_pb2_grpc.add_MeshServicer_to_server(S(store), srv)
    srv.add_insecure_port("0.0.0.0:%s" % sys.argv[4]); await srv.start()
    print("ready", flush=True); await srv.wait_for_termination()
asyncio.run(main())
"""

FETCH = """
import asyncio, json, sys, time, grpc
from meshnode.trust.auth import ClusterAuth
from meshnode.trust.signed import SignedChannel
from meshnode.weights.transfer import fetch_layers
async def main():
    ch = SignedChannel(grpc.aio.insecure_channel(sys.argv[1], options=[("grpc.max_receive_message_length", 64 << 20)]),
                       ClusterAuth(sys.argv[2]), "bench")
    t0 = time.perf_counter()
    r = await fetch_layers([("a", ch)], sys.argv[3], 0, int(sys.argv[4]), sys.argv[5], num_layers=int(sys.argv[6]),
                           streams_per_peer=int(sys.argv[7]))
    dt = time.perf_counter() - t0
    print(json.dumps({"bytes": r.fetched_bytes, "seconds": dt}))
asyncio.run(main())
"""

GRPC_SEND = """
import asyncio, sys, grpc
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
n, chunk = int(sys.argv[2]), bytes(int(sys.argv[3]))
class S(mesh_pb2_grpc.MeshServicer):
    async def Fetch(self, r, c):
        left = n
        while left > 0:
            yield mesh_pb2.Chunk(offset=n - left, data=chunk[:left])
            left -= len(chunk)
async def main():
    srv = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    mesh_pb2_grpc.add_MeshServicer_to_server(S(), srv)
    srv.add_insecure_port("0.0.0.0:%s" % sys.argv[1]); await srv.start()
    print("ready", flush=True); await srv.wait_for_termination()
asyncio.run(main())
"""

GRPC_RECV = """
import asyncio, json, sys, time, grpc
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
async def main():
    ch = grpc.aio.insecure_channel(sys.argv[1], options=[("grpc.max_receive_message_length", 64 << 20)])
    await ch.channel_ready()
    t0, got = time.perf_counter(), 0
    async for c in mesh_pb2_grpc.MeshStub(ch).Fetch(mesh_pb2.FetchRequest()):
        got += len(c.data)
    print(json.dumps({"bytes": got, "seconds": time.perf_counter() - t0}))
asyncio.run(main())
"""

TCP_SEND = """
import socket, sys
n, buf = int(sys.argv[2]), memoryview(bytearray(4 << 20))
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept()
while n > 0:
    k = c.send(buf[:min(n, len(buf))]); n -= k
c.close()
"""

TCP_RECV = """
import json, os, socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf, got = bytearray(4 << 20), 0
out = open(sys.argv[3], "wb") if len(sys.argv) > 3 else None
t0 = time.perf_counter()
while True:
    k = c.recv_into(buf)
    if not k: break
    got += k
    if out: out.write(memoryview(buf)[:k])
if out:
    out.flush(); os.fsync(out.fileno()); out.close(); os.unlink(sys.argv[3])
print(json.dumps({"bytes": got, "seconds": time.perf_counter() - t0}))
"""


def wait_ready(proc) -> None:
    line = proc.stdout.readline()
    if "ready" not in line:
        raise RuntimeError(f"server did not start: {line!r} {proc.stderr.read()[-2000:] if proc.stderr else ''}")


def raw_tcp(a, b, n: int, *to_file) -> dict:
    """n bytes over one TCP socket from a to b, timed on b (into memory, or into a file)."""
    sender = subprocess.Popen(
        a.exec_args([sys.executable, "-c", TCP_SEND, str(TCP_PORT), str(n)]), stdout=subprocess.PIPE, text=True
    )
    try:
        wait_ready(sender)
        return in_ns(b, TCP_RECV, a.ip, TCP_PORT, *to_file, timeout=1800)
    finally:
        sender.wait(30)


def bare_grpc(mesh, a, b, n: int, chunk: int) -> dict:
    """n bytes streamed by gRPC (Python, asyncio) from memory on a to b, in chunks of ``chunk``
    bytes, read and dropped: what the transport the transfer is built on allows by itself."""
    server = a.popen(
        [sys.executable, "-c", GRPC_SEND, str(PORT), str(n), str(chunk)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        wait_ready(server)
        return in_ns(b, GRPC_RECV, f"{a.ip}:{PORT}", timeout=1800)
    finally:
        mesh.stop(server)


def peer_fetch(mesh, a, b, model: Path, end: int, layers: int, dest: Path, chunk_kib: int, streams: int) -> dict:
    """fetch_layers on b from a ModelStore on a: {"bytes", "seconds", "shard"} (shard: bytes on b's disk)."""
    server = a.popen([sys.executable, "-c", SERVE, str(model), model.name, KEY, str(PORT), str(chunk_kib << 10)])
    try:
        time.sleep(0.5)
        deadline = time.monotonic() + 300  # the first manifest hashes every tensor
        while True:
            try:
                fetched = in_ns(b, FETCH, f"{a.ip}:{PORT}", KEY, model.name, end, dest, layers, streams, timeout=1800)
                break
            except RuntimeError as exc:
                if time.monotonic() > deadline:
                    raise
                if "UNAVAILABLE" not in str(exc) and "no peer holds" not in str(exc):
                    raise
                time.sleep(1)
    finally:
        mesh.stop(server)
    fetched["shard"] = sum(f.stat().st_size for f in dest.glob("*.safetensors"))
    shutil.rmtree(dest)
    return fetched


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--chunk-kib", type=int, default=1024, help="Fetch chunk size (the node's default: 1024)")
    ap.add_argument("--streams", type=int, default=2, help="streams per peer (the node's default: 2)")
    ap.add_argument(
        "--rates",
        default="1gbit,2500mbit,none",
        help="link rates to run at, comma-separated tc rates; none: the bare veth link",
    )
    ap.add_argument(
        "--dest",
        type=Path,
        help="where B writes the shard (default: a temporary folder on this disk; "
        "/dev/shm takes the disk out of the figure)",
    )
    ap.add_argument("--keep", type=Path, help="build (or reuse) the model here instead of a temporary folder")
    args = ap.parse_args()
    from meshnode.model.build import build_model

    tmp = Path(tempfile.mkdtemp(prefix="meshnode-transfer-"))
    out = Path(tempfile.mkdtemp(prefix="meshnode-transfer-", dir=args.dest)) if args.dest else tmp
    rows = []
    try:
        model = (args.keep or tmp) / f"llama-{args.layers}x{args.hidden}"
        if not (model / "config.json").is_file():
            t0 = time.monotonic()
            build_model(
                model,
                "llama",
                num_layers=args.layers,
                hidden_size=args.hidden,
                intermediate_size=int(args.hidden * 2.75),
                num_heads=16,
                num_kv_heads=8,
                dtype="float32",
            )
            print(f"built {model.name} in {time.monotonic() - t0:.0f} s")
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        end = max(1, args.layers * 3 // 4)
        print(
            f"model: {size / 2**30:.2f} GiB of weights; shard: layers [0, {end}) of {args.layers}; "
            f"chunks of {args.chunk_kib} KiB, {args.streams} streams, {len(os.sched_getaffinity(0))} CPUs"
        )
        for rate in args.rates.split(","):
            with netns_mesh(2) as mesh:
                a, b = mesh.hosts
                if rate != "none":  # what A sends (the bytes B fetches) at this rate, like a LAN link
                    mesh.shape(a, rate=rate, burst=BURST, latency="20ms")
                got = peer_fetch(mesh, a, b, model, end, args.layers, out / "dest", args.chunk_kib, args.streams)
                grpc_only = bare_grpc(mesh, a, b, got["bytes"], args.chunk_kib << 10)
                raw = raw_tcp(a, b, got["bytes"])
                disk = raw_tcp(a, b, got["bytes"], out / "tcp.bin")
            peer, tcp, to_disk, bare = (x["bytes"] / x["seconds"] for x in (got, raw, disk, grpc_only))
            rows.append((rate, peer, tcp, to_disk, bare))
            print(
                f"link {rate}: peer transfer (fetch_layers: auth, sha256, to disk) {got['bytes'] / 2**30:.2f} GiB "
                f"in {got['seconds']:.2f} s = {peer / 2**20:,.0f} MiB/s (shard on B's disk "
                f"{got['shard'] / 2**30:.2f} GiB); raw TCP memory to memory {tcp / 2**20:,.0f} MiB/s; raw TCP "
                f"to disk (fsync'd at the end) {to_disk / 2**20:,.0f} MiB/s; bare gRPC stream, memory to memory "
                f"{bare / 2**20:,.0f} MiB/s",
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    print(
        "\n| link | peer transfer | raw TCP | ratio (target >= 0.8) | raw TCP to disk | ratio to it "
        "| bare gRPC stream | ratio to it |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for rate, peer, tcp, to_disk, bare in rows:
        print(
            f"| {rate} | {peer / 2**20:,.0f} MiB/s | {tcp / 2**20:,.0f} MiB/s | {peer / tcp:.3f} | "
            f"{to_disk / 2**20:,.0f} MiB/s | {peer / to_disk:.3f} | {bare / 2**20:,.0f} MiB/s | {peer / bare:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
