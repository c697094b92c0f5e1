"""The worker process of a tensor-parallel group (see meshnode.model.tensor).

Each member loads its share of the layers and runs commands in lockstep; rank 0 relays its node's
commands to the others.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import logging
import math
import os
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import mlx.core as mx

from meshnode.errors import MeshnodeError
from meshnode.model.lifeline import die_with_parent
from meshnode.model.prefixes import copy_cut, cut_to, distinct
from meshnode.model.rewind import CannotRewind, rewind_limit, rewind_owned
from meshnode.model.wire import ACTIVATIONS, LENGTH, WireError, from_tensor, to_tensor
from meshnode.proto import mesh_pb2
from meshnode.weights.weightfiles import ITEMSIZE

if TYPE_CHECKING:
    from google.protobuf.message import Message

    from meshnode.model.shard import Shard

log = logging.getLogger(__name__)

MAX_FRAME = 512 * 2**20
_OP_FORWARD, _OP_CLOSE, _OP_KEEP, _OP_RESUME, _OP_FORGET, _OP_REWIND = 1, 2, 3, 4, 5, 6
_ALL_POSITIONS = 1  # a FORWARD's flag: the last stage answers every position
# The prompt cache's commands: (proto op, control op); dims[0] carries the prefix, dims[1] positions.
_PREFIX_OPS = {
    mesh_pb2.WorkerCommand.KEEP: _OP_KEEP,
    mesh_pb2.WorkerCommand.RESUME: _OP_RESUME,
    mesh_pb2.WorkerCommand.FORGET: _OP_FORGET,
}
# Rank 0 -> other ranks, per command: op, dtype code, ndim, flags, slot, three dims; then the input.
_CONTROL = struct.Struct("<BBBBI3I")
_WIRE_CODES = {"int32": 1, "float32": 2, "float16": 3, "bfloat16": 4}
_CODE_WIRE = {code: name for name, code in _WIRE_CODES.items()}
_HELLO = struct.Struct("<I32s")  # rank, HMAC-SHA256 proving the cluster key
SECRET_ENV = "MESHNODE_GROUP_SECRET"


class TensorGroupError(MeshnodeError, RuntimeError):
    """The group's worker failed, exited or missed its deadline."""


# --------------------------------------------------------------------------- framing


_Msg = TypeVar("_Msg", bound="Message")


def write_frame(stream: BinaryIO, msg: Message) -> None:
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


def read_frame(stream: BinaryIO, cls: type[_Msg]) -> _Msg:
    (n,) = LENGTH.unpack(_read_exact(stream, LENGTH.size))
    if n > MAX_FRAME:
        raise TensorGroupError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    msg: _Msg = cls()
    msg.ParseFromString(_read_exact(stream, n))
    return msg


# --------------------------------------------------------------------------- the worker


