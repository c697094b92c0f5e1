"""Cluster-key authentication of node-to-node gRPC calls (meshnode.trust.auth), over real
grpc.aio servers and clients on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.trust.auth import (
    HEADER_MAC,
    HEADER_NODE,
    HEADER_NONCE,
    HEADER_TS,
    ClusterAuth,
    _call_stream_response,
)
from meshnode.trust.signed import client_interceptors

KEY = "a long shared secret for the tests"
HEARTBEAT = "/meshnode.v1.Mesh/Heartbeat"
FORWARD = "/meshnode.v1.Mesh/Forward"
GENERATE = "/meshnode.v1.Mesh/Generate"


class EchoServicer(mesh_pb2_grpc.MeshServicer):
    def __init__(self):
        self.calls = 0
        self.generate_closed = asyncio.Event()

    async def Heartbeat(self, request, context):
        self.calls += 1
        return mesh_pb2.HeartbeatReply(node=request.node, epoch=request.epoch)

    async def Leave(self, request, context):
        self.calls += 1
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"no leave for {request.node_id}")

    async def Forward(self, request_iterator, context):
        self.calls += 1
        async for request in request_iterator:
            yield mesh_pb2.ForwardReply(output=request.input)

    async def Generate(self, request, context):
        self.calls += 1
        try:
            for token in request.prompt:
                yield mesh_pb2.GenerateReply(token=token)
            if request.max_tokens:  # "hang" until the client cancels
                await asyncio.sleep(60)
        finally:
            self.generate_closed.set()


class Server:
    def __init__(self, server, port, servicer, auth):
        self.server, self.port, self.servicer, self.auth = server, port, servicer, auth
        self.target = f"127.0.0.1:{port}"

    def channel(self, auth: ClusterAuth | None = None, node_id: str = "node-a", extra=()):
        interceptors = (client_interceptors(auth, node_id) if auth is not None else []) + list(extra)
        return grpc.aio.insecure_channel(self.target, interceptors=interceptors or None)


@pytest.fixture
async def server():
    auth = ClusterAuth(KEY)
    srv = grpc.aio.server(interceptors=[auth.server_interceptor()])
    servicer = EchoServicer()
    mesh_pb2_grpc.add_MeshServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        yield Server(srv, port, servicer, auth)
    finally:
        await srv.stop(grace=None)


def heartbeat(epoch: int = 7) -> mesh_pb2.HeartbeatRequest:
    return mesh_pb2.HeartbeatRequest(node=mesh_pb2.NodeInfo(node_id="node-a", cluster_id="c"), epoch=epoch)


def forward_requests(n: int = 3):
    return [
        mesh_pb2.ForwardRequest(
            request_id="r", epoch=1, input=mesh_pb2.Tensor(dtype="int32", shape=[1], data=bytes([i]) * 4)
        )
        for i in range(n)
    ]


async def forward(channel, n: int = 3) -> list[mesh_pb2.ForwardReply]:
    """One message per round trip, as RemoteStage does (write, then read the reply)."""
    call = mesh_pb2_grpc.MeshStub(channel).Forward(timeout=5)
    replies = []
    for request in forward_requests(n):
        await call.write(request)
        replies.append(await call.read())
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return replies


async def assert_unauthenticated(coro) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    return info.value.details() or ""


async def assert_still_serving(server: Server) -> None:
    async with server.channel(ClusterAuth(KEY)) as channel:
        reply = await mesh_pb2_grpc.MeshStub(channel).Heartbeat(heartbeat(11), timeout=5)
        assert reply.epoch == 11
        assert [r.output.data for r in await forward(channel, 2)] == [b"\0" * 4, b"\1" * 4]


def raw_unary(channel, method: str = HEARTBEAT):
    return channel.unary_unary(method, request_serializer=None, response_deserializer=None)


# ---------------------------------------------------------------------------- good calls
async def test_right_key_unary_and_streams(server):
    async with server.channel(ClusterAuth(KEY), "node-a") as channel:
        stub = mesh_pb2_grpc.MeshStub(channel)
        reply = await stub.Heartbeat(heartbeat(7), timeout=5)
        assert reply.epoch == 7 and reply.node.node_id == "node-a"
        replies = await forward(channel, 3)
        assert [r.output.data for r in replies] == [bytes([i]) * 4 for i in range(3)]
        tokens = [r.token async for r in stub.Generate(mesh_pb2.GenerateRequest(prompt=[5, 6, 7]), timeout=5)]
        assert tokens == [5, 6, 7]
        with pytest.raises(grpc.aio.AioRpcError) as info:  # the servicer's own status passes through
            await stub.Leave(mesh_pb2.Goodbye(node_id="b"), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and info.value.details() == "no leave for b"
        for _ in range(5):  # fresh nonces every call
            assert (await stub.Heartbeat(heartbeat(1), timeout=5)).epoch == 1


async def test_open_cluster_works_with_open_cluster_only():
    auth = ClusterAuth(None)
    assert auth.open and ClusterAuth("").open and not ClusterAuth(KEY).open
    srv = grpc.aio.server(interceptors=[auth.server_interceptor()])
    mesh_pb2_grpc.add_MeshServicer_to_server(EchoServicer(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=client_interceptors(ClusterAuth(None), "x")
        ) as ch:
            assert (await mesh_pb2_grpc.MeshStub(ch).Heartbeat(heartbeat(3), timeout=5)).epoch == 3
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=client_interceptors(ClusterAuth(KEY), "x")
        ) as ch:
            await assert_unauthenticated(mesh_pb2_grpc.MeshStub(ch).Heartbeat(heartbeat(3), timeout=5))
    finally:
        await srv.stop(grace=None)


def test_key_not_exposed():
    auth = ClusterAuth(KEY)
    assert KEY not in repr(auth) and KEY not in str(vars(auth))
    assert ClusterAuth(KEY)._mac_key == auth._mac_key != ClusterAuth(KEY + "x")._mac_key


async def test_cancelled_stream_closes_servicer_generator(server):
    async with server.channel(ClusterAuth(KEY)) as channel:
        call = mesh_pb2_grpc.MeshStub(channel).Generate(mesh_pb2.GenerateRequest(prompt=[1], max_tokens=1))
        assert (await call.read()).token == 1
        call.cancel()
        await asyncio.wait_for(server.servicer.generate_closed.wait(), 5)
    await assert_still_serving(server)


# ---------------------------------------------------------------------------- refusals
async def test_wrong_key_refused(server, caplog):
    caplog.set_level(logging.WARNING, logger="meshnode.trust.auth")
    async with server.channel(ClusterAuth("another key"), "intruder") as channel:
        stub = mesh_pb2_grpc.MeshStub(channel)
        assert "mac" in await assert_unauthenticated(stub.Heartbeat(heartbeat(), timeout=5))
        await assert_unauthenticated(forward(channel))
        await assert_unauthenticated(stub.Generate(mesh_pb2.GenerateRequest(prompt=[1]), timeout=5).read())
    assert server.servicer.calls == 0
    # rate-limited: one log line for this peer host for all those refusals, no secrets in it
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1
    assert KEY not in caplog.text and "another key" not in caplog.text
    await assert_still_serving(server)


async def test_missing_metadata_refused(server):
    async with server.channel(None) as channel:
        stub = mesh_pb2_grpc.MeshStub(channel)
        assert "missing" in await assert_unauthenticated(stub.Heartbeat(heartbeat(), timeout=5))
        await assert_unauthenticated(forward(channel))
        # partial metadata: everything but the MAC
        md = [
            kv for kv in ClusterAuth(KEY).sign(HEARTBEAT, "a", heartbeat().SerializeToString()) if kv[0] != HEADER_MAC
        ]
        await assert_unauthenticated(stub.Heartbeat(heartbeat(), metadata=md, timeout=5))
    assert server.servicer.calls == 0
    await assert_still_serving(server)


class TamperingInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Signs with the right key, but over a different body than the one sent."""

    def __init__(self, auth: ClusterAuth, other_body: bytes):
        self.auth, self.other_body = auth, other_body

    async def intercept_unary_unary(self, continuation, details, request):
        md = grpc.aio.Metadata(*self.auth.sign(details.method, "node-a", self.other_body))
        details = grpc.aio.ClientCallDetails(
            details.method, details.timeout, md, details.credentials, details.wait_for_ready
        )
        return await continuation(details, request)


