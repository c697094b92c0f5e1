"""The node's gRPC server: the Mesh service of protos/mesh.proto, one handler per call.

Each call is signed with the cluster key and, with ``encrypt``, runs over mutual TLS; the
handlers only route each call to the part that owns it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.trust import tls

MAX_GRPC_MESSAGE = 64 * 2**20


class StageCalls(Protocol):
    """The serving side of the Forward stream (meshnode.transport.routing.StageRouter)."""

    def forward(
        self, requests: AsyncIterator[mesh_pb2.ForwardRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[mesh_pb2.ForwardReply]: ...


class FileCalls(Protocol):
    """The serving side of Manifest and Fetch (meshnode.weights.store.ModelStore)."""

    async def Manifest(
        self, request: mesh_pb2.ManifestRequest, context: grpc.aio.ServicerContext
    ) -> mesh_pb2.ModelManifest: ...

    def Fetch(
        self, request: mesh_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[mesh_pb2.Chunk]: ...


@dataclass
class Handlers:
    """Who answers which call (each a method of the part that owns it)."""

    heartbeat: Callable[[mesh_pb2.HeartbeatRequest, grpc.aio.ServicerContext], Awaitable[mesh_pb2.HeartbeatReply]]
    install: Callable[[mesh_pb2.Plan], mesh_pb2.InstallReply]
    goodbye: Callable[[str], None]
    generate: Callable[[mesh_pb2.GenerateRequest, grpc.aio.ServicerContext], AsyncIterator[mesh_pb2.GenerateReply]]
    stage_server: StageCalls
    store: FileCalls
    probe: Callable[[mesh_pb2.ProbeRequest], mesh_pb2.ProbeReply]  # meshnode.control.links.probe_reply
    probe_delay_s: float = 0.0  # injected latency (tests)


class MeshServicer(mesh_pb2_grpc.MeshServicer):
    """The Mesh gRPC service: routes each call to the part named in :class:`Handlers`."""

    def __init__(self, handlers: Handlers) -> None:
        self.h = handlers

    async def Heartbeat(
        self, request: mesh_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> mesh_pb2.HeartbeatReply:
        return await self.h.heartbeat(request, context)

    async def Install(self, request: mesh_pb2.Plan, context: grpc.aio.ServicerContext) -> mesh_pb2.InstallReply:
        return self.h.install(request)

    async def Leave(self, request: mesh_pb2.Goodbye, context: grpc.aio.ServicerContext) -> mesh_pb2.Ack:
        self.h.goodbye(request.node_id)
        return mesh_pb2.Ack()

    async def Forward(
        self, request_iterator: AsyncIterator[mesh_pb2.ForwardRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[mesh_pb2.ForwardReply]:
        async for reply in self.h.stage_server.forward(request_iterator, context):
            yield reply

    async def Probe(self, request: mesh_pb2.ProbeRequest, context: grpc.aio.ServicerContext) -> mesh_pb2.ProbeReply:
        if self.h.probe_delay_s:
            await asyncio.sleep(self.h.probe_delay_s)
        return self.h.probe(request)

    async def Generate(
        self, request: mesh_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[mesh_pb2.GenerateReply]:
        async for reply in self.h.generate(request, context):
            yield reply

    async def Manifest(
        self, request: mesh_pb2.ManifestRequest, context: grpc.aio.ServicerContext
    ) -> mesh_pb2.ModelManifest:
        return await self.h.store.Manifest(request, context)

    async def Fetch(
        self, request: mesh_pb2.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[mesh_pb2.Chunk]:
        async for chunk in self.h.store.Fetch(request, context):
            yield chunk


async def start_server(
    handlers: Handlers,
    host: str,
    port: int,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    identity: tls.TlsIdentity | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Listen on ``host:port`` (0: any free port); returns the server and the port it got."""
    options = [
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE),
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE),
    ]
    server = grpc.aio.server(options=options, interceptors=list(interceptors))
    mesh_pb2_grpc.add_MeshServicer_to_server(MeshServicer(handlers), server)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, tls.server_credentials(identity))
        if identity
        else server.add_insecure_port(address)
    )
    if not bound:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    return server, bound
