"""Tensor parallelism: a group of nodes shares every layer of a stage over ``mx.distributed``.

``mx.distributed`` keeps its group for a process's life, so each member runs in a worker subprocess
started per plan. The ring has no timeouts: every call on the worker has a deadline, and a worker
that misses it is killed. Rank 0's node drives its worker over stdin/stdout frames; that worker
hands each command to the others over HMAC-checked TCP control connections. The ring's own
connections are plain TCP without authentication (MLX's backend).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, cast

import mlx.core as mx

from meshnode.model.layer_shard import ShardSpec
from meshnode.model.lifeline import child_env
from meshnode.model.tensor_worker import SECRET_ENV, TensorGroupError, read_frame, write_frame
from meshnode.model.wire import WireError, from_tensor, to_tensor
from meshnode.proto import mesh_pb2

__all__ = ["TensorGroupError", "TensorShard"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the node's side


class _Slot:
    """A request's KV cache in the worker; freeing it tells the worker (at its next command)."""

    def __init__(self, owner: TensorShard, slot: int):
        self.slot = slot
        self._owner = owner
        self.rewind = 0  # positions the worker drops before this slot's next step
        weakref.finalize(self, owner._closed.append, (mesh_pb2.WorkerCommand.CLOSE, slot))

    def keep_as_prefix(self, positions: int) -> tuple[_Kept | None, str]:
        """The worker keeps this request's KV cut to ``positions``; the handle stands for it."""
        return self._owner.keep(self, positions)


class _Kept:
    """A prefix kept in the worker; dropping the handle (the store evicting it) tells the worker."""

    def __init__(self, owner: TensorShard, number: int):
        self.number = number
        self.owner = owner
        weakref.finalize(self, owner._closed.append, (mesh_pb2.WorkerCommand.FORGET, number))

    def resume(self, positions: int) -> tuple[_Slot | None, str]:
        return self.owner.resume(self, positions)