async def test_tampered_body_refused(server):
    signed = heartbeat(1).SerializeToString()
    async with server.channel(None, extra=[TamperingInterceptor(ClusterAuth(KEY), signed)]) as channel:
        stub = mesh_pb2_grpc.MeshStub(channel)
        assert "mac" in await assert_unauthenticated(stub.Heartbeat(heartbeat(2), timeout=5))
    # the same MAC with the body it was made for is accepted (the check is really over the body)
    async with server.channel(None) as channel:
        reply = await raw_unary(channel)(signed, metadata=ClusterAuth(KEY).sign(HEARTBEAT, "n", signed), timeout=5)
        assert mesh_pb2.HeartbeatReply.FromString(reply).epoch == 1
        # MAC made for another method
        md = ClusterAuth(KEY).sign("/meshnode.v1.Mesh/Leave", "n", signed)
        await assert_unauthenticated(raw_unary(channel)(signed, metadata=md, timeout=5))
    assert server.servicer.calls == 1
    await assert_still_serving(server)


async def test_stale_and_future_timestamps_refused(server):
    for skew in (-120.0, +120.0):
        auth = ClusterAuth(KEY, clock=lambda skew=skew: time.time() + skew)
        async with server.channel(auth) as channel:
            stub = mesh_pb2_grpc.MeshStub(channel)
            assert "window" in await assert_unauthenticated(stub.Heartbeat(heartbeat(), timeout=5))
            await assert_unauthenticated(forward(channel))
    # a small skew inside the window is fine
    async with server.channel(ClusterAuth(KEY, clock=lambda: time.time() - 10)) as channel:
        assert (await mesh_pb2_grpc.MeshStub(channel).Heartbeat(heartbeat(4), timeout=5)).epoch == 4
    await assert_still_serving(server)


class CaptureUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, seen: list):
        self.seen = seen

    async def intercept_unary_unary(self, continuation, details, request):
        self.seen.append(list(details.metadata))
        return await continuation(details, request)


class CaptureStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, seen: list):
        self.seen = seen

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        self.seen.append(list(details.metadata))
        return await continuation(details, request_iterator)


async def test_replay_refused(server):
    seen: list = []
    async with server.channel(ClusterAuth(KEY), "node-a", extra=[CaptureUnary(seen), CaptureStream(seen)]) as channel:
        assert (await mesh_pb2_grpc.MeshStub(channel).Heartbeat(heartbeat(9), timeout=5)).epoch == 9
        await forward(channel, 1)
    unary_md, stream_md = seen
    assert {k for k, _ in unary_md} >= {HEADER_TS, HEADER_NONCE, HEADER_NODE, HEADER_MAC}
    async with server.channel(None) as channel:
        body = heartbeat(9).SerializeToString()
        assert "replay" in await assert_unauthenticated(raw_unary(channel)(body, metadata=unary_md, timeout=5))
        call = channel.stream_stream(FORWARD)(
            iter([r.SerializeToString() for r in forward_requests(1)]), metadata=stream_md, timeout=5
        )
        assert "replay" in await assert_unauthenticated(call.read())
    assert server.servicer.calls == 2
    await assert_still_serving(server)


def test_replay_cache_bounded_and_expires():
    now = [1000.0]
    auth = ClusterAuth(KEY, window=30, max_nonces=3, clock=lambda: now[0])
    cache = auth._nonces
    assert cache.add("a", now[0]) and not cache.add("a", now[0])
    for n in "bcd":
        assert cache.add(n, now[0])
    assert len(cache) == 3 and cache.add("a", now[0])  # "a" was evicted (oldest first)
    now[0] += 61
    assert cache.add("b", now[0]) and len(cache) == 1  # the others expired


# ---------------------------------------------------------------------------- fuzz
_printable = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=80)
_hexish = st.text(st.sampled_from("0123456789abcdefABCDEF"), min_size=0, max_size=70)


def _value(header: str):
    plausible = {
        HEADER_TS: st.builds(lambda d: str(int(time.time() * 1000) + d), st.integers(-(10**6), 10**6)),
        HEADER_NONCE: st.builds(lambda b: b.hex(), st.binary(min_size=16, max_size=16)),
        HEADER_NODE: st.sampled_from(["node-a", "x" * 300]),
        HEADER_MAC: st.builds(lambda b: b.hex(), st.binary(min_size=32, max_size=32)),
    }[header]
    return st.one_of(_printable, _hexish, plausible)


_metadata = st.lists(
    st.sampled_from([HEADER_TS, HEADER_NONCE, HEADER_NODE, HEADER_MAC]).flatmap(
        lambda h: st.tuples(st.just(h), _value(h))
    ),
    max_size=6,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metadata=_metadata, body=st.binary(max_size=64), streaming=st.booleans())
async def test_random_metadata_always_unauthenticated(server, metadata, body, streaming):
    async with server.channel(None) as channel:
        if streaming:
            call = channel.stream_stream(FORWARD)(iter([body]), metadata=metadata, timeout=5)
            await assert_unauthenticated(call.read())
        else:
            await assert_unauthenticated(raw_unary(channel)(body, metadata=metadata, timeout=5))
    assert server.servicer.calls == 0


class _Pending:
    """An await that never resumes: a stream whose next item has not come."""

    def __await__(self):
        yield


def test_a_stream_handler_closed_mid_stream_awaits_nothing():
    # A server shutting down closes the coroutines of streams still open; a closed coroutine that
    # awaits (the servicer's aclose() while its __anext__ runs) raises instead of closing.
    async def servicer(request, context):
        await _Pending()
        yield b"never"

    handler = _call_stream_response(servicer, None, None)
    handler.send(None)
    handler.close()
