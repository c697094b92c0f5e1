"""Lockstep decode steps over the data port: one frame carries a token's step for several requests.

Each frame's ``members`` name the step's requests, one row each; every member keeps its own
data-port stream, where its cache lives. The rows run as one forward over the merged caches and
come back as one raw reply.
"""

from __future__ import annotations

import logging
import socket
import time
from functools import partial
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from google.protobuf.message import DecodeError

from meshnode.model.decode_batch import DecodeBatch, batchable_shard
from meshnode.model.scheduler import mlx_idle
from meshnode.model.wire import (
    ACTIVATIONS,
    RawReply,
    WireError,
    check_tokens,
    host_array,
    raw_reply_into,
    to_array,
    to_tensor,
)
from meshnode.proto import mesh_pb2
from meshnode.transport.dataport import HEADER, FrameError, connect, recv_frame, send_frame, send_prepared
from meshnode.transport.hop import FRAME_STALL, IDLE_TIMEOUT, RunHere, _yield, lost, read_reply, refuse, stream_key
from meshnode.transport.refusals import InvalidInput, StageError, StageFault, StageRefused

if TYPE_CHECKING:
    from meshnode.model.layer_shard import LayerShard
    from meshnode.model.shard import Shard
    from meshnode.transport.remote_stage import RemoteStage
    from meshnode.transport.stage_server import OpenStage, StageServer
    from meshnode.trust.auth import ClusterAuth

log = logging.getLogger(__name__)

MAX_ROWS = 256  # requests in one step


# --------------------------------------------------------------------------- serving side


def serve_lockstep(
    server: StageServer, run_here: RunHere, conn: socket.socket, opening: mesh_pb2.DataOpen, host: str
) -> None:
    """Serve one head's batched decode steps to one stage until the head closes the stream."""
    try:
        shard = _batchable(server.shard_for(opening.forward))
    except StageError as refusal:
        refuse(conn, refusal)
        return
    batch = server.batches[id(conn)] = DecodeBatch(shard.make_cache)  # this stream's micro-batch
    conn.settimeout(IDLE_TIMEOUT)
    try:
        _serve_steps(server, run_here, conn, shard, batch, host)
    finally:
        del server.batches[id(conn)]
        if len(batch):  # its members' caches back to them
            run_here(batch.release_all)


def _serve_steps(
    server: StageServer, run_here: RunHere, conn: socket.socket, shard: Shard, batch: DecodeBatch, host: str
) -> None:
    out = bytearray()  # raw replies are written here, step after step
    while True:
        try:
            frame = recv_frame(conn)
            if frame is None:
                return  # the head is done batching here
            msg = mesh_pb2.ForwardRequest.FromString(bytes(frame))
        except (FrameError, DecodeError) as exc:
            log.warning("refused a malformed batch frame from %s: %s", host, exc)
            refuse(conn, InvalidInput("malformed ForwardRequest"))
            return
        try:
            members = _members(server, shard, msg)
            rows = _rows(server, shard, msg.input, len(members))
            n = run_here(partial(_step, server, shard, batch, members, rows, msg.input.dtype, out))
        except StageError as refusal:
            if isinstance(refusal, InvalidInput):
                log.warning("refused a batched step from %s: %s", host, refusal)
            refuse(conn, refusal)
            return
        if server.inject_latency:
            time.sleep(server.inject_latency)
        send_prepared(conn, out, n)
        _yield()


def _batchable(shard: LayerShard) -> Shard:
    """``shard``, where its requests can step in a batch here; else a refusal."""
    if not batchable_shard(shard):
        spec = shard.spec
        raise StageRefused(f"layers [{spec.start}, {spec.end}) hold caches that cannot be batched here")
    return shard


def _members(server: StageServer, shard: Shard, msg: mesh_pb2.ForwardRequest) -> list[OpenStage]:
    ids = list(msg.members)
    if not ids or len(ids) > MAX_ROWS or len(set(ids)) != len(ids):
        raise InvalidInput(f"a batched step names 1 to {MAX_ROWS} distinct requests, not {len(ids)}")
    spec, members = shard.spec, []
    for rid in ids:
        stage = server.streams.get(stream_key(rid, spec.start, spec.end))
        if stage is None or stage.shard is not shard:
            raise StageRefused(f"request {rid[:64]} has no open stream to layers [{spec.start}, {spec.end}) here")
        members.append(stage)
    return members


