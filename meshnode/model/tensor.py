"""Tensor parallelism: a group of nodes shares every layer of a stage over ``mx.distributed``.

mlx-lm's ``model.shard(group)`` splits each layer's projections over the group; the forward
pass then does two all-reduces per layer. ``mx.distributed`` keeps its group for the life of
a process, so every member runs the group in a **worker subprocess** that its node starts for
a plan and kills when the plan changes. The ring backend has no timeouts (a vanished peer
hangs a collective), so the node supervises: every call on the worker has a deadline, and a
worker that misses it is killed, which breaks the ring for the other members too (their
collectives fail with "connection to a peer was lost" and their workers exit).

Rank 0's node drives the group. It talks to its worker over the worker's stdin/stdout with
length-prefixed protobuf frames (``WorkerCommand`` / ``WorkerReply``; local pipes, never the
network). Rank 0's worker hands each command to the other ranks over plain TCP control
connections (a 20-byte header and the input's raw bytes; each follower proves the cluster key
with an HMAC when it connects). A follower waits for its next command in a blocking read:
waiting inside a ring collective instead would busy-spin a core for as long as the group is
idle. Every rank then runs the same forward pass in lockstep and ends with the full output
(mlx-lm's sharded-to-all layers all-reduce it); rank 0 replies.

The ring's own connections are plain TCP without authentication (MLX's backend); the README
says so. On Macs with Thunderbolt, JACCL is the same code with RDMA.

:class:`TensorShard` is the node's side: it looks like a :class:`~meshnode.model.shard.Shard`
(``spec``, ``dtype``, ``hidden_size``, ``make_cache``, ``forward``) so the stage server and the
local pipeline use it unchanged.

Run as ``python -m meshnode.model.tensor`` by :class:`TensorShard` only.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import hmac
import json
import logging
import math
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence

import mlx.core as mx

from meshnode.model.lifeline import child_env, die_with_parent
from meshnode.model.shard import ShardSpec
from meshnode.model.wire import LENGTH, WireError, from_tensor, to_tensor
from meshnode.proto import mesh_pb2

log = logging.getLogger(__name__)

MAX_FRAME = 512 * 2**20
_OP_FORWARD, _OP_CLOSE = 1, 2
# Rank 0 -> other ranks, per command: op, dtype code, ndim, pad, slot, three dims; then the input.
_CONTROL = struct.Struct("<BBBBI3I")
_WIRE_CODES = {"int32": 1, "float32": 2, "float16": 3, "bfloat16": 4}
_CODE_WIRE = {code: name for name, code in _WIRE_CODES.items()}
_ITEMSIZE = {"int32": 4, "float32": 4, "float16": 2, "bfloat16": 2}
_HELLO = struct.Struct("<I32s")  # rank, HMAC-SHA256 proving the cluster key
SECRET_ENV = "MESHNODE_GROUP_SECRET"


class TensorGroupError(RuntimeError):
    """The group's worker failed, exited or missed its deadline."""


# --------------------------------------------------------------------------- framing