class TensorShard:
    """This node's member of a tensor-parallel group, run in a worker subprocess; looks like a Shard.

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
        kv_bits: int = 0,
        members_alive: Callable[[], bool] | None = None,
    ):
        self.path = Path(model_path)
        self.spec = ShardSpec(start, end, num_layers)
        self.rank, self.endpoints, self.backend = rank, list(endpoints), backend
        self.control, self._secret = control, secret
        self.group_size = len(self.endpoints)
        self.hop_timeout, self.prefill_allowance = hop_timeout, prefill_allowance
        self.inject_latency = inject_latency  # seconds every collective waits (tests)
        self.kv_bits = kv_bits  # 0: not quantized
        # Whether every member heartbeats: a step is waited for while they do (None: a fixed deadline).
        self.members_alive = members_alive
        self.dtype: mx.Dtype = mx.float32
        self.hidden_size = 0  # known once launched
        self.nbytes = 0
        self.rewind_limit: tuple[int | None, str] = (0, "the group's worker has not started")
        self._proc: subprocess.Popen[bytes] | None = None
        self._hostfile: str | None = None
        self._lock = threading.Lock()
        # (CLOSE or FORGET, number) dropped, told to the worker with its next command.
        self._closed: collections.deque[tuple[mesh_pb2.WorkerCommand.Op, int]] = collections.deque()
        self._next_slot = self._next_kept = 0
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
        env = {**os.environ, "MLX_RANK": str(self.rank), "MLX_HOSTFILE": self._hostfile, SECRET_ENV: self._secret.hex()}
        cmd = [
            sys.executable,
            "-m",
            "meshnode.model.tensor_worker",
            "--model",
            str(self.path),
            "--start",
            str(self.start),
            "--end",
            str(self.end),
            "--backend",
            self.backend,
            "--control",
            self.control,
        ]
        if self.kv_bits:
            cmd += ["--kv-bits", str(self.kv_bits)]
        if self.inject_latency > 0:
            cmd += ["--inject-latency-us", str(self.inject_latency * 1e6)]
        log.info(
            "starting tensor worker rank %d of %s for layers [%d, %d)",
            self.rank,
            ",".join(self.endpoints),
            self.start,
            self.end,
        )
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
        limit = info.get("rewind_limit")
        self.rewind_limit = (None if limit is None else int(limit), str(info.get("rewind_problem", "")))
        log.info(
            "tensor worker rank %d ready: layers [%d, %d), %.1f MiB",
            self.rank,
            self.start,
            self.end,
            self.nbytes / 2**20,
        )

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
                    if stream is not None:
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
        """The worker's next reply: within ``timeout``, or, given ``alive``, while it holds and the worker runs."""
        proc = self._proc
        if proc is None:
            raise TensorGroupError(f"tensor group [{self.start}, {self.end}) is stopped")
        out = cast(BinaryIO, proc.stdout)  # a pipe: the worker starts with stdout=PIPE
        started = time.monotonic()
        while True:
            ready, _, _ = select.select([out], [], [], timeout if alive is None else 0.25)
            if ready:
                break
            if alive is None:
                raise self._fail(f"no answer within {timeout:.1f} s while {doing}")
            if not alive():
                raise self._fail(f"a member stopped heartbeating {time.monotonic() - started:.1f} s into {doing}")
            if proc.poll() is not None:
                break  # read_frame below reports the exit
        try:
            reply = read_frame(out, mesh_pb2.WorkerReply)
        except (EOFError, OSError, TensorGroupError) as exc:
            raise self._fail(f"worker exited while {doing} ({exc}, exit code {proc.poll()})") from None
        if reply.error:
            raise TensorGroupError(f"tensor group [{self.start}, {self.end}): {reply.error}")
        return reply

    # ---------------------------------------------------------------- the prompt cache
    @property
    def keeps_prefixes(self) -> bool:
        return self.rank == 0  # rank 0's node drives the group, its store counts the kept prefixes

    def keep(self, cache: _Slot, positions: int) -> tuple[_Kept | None, str]:
        with self._lock:
            self._next_kept += 1
            kept = _Kept(self, self._next_kept)
            why = self._prefix_command(
                mesh_pb2.WorkerCommand(
                    op=mesh_pb2.WorkerCommand.KEEP, slot=cache.slot, kept=kept.number, positions=positions
                )
            )
        return (None, why) if why else (kept, "")

    def resume(self, kept: _Kept, positions: int) -> tuple[_Slot | None, str]:
        slot = self.make_cache()
        with self._lock:
            why = self._prefix_command(
                mesh_pb2.WorkerCommand(
                    op=mesh_pb2.WorkerCommand.RESUME, slot=slot.slot, kept=kept.number, positions=positions
                )
            )
        return (None, why) if why else (slot, "")

    def _prefix_command(self, cmd: mesh_pb2.WorkerCommand) -> str:
        """Send a KEEP or RESUME (under the lock); the worker's answer: '' or why not."""
        if not self.alive():
            return f"tensor group [{self.start}, {self.end}) is down"
        try:
            self._send_closed()
            write_frame(self._stdin(), cmd)
        except OSError as exc:
            raise self._fail(f"worker pipe broke ({exc})") from None
        try:
            self._read(self.hop_timeout, "keeping or resuming a prefix", self.members_alive)
        except TensorGroupError as exc:
            if not self.alive():
                raise
            return str(exc)  # the worker's refusal (a reply with an error), the group is fine
        return ""

    def _stdin(self) -> BinaryIO:
        """The running worker's command pipe."""
        assert self._proc is not None and self._proc.stdin is not None, "the worker runs"
        return cast(BinaryIO, self._proc.stdin)

    def _send_closed(self) -> None:
        """Tell the worker of the slots and prefixes dropped since the last command (under the lock)."""
        while self._closed:
            op, number = self._closed.popleft()
            if op == mesh_pb2.WorkerCommand.CLOSE:
                cmd = mesh_pb2.WorkerCommand(op=op, slot=number)
            else:
                cmd = mesh_pb2.WorkerCommand(op=op, kept=number)
            write_frame(self._stdin(), cmd)

    # ---------------------------------------------------------------- Shard interface
    def make_cache(self, owned: list[Any] | None = None) -> _Slot:
        if owned is not None:
            raise ValueError("a tensor group's caches live in its workers")  # disk_template() is None
        with self._lock:
            self._next_slot += 1
            return _Slot(self, self._next_slot)

    def rewind(self, cache: _Slot, positions: int) -> None:
        """Drop the last ``positions`` of the slot's KV on every rank, with its next step."""
        cache.rewind += max(positions, 0)

    def owned(self, cache: _Slot) -> None:
        return None  # its workers hold the caches

    def disk_template(self) -> None:
        return None  # each worker holds its share of a kept cache

    def build_ahead(self, cache: _Slot) -> None:
        return None  # its workers run the step, so nothing is built here

    def forward(self, x: mx.array, cache: _Slot, all_positions: bool = False) -> mx.array:
        """``all_positions``: the last stage answers with every position's logits."""
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
                self._send_closed()
                write_frame(
                    self._stdin(),
                    mesh_pb2.WorkerCommand(
                        slot=cache.slot, input=to_tensor(x), rewind=cache.rewind, all_positions=all_positions
                    ),
                )
                cache.rewind = 0
            except OSError as exc:
                raise self._fail(f"worker pipe broke ({exc})") from None
            reply = self._read(
                self.hop_timeout + self.prefill_allowance * positions, "running a step", self.members_alive
            )
        expect = (1, 1 if self.spec.is_last and not all_positions else positions, None)
        try:
            return from_tensor(reply.output, expect=expect)
        except WireError as exc:
            raise self._fail(f"bad output from the worker: {exc}") from None
