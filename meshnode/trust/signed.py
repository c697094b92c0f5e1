"""The calling side of the cluster key's authentication (meshnode.trust.auth): gRPC client
interceptors that sign every call, and ``SignedChannel``, which the nodes use (a channel whose
calls are signed once each, without interceptors' per-call overhead)."""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from typing import Any, Protocol, cast

import grpc

from meshnode.trust.auth import HEADERS, ClusterAuth, method_name

__all__ = ["client_interceptors", "SignedChannel"]


class _Message(Protocol):
    """A protobuf message, as far as signing it goes."""

    def SerializeToString(self) -> bytes: ...


def _serialize(request: object) -> bytes:
    if isinstance(request, (bytes, bytearray, memoryview)):
        return bytes(request)
    return cast(_Message, request).SerializeToString()  # the generated stubs send protobuf messages


class _ClientBase:
    def __init__(self, auth: ClusterAuth, node_id: str):
        self._auth = auth
        self._node_id = node_id

    def _details(self, details: grpc.aio.ClientCallDetails, body: bytes | None) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata()
        for key, value in details.metadata or ():
            if key not in HEADERS:
                metadata.add(key, value)
        for key, value in self._auth.sign(details.method, self._node_id, body):
            metadata.add(key, value)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnary(_ClientBase, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, object], Awaitable[grpc.aio.UnaryUnaryCall]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: object,
    ) -> grpc.aio.UnaryUnaryCall:
        return await continuation(self._details(client_call_details, _serialize(request)), request)


class _UnaryStream(_ClientBase, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, object], Awaitable[grpc.aio.UnaryStreamCall]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: object,
    ) -> grpc.aio.UnaryStreamCall:
        return await continuation(self._details(client_call_details, _serialize(request)), request)


class _StreamUnary(_ClientBase, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[object] | Iterable[object]], Awaitable[grpc.aio.StreamUnaryCall]
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[object] | Iterable[object],
    ) -> grpc.aio.StreamUnaryCall:
        return await continuation(self._details(client_call_details, None), request_iterator)


class _StreamStream(_ClientBase, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Callable[
            [grpc.aio.ClientCallDetails, AsyncIterable[object] | Iterable[object]], Awaitable[grpc.aio.StreamStreamCall]
        ],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: AsyncIterable[object] | Iterable[object],
    ) -> grpc.aio.StreamStreamCall:
        return await continuation(self._details(client_call_details, None), request_iterator)


def client_interceptors(auth: ClusterAuth, node_id: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that sign every call as ``node_id``; prefer :class:`SignedChannel` for streams."""
    return [cls(auth, node_id) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


class _SignedMultiCallable:
    """Adds the signed metadata when a call opens; the call itself is grpc.aio's plain one."""

    __slots__ = ("_inner", "_auth", "_node_id", "_method", "_serializer", "_unary")

    def __init__(
        self,
        inner: Callable[..., grpc.aio.Call],
        auth: ClusterAuth,
        node_id: str,
        method: str,
        serializer: Callable[[Any], bytes] | None,
        unary: bool,
    ):
        self._inner, self._auth, self._node_id = inner, auth, node_id
        self._method, self._serializer, self._unary = method, serializer, unary

    def __call__(
        self, request: object = None, *, metadata: Iterable[tuple[str, str | bytes]] | None = None, **kwargs: Any
    ) -> grpc.aio.Call:
        body = None
        if self._unary:
            body = self._serializer(request) if self._serializer is not None else _serialize(request)
        signed = grpc.aio.Metadata()
        for key, value in metadata or ():
            if key not in HEADERS:
                signed.add(key, value)
        for key, value in self._auth.sign(self._method, self._node_id, body):
            signed.add(key, value)
        return self._inner(request, metadata=signed, **kwargs)


class SignedChannel:
    """A ``grpc.aio`` channel whose every call is signed as ``node_id`` when it opens (one HMAC per call)."""

    def __init__(self, channel: grpc.aio.Channel, auth: ClusterAuth, node_id: str):
        self._channel, self._auth, self._node_id = channel, auth, node_id

    def _wrap(
        self,
        kind: str,
        unary: bool,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        **kwargs: Any,
    ) -> _SignedMultiCallable:
        inner = getattr(self._channel, kind)(
            method, request_serializer=request_serializer, response_deserializer=response_deserializer, **kwargs
        )
        return _SignedMultiCallable(inner, self._auth, self._node_id, method_name(method), request_serializer, unary)

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        **kwargs: Any,
    ) -> _SignedMultiCallable:
        return self._wrap("unary_unary", True, method, request_serializer, response_deserializer, **kwargs)

    def unary_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        **kwargs: Any,
    ) -> _SignedMultiCallable:
        return self._wrap("unary_stream", True, method, request_serializer, response_deserializer, **kwargs)

    def stream_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        **kwargs: Any,
    ) -> _SignedMultiCallable:
        return self._wrap("stream_unary", False, method, request_serializer, response_deserializer, **kwargs)

    def stream_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        **kwargs: Any,
    ) -> _SignedMultiCallable:
        return self._wrap("stream_stream", False, method, request_serializer, response_deserializer, **kwargs)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    async def __aenter__(self) -> SignedChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __getattr__(self, name: str) -> Any:  # get_state, channel_ready, wait_for_state_change ...
        return getattr(self._channel, name)