class _Worker:
    """Runs the shard on every rank in lockstep; rank 0 relays its node's commands to the other ranks."""

    def __init__(self, shard: Shard, group: mx.distributed.Group, peers: list[socket.socket]):
        self.shard = shard
        self.group = group
        self.peers = peers  # rank 0: one control connection per other rank
        self.caches: dict[int, list[Any]] = {}
        self.kept: dict[int, list[Any]] = {}  # prefixes kept (the prompt cache), by the node's number

    def prefix_op(self, op: int, slot: int, kept: int, positions: int) -> str:
        """KEEP, RESUME or FORGET, identically on every rank; '' when done, else why not."""
        if op == _OP_FORGET:
            self.kept.pop(kept, None)
            return ""
        if op == _OP_KEEP:
            cache = self.caches.pop(slot, None)
            if cache is None:
                return f"slot {slot} is not open"
            why = cut_to(cache, positions)
            if not why:
                mx.eval([c.state for c in distinct(cache)])
                self.kept[kept] = cache
            return why
        source = self.kept.get(kept)
        if source is None:
            return "not kept here"
        mine, why = copy_cut(source, positions)
        if mine is not None:
            self.caches[slot] = mine
        return why

    def rewind(self, slot: int, positions: int) -> str:
        """Drop the last ``positions`` of slot's KV on every rank; '' when done, else why not."""
        cache = self.caches.get(slot)
        try:
            if cache is not None:
                rewind_owned(self.shard.owned(cache), positions)
        except CannotRewind as exc:
            return str(exc)
        return ""

    def close(self, slot: int) -> None:
        """CLOSE, identically on every rank: drop the slot's KV."""
        self.caches.pop(slot, None)

    def step(self, slot: int, x: mx.array, flags: int = 0) -> mx.array:
        """One FORWARD, run identically on every rank."""
        cache = self.caches.get(slot)
        if cache is None:
            cache = self.caches[slot] = self.shard.make_cache()
        out = self.shard.forward(x, cache)
        if self.shard.spec.is_last and not flags & _ALL_POSITIONS:
            out = out[:, -1:, :]
        mx.eval(out)
        return out

    def _tell(
        self, op: int, slot: int, tensor: mesh_pb2.Tensor | None = None, dims: Sequence[int] = (), flags: int = 0
    ) -> None:
        if tensor is None:
            frame = _CONTROL.pack(op, 0, 0, 0, slot, *(list(dims) + [0] * (3 - len(dims))))
        else:
            dims = list(tensor.shape) + [0] * (3 - len(tensor.shape))
            frame = _CONTROL.pack(op, _WIRE_CODES[tensor.dtype], len(tensor.shape), flags, slot, *dims) + tensor.data
        for peer in self.peers:
            peer.sendall(frame)

    def watch_members(self) -> None:
        """Rank 0: followers never write after their hello, so a readable control connection means the
        ring is broken; exit at once. An idle group sends no commands, so :meth:`lead` would not notice."""
        if not self.peers:
            return
        readable, _, _ = select.select(self.peers, [], [])
        rank = 1 + self.peers.index(readable[0])
        # A warning: when a plan retires the group, a member's node may just close first.
        log.warning("rank %d's worker left the group; stopping", rank)
        os._exit(1)

    def lead(self, inp: BinaryIO, out: BinaryIO) -> None:
        threading.Thread(target=self.watch_members, name="members-watch", daemon=True).start()
        while True:
            try:
                cmd = read_frame(inp, mesh_pb2.WorkerCommand)
            except EOFError:
                return  # the node is done with this group: closing the connections stops the rest
            if cmd.op == mesh_pb2.WorkerCommand.CLOSE:
                self._tell(_OP_CLOSE, cmd.slot)
                self.close(cmd.slot)
                continue
            if cmd.op in _PREFIX_OPS:
                op = _PREFIX_OPS[cmd.op]
                self._tell(op, cmd.slot, dims=(cmd.kept, cmd.positions))
                why = self.prefix_op(op, cmd.slot, cmd.kept, cmd.positions)
                if op != _OP_FORGET:  # FORGET goes out unanswered, as CLOSE does
                    write_frame(out, mesh_pb2.WorkerReply(error=why))
                continue
            try:
                x = from_tensor(cmd.input, dtypes=("int32",) if self.shard.spec.is_first else ACTIVATIONS)
                if x.ndim != (2 if self.shard.spec.is_first else 3):
                    raise WireError(f"bad input shape {x.shape}")
            except WireError as exc:
                write_frame(out, mesh_pb2.WorkerReply(error=f"bad input: {exc}"))
                continue
            if cmd.rewind:
                why = self.rewind(cmd.slot, cmd.rewind)  # the same answer on every rank: told only when done
                if why:
                    write_frame(out, mesh_pb2.WorkerReply(error=why))
                    continue
                self._tell(_OP_REWIND, cmd.slot, dims=(cmd.rewind,))
            flags = _ALL_POSITIONS if cmd.all_positions else 0
            self._tell(_OP_FORWARD, cmd.slot, cmd.input, flags=flags)
            result = self.step(cmd.slot, x, flags)
            write_frame(out, mesh_pb2.WorkerReply(output=to_tensor(result)))

    def follow(self, leader: socket.socket) -> None:
        stream = leader.makefile("rb")
        while True:
            try:
                op, code, ndim, flags, slot, *dims = _CONTROL.unpack(_read_exact(stream, _CONTROL.size))
            except EOFError:
                return  # rank 0 stopped
            if op == _OP_CLOSE:
                self.close(slot)
                continue
            if op in (_OP_KEEP, _OP_RESUME, _OP_FORGET):
                self.prefix_op(op, slot, dims[0], dims[1])
                continue
            if op == _OP_REWIND:
                self.rewind(slot, dims[0])
                continue
            if op != _OP_FORWARD or code not in _CODE_WIRE or ndim not in (2, 3) or any(d <= 0 for d in dims[:ndim]):
                raise TensorGroupError(f"unexpected command {(op, code, ndim, slot, *dims)}")
            name = _CODE_WIRE[code]
            tensor = mesh_pb2.Tensor(dtype=name, shape=dims[:ndim])
            nbytes = ITEMSIZE[name] * math.prod(dims[:ndim])
            if nbytes > MAX_FRAME:
                raise TensorGroupError(f"command of {nbytes} bytes exceeds {MAX_FRAME}")
            tensor.data = _read_exact(stream, nbytes)
            self.step(slot, from_tensor(tensor), flags)


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
    parser.add_argument("--kv-bits", type=int, default=0, help="the plan's quantized KV cache (0: not quantized)")
    parser.add_argument(
        "--inject-latency-us",
        type=float,
        default=0.0,
        help="tests and benchmarks: every collective waits this long, as over a slower link",
    )
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
    shard.kv_bits = args.kv_bits  # each rank quantizes its share of the heads, in groups along head_dim
    try:
        if server is not None:  # rank 0
            peers = _accept_followers(server, group.size(), secret, group_id)
            server.close()
        else:
            leader = _connect_leader(args.control, rank, secret, group_id)
    except OSError as exc:
        log.error("tensor group could not connect its control channel: %s", exc)
        return 1
    limit, why = rewind_limit(shard.cache_template())
    info = {
        "rank": group.rank(),
        "size": group.size(),
        "dtype": _name(shard.dtype),
        "hidden_size": shard.hidden_size,
        "nbytes": shard.nbytes,
        "rewind_limit": limit,
        "rewind_problem": why,
    }
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
    """Make every collective take ``seconds`` longer, by wrapping ``mx.distributed.all_sum``
    (looked up at call time by the sharded layers)."""
    for name in ("all_sum", "all_gather"):
        original = getattr(mx.distributed, name)

        def delayed(x: mx.array, *args: Any, _original: Callable[..., mx.array] = original, **kwargs: Any) -> mx.array:
            out = _original(x, *args, **kwargs)
            mx.eval(out)
            time.sleep(seconds)
            return out

        setattr(mx.distributed, name, delayed)


if __name__ == "__main__":
    sys.exit(worker_main())