def _rows(server: StageServer, shard: Shard, tensor: mesh_pb2.Tensor, n: int) -> np.ndarray:
    try:
        if shard.spec.is_first:
            return check_tokens(tensor, server.vocab_size, server.max_chunk, expect=(n, 1))
        return host_array(tensor, dtypes=ACTIVATIONS, expect=(n, 1, shard.hidden_size))
    except WireError as exc:
        raise InvalidInput(str(exc)) from None


def _step(
    server: StageServer,
    shard: Shard,
    batch: DecodeBatch,
    members: list[OpenStage],
    rows: np.ndarray,
    dtype: str,
    buf: bytearray,
) -> int:
    """Run one batched step (on the MLX thread); its raw reply's length, written into ``buf``."""
    started = time.perf_counter()
    with server.steps.step(), batch.lock:
        if any(stage.prepared is not None for stage in members):
            raise StageRefused("a request that promised its next step on its own stream joined a batch")
        for stage in members:
            stage.admit(1)
        try:
            cache = batch.follow(members)
            out = shard.forward(to_array(rows, dtype), cache)
            mx.eval(out)
        except Exception as exc:  # noqa: BLE001 - the model raised on these rows: report it, keep serving
            raise server.fault(shard, "a batched step", f"a batched step of {len(members)} requests", exc) from None
    return raw_reply_into(buf, HEADER, out.reshape(1, len(members), -1), time.perf_counter() - started)


# --------------------------------------------------------------------------- head side


class LockstepHop:
    """The head's stream of batched decode steps to one remote stage, over its data port."""

    def __init__(self, stage: RemoteStage, host: str, port: int, *, auth: ClusterAuth, node_id: str):
        self._stage = stage
        opening = mesh_pb2.DataOpen(
            forward=mesh_pb2.ForwardRequest(
                epoch=stage.epoch,
                start_layer=stage.start,
                end_layer=stage.end,
                raw_replies=True,
                lockstep=True,
                model=stage.model,
            )
        )
        self._sock = connect(host, port, auth=auth, node_id=node_id, opening=opening, timeout=stage.hop_timeout)
        self._sock.settimeout(FRAME_STALL)  # a frame once started must go on
        self._closed = False

    def step(self, request_ids: list[str], x: mx.array) -> mx.array:
        """One decode step of ``request_ids`` (one row each): its output, ``[rows, 1, width]``."""
        if x.dtype == mx.uint32:
            x = x.astype(mx.int32)
        rows = len(request_ids)
        payload = mesh_pb2.ForwardRequest(input=to_tensor(x), members=request_ids).SerializeToString()
        sent = time.perf_counter()
        try:
            send_frame(self._sock, payload)
        except OSError as exc:
            raise self._lost(exc) from None
        _yield()
        with mlx_idle():
            reply = self._read(sent)
        st = self._stage
        if st.observe is not None:  # a decode step's hop, whatever the rows
            st.observe(time.perf_counter() - sent, 1, reply.stage_seconds, "tcp")
        try:
            host = reply.host(rows, st.hidden_size)
        except WireError as exc:
            raise StageFault(
                f"stage [{st.start}, {st.end}) on {st.node_id} sent a bad batched activation: {exc}"
            ) from None
        return to_array(host.reshape(rows, 1, st.hidden_size), reply.dtype)

    def _read(self, sent: float) -> RawReply:
        reply = read_reply(self._sock, self._stage, sent, stream="batch stream")
        if type(reply) is not RawReply:  # a step is always answered raw, or refused
            raise StageError(
                f"stage [{self._stage.start}, {self._stage.end}) on {self._stage.node_id} answered a "
                "batched step without an activation"
            )
        return reply

    def _lost(self, exc: BaseException) -> StageError:
        return lost(self._stage, exc, "batch stream")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
