"""Which model's stage server a stream is for: a stream's opening names its model ("" = the first).

A model not served here yet is refused as pending.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from meshnode.errors import abort
from meshnode.proto import mesh_pb2
from meshnode.transport.hop import RunHere, StreamHook, refuse, serve_forward
from meshnode.transport.lockstep_hop import serve_lockstep
from meshnode.transport.refusals import STATUS, InvalidInput, StagePending

if TYPE_CHECKING:
    from meshnode.transport.stage_server import StageServer

log = logging.getLogger(__name__)


def not_served(model: str) -> StagePending:
    return StagePending(f"model {model!r} is not served here (yet)")


class StageRouter:
    """The node's stage servers by model, for gRPC Forward streams and data-port streams."""

    def __init__(
        self,
        server_of: Callable[[str], StageServer | None],
        run_here: RunHere,
        *,
        stream_hook: StreamHook | None = None,
    ) -> None:
        """``stream_hook``: a test harness's, on every request's data-port stream."""
        self._server_of, self._run_here, self._stream_hook = server_of, run_here, stream_hook

    async def forward(
        self, requests: AsyncIterator[mesh_pb2.ForwardRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[mesh_pb2.ForwardReply]:
        """A gRPC Forward stream: its first message names the model; the rest follow it there."""
        stream = requests.__aiter__()
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return
        except DecodeError:
            await context.abort(STATUS[InvalidInput], "malformed ForwardRequest")
        server = self._server_of(first.model)
        if server is None:
            refusal = not_served(first.model)
            await abort(context, refusal.code, str(refusal))

        async def again() -> AsyncIterator[mesh_pb2.ForwardRequest]:
            yield first
            async for msg in stream:
                yield msg

        async for reply in server.forward(again(), context):
            yield reply

    def data(self, conn: socket.socket, opening: mesh_pb2.DataOpen, host: str) -> None:
        """A data-port stream (one request's, or several requests' decode steps in lockstep)."""
        server = self._server_of(opening.forward.model)
        if server is None:
            refuse(conn, not_served(opening.forward.model))
            return
        if opening.forward.lockstep:
            serve_lockstep(server, self._run_here, conn, opening, host)
        else:
            serve_forward(server, self._run_here, conn, opening, host, hook=self._stream_hook)