def write_frame(stream: BinaryIO, msg) -> None:
    data = msg.SerializeToString()
    stream.write(LENGTH.pack(len(data)) + data)
    stream.flush()


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError("pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(stream: BinaryIO, cls):
    (n,) = LENGTH.unpack(_read_exact(stream, LENGTH.size))
    if n > MAX_FRAME:
        raise TensorGroupError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    msg = cls()
    msg.ParseFromString(_read_exact(stream, n))
    return msg


# --------------------------------------------------------------------------- the worker


class _Worker:
    """Runs the shard on every rank in lockstep; rank 0 takes commands from its node and hands
    each one to the other ranks over the group's control connections before running it."""

    def __init__(self, shard, group, peers: list[socket.socket]):
        self.shard = shard
        self.group = group
        self.peers = peers  # rank 0: one control connection per other rank
        self.caches: dict[int, list[Any]] = {}

    def step(self, op: int, slot: int, x: mx.array | None) -> mx.array | None:
        """One command, run identically on every rank."""
        if op == _OP_CLOSE:
            self.caches.pop(slot, None)
            return None
        cache = self.caches.get(slot)
        if cache is None:
            cache = self.caches[slot] = self.shard.make_cache()
        out = self.shard.forward(x, cache)
        if self.shard.spec.is_last:
            out = out[:, -1:, :]
        mx.eval(out)
        return out

    def _tell(self, op: int, slot: int, tensor: mesh_pb2.Tensor | None = None) -> None:
        if tensor is None:
            frame = _CONTROL.pack(op, 0, 0, 0, slot, 0, 0, 0)
        else:
            dims = list(tensor.shape) + [0] * (3 - len(tensor.shape))
            frame = _CONTROL.pack(op, _WIRE_CODES[tensor.dtype], len(tensor.shape), 0, slot, *dims) + tensor.data
        for peer in self.peers:
            peer.sendall(frame)

    def lead(self, inp: BinaryIO, out: BinaryIO) -> None:
        while True:
            try:
                cmd = read_frame(inp, mesh_pb2.WorkerCommand)
            except EOFError:
                return  # the node is done with this group: closing the connections stops the rest
            if cmd.op == mesh_pb2.WorkerCommand.CLOSE:
                self._tell(_OP_CLOSE, cmd.slot)
                self.step(_OP_CLOSE, cmd.slot, None)
                continue
            try:
                x = from_tensor(cmd.input, dtypes=("int32",) if self.shard.spec.is_first else
                                (_name(self.shard.dtype),))
                if x.ndim != (2 if self.shard.spec.is_first else 3):
                    raise WireError(f"bad input shape {x.shape}")
            except WireError as exc:
                write_frame(out, mesh_pb2.WorkerReply(error=f"bad input: {exc}"))
                continue
            self._tell(_OP_FORWARD, cmd.slot, cmd.input)
            result = self.step(_OP_FORWARD, cmd.slot, x)
            write_frame(out, mesh_pb2.WorkerReply(output=to_tensor(result)))

    def follow(self, leader: socket.socket) -> None:
        stream = leader.makefile("rb")
        while True:
            try:
                op, code, ndim, _, slot, *dims = _CONTROL.unpack(_read_exact(stream, _CONTROL.size))
            except EOFError:
                return  # rank 0 stopped
            if op == _OP_CLOSE:
                self.step(op, slot, None)
                continue
            if op != _OP_FORWARD or code not in _CODE_WIRE or ndim not in (2, 3) or any(d <= 0 for d in dims[:ndim]):
                raise TensorGroupError(f"unexpected command {(op, code, ndim, slot, *dims)}")
            name = _CODE_WIRE[code]
            tensor = mesh_pb2.Tensor(dtype=name, shape=dims[:ndim])
            nbytes = _ITEMSIZE[name] * math.prod(dims[:ndim])
            if nbytes > MAX_FRAME:
                raise TensorGroupError(f"command of {nbytes} bytes exceeds {MAX_FRAME}")
            tensor.data = _read_exact(stream, nbytes)
            self.step(op, slot, from_tensor(tensor))


def _hello_mac(secret: bytes, group_id: str, rank: int) -> bytes:
    return hmac.new(secret, f"meshnode-tensor-group|{group_id}|{rank}".encode(), hashlib.sha256).digest()


def _accept_followers(server: socket.socket, size: int, secret: bytes, group_id: str) -> list[socket.socket]:
    """Rank 0: one authenticated control connection from every other rank, in rank order."""
    peers: dict[int, socket.socket] = {}
    while len(peers) < size - 1:
        conn, addr = server.accept()
        conn.settimeout(10)
        try:
            hello = _read_exact(conn.makefile("rb"), _HELLO.size)
            rank, mac = _HELLO.unpack(hello)
        except (EOFError, OSError, struct.error):
            log.warning("dropped a control connection from %s: no hello", addr[0])
            conn.close()
            continue
        if not (0 < rank < size) or rank in peers or not hmac.compare_digest(mac, _hello_mac(secret, group_id, rank)):
            log.warning("refused a control connection from %s: not a member of this group", addr[0])
            conn.close()
            continue
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peers[rank] = conn
    return [peers[r] for r in sorted(peers)]


def _connect_leader(address: str, rank: int, secret: bytes, group_id: str, timeout: float = 60.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection((host, int(port)), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(_HELLO.pack(rank, _hello_mac(secret, group_id, rank)))
    return conn


def _name(dtype: mx.Dtype) -> str:
    return {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}[dtype]


def worker_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshnode.model.tensor")
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--start", required=True, type=int)
    parser.add_argument("--end", required=True, type=int)
    parser.add_argument("--backend", default="ring")
    parser.add_argument("--control", required=True, help="HOST:PORT where rank 0 takes the other ranks' commands")
    parser.add_argument("--inject-latency-us", type=float, default=0.0,
                        help="tests and benchmarks: every collective waits this long, as over a slower link")
    args = parser.parse_args(argv)
    die_with_parent()
    rank = int(os.environ.get("MLX_RANK", "0"))
    secret = bytes.fromhex(os.environ.pop(SECRET_ENV, ""))
    group_id = Path(os.environ["MLX_HOSTFILE"]).read_text().strip()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)-7s tensor-worker[{rank}]: %(message)s")
    # Frames go over the real stdout; nothing else may write there.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    inp = sys.stdin.buffer
    if rank != 0:  # a follower never reads commands: its node closing stdin means stop
        threading.Thread(target=lambda: (inp.read(), os._exit(0)), name="stdin-watch", daemon=True).start()
    server = None
    if rank == 0:  # listen before the ring forms, so the others find it once they have loaded
        host, port = args.control.rsplit(":", 1)
        server = socket.create_server((host, int(port)), reuse_port=False)

    from meshnode.model.shard import Shard

    if args.inject_latency_us > 0:
        _delay_collectives(args.inject_latency_us * 1e-6)
    group = mx.distributed.init(backend=args.backend, strict=True)
    shard = Shard(args.model, args.start, args.end, group=group)
    try:
        if rank == 0:
            peers = _accept_followers(server, group.size(), secret, group_id)
            server.close()
        else:
            leader = _connect_leader(args.control, rank, secret, group_id)
    except OSError as exc:
        log.error("tensor group could not connect its control channel: %s", exc)
        return 1
    info = {"rank": group.rank(), "size": group.size(), "dtype": _name(shard.dtype),
            "hidden_size": shard.hidden_size, "nbytes": shard.nbytes}
    write_frame(out, mesh_pb2.WorkerReply(info=json.dumps(info)))
    try:
        if rank == 0:
            _Worker(shard, group, peers).lead(inp, out)
        else:
            _Worker(shard, group, []).follow(leader)
    except (RuntimeError, OSError) as exc:  # the ring or the control channel lost a peer
        log.error("tensor group failed: %s", exc)
        return 1
    return 0


def _delay_collectives(seconds: float) -> None:
    """Make every collective of this process take ``seconds`` longer, as a link with that much more
    round-trip latency would (a 2-member ring all-reduce is one exchange each way). The sharded
    layers look ``mx.distributed.all_sum`` up at call time, so wrapping it there reaches them."""
    for name in ("all_sum", "all_gather"):
        original = getattr(mx.distributed, name)

        def delayed(x, *args, _original=original, **kwargs):
            out = _original(x, *args, **kwargs)
            mx.eval(out)
            time.sleep(seconds)
            return out

        setattr(mx.distributed, name, delayed)


# --------------------------------------------------------------------------- the node's side


class _Slot:
    """A request's KV cache in the worker; freeing it tells the worker (at its next command)."""

    def __init__(self, owner: "TensorShard", slot: int):
        self.slot = slot
        weakref.finalize(self, owner._closed.append, slot)


class TensorShard:
    """This node's member of a tensor-parallel group, run in a worker subprocess.

    Looks like a :class:`~meshnode.model.shard.Shard` to the stage server and the pipeline.
    Only rank 0 runs requests; the other members just keep their worker alive.
    """

    def __init__(
        self,
        model_path: str | Path,
        start: int,
        end: int,
        num_layers: int,
        *,
        rank: int,
        endpoints: Sequence[str],
        control: str,
        secret: bytes = b"",
        backend: str = "ring",
        hop_timeout: float = 2.0,
        prefill_allowance: float = 0.05,
        inject_latency: float = 0.0,
        members_alive: Callable[[], bool] | None = None,
    ):
        self.path = Path(model_path)
        self.spec = ShardSpec(start, end, num_layers)
        self.rank, self.endpoints, self.backend = rank, list(endpoints), backend
        self.control, self._secret = control, secret
        self.group_size = len(self.endpoints)
        self.hop_timeout, self.prefill_allowance = hop_timeout, prefill_allowance
        self.inject_latency = inject_latency  # seconds every collective waits (tests and benchmarks)
        # Every member's node heartbeats (the control plane): a step is then waited for however long
        # it takes, as a pipeline stage is. None: a fixed deadline per step (tests of the group alone).
        self.members_alive = members_alive
        self.dtype: mx.Dtype = mx.float32
        self.hidden_size: int | None = None
        self.nbytes = 0
        self._proc: subprocess.Popen | None = None
        self._hostfile: str | None = None
        self._lock = threading.Lock()
        self._closed: collections.deque[int] = collections.deque()
        self._next_slot = 0
        self._failed: str | None = None

    @property
    def start(self) -> int:
        return self.spec.start

    @property
    def end(self) -> int:
        return self.spec.end

    # ---------------------------------------------------------------- lifecycle
    def launch(self, ready_timeout: float) -> None:
        """Start the worker and wait until the group has formed and loaded (blocking)."""
        fd, self._hostfile = tempfile.mkstemp(prefix="meshnode-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[e] for e in self.endpoints], f)
        env = {**os.environ, "MLX_RANK": str(self.rank), "MLX_HOSTFILE": self._hostfile,
               SECRET_ENV: self._secret.hex()}
        cmd = [sys.executable, "-m", "meshnode.model.tensor", "--model", str(self.path),
               "--start", str(self.start), "--end", str(self.end), "--backend", self.backend,
               "--control", self.control]
        if self.inject_latency > 0:
            cmd += ["--inject-latency-us", str(self.inject_latency * 1e6)]
        log.info("starting tensor worker rank %d of %s for layers [%d, %d)", self.rank,
                 ",".join(self.endpoints), self.start, self.end)
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(env), bufsize=0)
        try:
            reply = self._read(ready_timeout, "forming the group and loading its layers")
        except BaseException:
            self.close()
            raise
        info = json.loads(reply.info)
        self.dtype = getattr(mx, info["dtype"])
        self.hidden_size = int(info["hidden_size"])
        self.nbytes = int(info["nbytes"])
        log.info("tensor worker rank %d ready: layers [%d, %d), %.1f MiB", self.rank, self.start, self.end,
                 self.nbytes / 2**20)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._failed is None

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        if self._hostfile:
            Path(self._hostfile).unlink(missing_ok=True)
            self._hostfile = None

    def _fail(self, why: str) -> TensorGroupError:
        self._failed = why
        log.error("tensor group for layers [%d, %d): %s; stopping its worker", self.start, self.end, why)
        self.close()
        return TensorGroupError(f"tensor group [{self.start}, {self.end}): {why}")

    def _read(self, timeout: float, doing: str, alive: Callable[[], bool] | None = None) -> mesh_pb2.WorkerReply:
        """The worker's next reply: within ``timeout``, or, given ``alive``, for as long as it holds
        (checked four times a second) and the worker runs."""
        proc = self._proc
        if proc is None:
            raise TensorGroupError(f"tensor group [{self.start}, {self.end}) is stopped")
        started = time.monotonic()
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], timeout if alive is None else 0.25)
            if ready:
                break
            if alive is None:
                raise self._fail(f"no answer within {timeout:.1f} s while {doing}")
            if not alive():
                raise self._fail(f"a member stopped heartbeating {time.monotonic() - started:.1f} s into {doing}")
            if proc.poll() is not None:
                break  # read_frame below reports the exit
        try:
            reply = read_frame(proc.stdout, mesh_pb2.WorkerReply)
        except (EOFError, OSError, TensorGroupError) as exc:
            raise self._fail(f"worker exited while {doing} ({exc}, exit code {proc.poll()})") from None
        if reply.error:
            raise TensorGroupError(f"tensor group [{self.start}, {self.end}): {reply.error}")
        return reply

    # ---------------------------------------------------------------- Shard interface
    def make_cache(self) -> _Slot:
        with self._lock:
            self._next_slot += 1
            return _Slot(self, self._next_slot)

    def forward(self, x: mx.array, cache: _Slot) -> mx.array:
        if self.rank != 0:
            raise TensorGroupError("only rank 0 of a tensor group runs requests")
        if x.dtype == mx.uint32:
            x = x.astype(mx.int32)
        mx.eval(x)
        positions = x.shape[1]
        with self._lock:
            if not self.alive():
                raise TensorGroupError(f"tensor group [{self.start}, {self.end}) is down: {self._failed or 'stopped'}")
            try:
                while self._closed:
                    write_frame(self._proc.stdin, mesh_pb2.WorkerCommand(op=mesh_pb2.WorkerCommand.CLOSE,
                                                                         slot=self._closed.popleft()))
                write_frame(self._proc.stdin, mesh_pb2.WorkerCommand(slot=cache.slot, input=to_tensor(x)))
            except OSError as exc:
                raise self._fail(f"worker pipe broke ({exc})") from None
            reply = self._read(self.hop_timeout + self.prefill_allowance * positions, "running a step",
                               self.members_alive)
        expect = (1, 1 if self.spec.is_last else positions, None)
        try:
            return from_tensor(reply.output, expect=expect)
        except WireError as exc:
            raise self._fail(f"bad output from the worker: {exc}") from None


if __name__ == "__main__":
    sys.exit(worker_main())
