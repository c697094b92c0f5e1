"""Authentication of every node-to-node gRPC call with the shared cluster key.

Both ends derive a MAC key (HKDF-SHA256), never logged. Every call carries ``x-mesh-ts``,
``x-mesh-nonce``, ``x-mesh-node`` and ``x-mesh-mac``: HMAC-SHA256 over the method, those fields and,
for single-request calls, the body's digest; signed once per call, not per stream message. The
server refuses (``UNAUTHENTICATED``) bad metadata, a timestamp outside ``window``, a wrong MAC
(constant-time) or a seen nonce (recorded only after the MAC checks, so strangers cannot fill the
cache). Bodies are checked as raw bytes before parsing.

Protects, against anyone without the key: who may call, replay, single-request bodies. Does not
protect: secrecy and replies (use ``encrypt = true``), stream messages after the opening, against a
key holder (any node id), the open cluster (a public key: no protection at all), a replay to a
node restarted within the window. Threat model: docs/operations.md ("Security and trust").
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc

from meshnode.errors import MeshnodeError

__all__ = [
    "ClusterAuth",
    "AuthServerInterceptor",
    "HEADER_TS",
    "HEADER_NONCE",
    "HEADER_NODE",
    "HEADER_MAC",
]

log = logging.getLogger(__name__)

LABEL = b"meshnode grpc auth v1"
OPEN_KEY = "meshnode open cluster (public, no secrecy)"

HEADER_TS = "x-mesh-ts"
HEADER_NONCE = "x-mesh-nonce"
HEADER_NODE = "x-mesh-node"
HEADER_MAC = "x-mesh-mac"
HEADERS = (HEADER_TS, HEADER_NONCE, HEADER_NODE, HEADER_MAC)

_MAX_NODE_LEN = 256
_LOG_INTERVAL = 10.0
_LOG_PEERS_MAX = 4096
_STREAM_REFUSAL_READ_TIMEOUT = 1.0


def _hkdf(key: bytes, label: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) with salt = info = ``label``, 32 bytes of output."""
    prk = hmac.new(label, key, hashlib.sha256).digest()
    return hmac.new(prk, label + b"\x01", hashlib.sha256).digest()


def _field(value: bytes) -> bytes:
    return len(value).to_bytes(4, "big") + value


def method_name(method: str | bytes) -> str:
    """A gRPC method's name as text (the server side gets bytes)."""
    return method.decode("utf-8", "replace") if isinstance(method, (bytes, bytearray)) else str(method)


class _ReplayCache:
    """Nonces accepted within the window, oldest first; bounded (oldest evicted first)."""

    def __init__(self, ttl: float, max_entries: int):
        self.ttl = ttl
        self.max_entries = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, nonce: str, now: float) -> bool:
        """Record ``nonce``; False if it was already seen within the ttl."""
        with self._lock:
            while self._seen:
                oldest, expires = next(iter(self._seen.items()))
                if expires > now:
                    break
                del self._seen[oldest]
            if nonce in self._seen:
                return False
            self._seen[nonce] = now + self.ttl
            while len(self._seen) > self.max_entries:
                self._seen.popitem(last=False)
            return True

    def __len__(self) -> int:
        return len(self._seen)


class _Refused(MeshnodeError):
    """Why a call's authentication is refused; caught where it is checked."""


class ClusterAuth:
    """The MAC key of a cluster and the checks both ends run. ``cluster_key`` None or "": the open
    cluster, a fixed public key that protects nothing. ``window``: accepted clock difference (s)."""

    def __init__(
        self,
        cluster_key: str | None,
        *,
        window: float = 30.0,
        max_nonces: int = 100_000,
        clock: Callable[[], float] = time.time,
    ):
        self.open = not cluster_key
        self._mac_key = _hkdf((cluster_key or OPEN_KEY).encode("utf-8"), LABEL)
        self.window = float(window)
        self._clock = clock
        # Remembered as long as its timestamp is acceptable: up to 2 windows.
        self._nonces = _ReplayCache(2 * self.window, max_nonces)
        self._logged: OrderedDict[str, float] = OrderedDict()
        self._log_lock = threading.Lock()

    def __repr__(self) -> str:  # never show the key
        return f"ClusterAuth(open={self.open}, window={self.window})"

    # ------------------------------------------------------------------ MACs
    def mac(self, method: str | bytes, ts: str, nonce: str, caller: str, body_digest: bytes) -> str:
        msg = b"".join(
            _field(x)
            for x in (
                method_name(method).encode("utf-8"),
                ts.encode("utf-8"),
                nonce.encode("utf-8"),
                caller.encode("utf-8"),
                body_digest,
            )
        )
        return hmac.new(self._mac_key, msg, hashlib.sha256).hexdigest()

    def sign(self, method: str | bytes, caller: str, body: bytes | None) -> list[tuple[str, str]]:
        """The metadata for one call; ``body`` is the serialized request, None for request streams."""
        ts = str(int(self._clock() * 1000))
        nonce = os.urandom(16).hex()
        digest = hashlib.sha256(body).digest() if body is not None else b""
        return [
            (HEADER_TS, ts),
            (HEADER_NONCE, nonce),
            (HEADER_NODE, caller),
            (HEADER_MAC, self.mac(method, ts, nonce, caller, digest)),
        ]

    # ------------------------------------------------------------------ checks
    def parse_signature(self, metadata: Iterable[Any] | None) -> tuple[str, str, str, str]:
        """A call's signature fields (timestamp, nonce, node, MAC), well formed and in time; else _Refused."""
        found: dict[str, str] = {}
        for item in metadata or ():
            key, value = item[0], item[1]
            if key in HEADERS:
                if key in found or not isinstance(value, str):
                    raise _Refused("malformed authentication metadata")
                found[key] = value
        if len(found) != len(HEADERS):
            raise _Refused("missing authentication metadata")
        ts, nonce, node, mac = (found[h] for h in HEADERS)
        if not (ts.isascii() and ts.isdigit() and 0 < len(ts) <= 15):
            raise _Refused("malformed timestamp")
        if len(nonce) != 32 or not _is_hex(nonce):
            raise _Refused("malformed nonce")
        if len(mac) != 64 or not _is_hex(mac):
            raise _Refused("malformed mac")
        if not node or len(node) > _MAX_NODE_LEN:
            raise _Refused("malformed node id")
        if abs(int(ts) / 1000.0 - self._clock()) > self.window:
            raise _Refused("timestamp outside the accepted window (clocks out of sync?)")
        return ts, nonce, node, mac

    def verify(self, method: str, fields: tuple[str, str, str, str], body: bytes | None) -> None:
        """The MAC over ``method`` and ``body`` matches and its nonce is new; else _Refused."""
        ts, nonce, node, mac = fields
        digest = hashlib.sha256(body).digest() if body is not None else b""
        if not hmac.compare_digest(self.mac(method, ts, nonce, node, digest), mac.lower()):
            raise _Refused("bad mac (wrong cluster key?)")
        if not self._nonces.add(nonce, self._clock()):
            raise _Refused("replayed call")

    def check(self, method: str, metadata: Iterable[Any], body: bytes | None) -> str | None:
        """Verify a :meth:`sign` signature outside gRPC (the data port's hello); None, or why refused."""
        try:
            self.verify(method, self.parse_signature(metadata), body)
        except _Refused as exc:
            return str(exc)
        return None

    def log_call_refusal(self, context: grpc.aio.ServicerContext, method: str, reason: str) -> None:
        """:meth:`log_refusal` of a refused gRPC call, naming the peer ``context`` came from."""
        try:
            peer = context.peer() or "?"
        except Exception:  # noqa: BLE001 - logging must never fail a call
            peer = "?"
        host = peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer
        self.log_refusal(host, f"gRPC call {method}", reason)

    def log_refusal(self, host: str, what: str, reason: str) -> None:
        """Log a refused call, at most once per peer host per 10 s (never the key or a MAC)."""
        now = time.monotonic()
        with self._log_lock:
            last = self._logged.get(host)
            if last is not None and now - last < _LOG_INTERVAL:
                return
            self._logged[host] = now
            self._logged.move_to_end(host)
            while len(self._logged) > _LOG_PEERS_MAX:
                self._logged.popitem(last=False)
        log.warning("refused %s from %s: %s", what, host, reason)

    # ------------------------------------------------------------------ interceptors
    def server_interceptor(self) -> AuthServerInterceptor:
        return AuthServerInterceptor(self)


def tensor_group_secret(cluster_key: str | None) -> bytes:
    """What a tensor group's members prove the cluster key to each other with (never the key itself)."""
    if not cluster_key:
        return b""
    return hmac.new(cluster_key.encode(), b"meshnode tensor group v1", hashlib.sha256).digest()


def _is_hex(value: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in value)


# ---------------------------------------------------------------------------- server side
class _Checked:
    """What the wrapped deserializer hands to the wrapped behaviour."""

    __slots__ = ("message", "refusal", "code")

    def __init__(self, message: Any, refusal: str | None, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED):
        self.message = message
        self.refusal = refusal
        self.code = code


async def _call_unary_response(
    behavior: Callable[[Any, grpc.aio.ServicerContext], object], request: object, context: grpc.aio.ServicerContext
) -> object:
    result = behavior(request, context)
    if inspect.isawaitable(result):
        result = await result
    return result


async def _call_stream_response(
    behavior: Callable[[Any, grpc.aio.ServicerContext], Any],
    request: object,
    context: grpc.aio.ServicerContext,
) -> None:
    result = behavior(request, context)
    if hasattr(result, "__aiter__"):
        try:
            async for item in result:
                await context.write(item)
        except GeneratorExit:  # this coroutine is closed (a server stopping): it may await nothing
            raise
        except BaseException:  # cancelled or failed: close the servicer's generator now (its cleanup runs)
            aclose = getattr(result, "aclose", None)
            if aclose is not None:
                await aclose()
            raise
    elif inspect.isawaitable(result):
        await result
    elif result is not None:
        for item in result:
            await context.write(item)


class AuthServerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call not signed with the cluster's MAC key."""

    def __init__(self, auth: ClusterAuth):
        self._auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = method_name(handler_call_details.method)
        handler = await continuation(handler_call_details)
        try:
            fields = self._auth.parse_signature(handler_call_details.invocation_metadata)
            if handler is not None and handler.request_streaming:
                self._auth.verify(method, fields, None)
        except _Refused as exc:
            return self._refusing(handler, method, str(exc))
        if handler is None or handler.request_streaming:
            return handler
        return self._checking(handler, method, fields)

    def _refusing(self, handler: grpc.RpcMethodHandler | None, method: str, reason: str) -> grpc.RpcMethodHandler:
        auth = self._auth

        async def refuse(_request: object, context: grpc.aio.ServicerContext) -> None:
            auth.log_call_refusal(context, method, reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        async def refuse_stream(_requests: AsyncIterator[object], context: grpc.aio.ServicerContext) -> None:
            # Take the first message (raw, never parsed) first, so a writing client sees
            # UNAUTHENTICATED, not INTERNAL (grpc/grpc#36066).
            try:
                await asyncio.wait_for(context.read(), _STREAM_REFUSAL_READ_TIMEOUT)
            except Exception:  # noqa: BLE001 - a timeout or a broken stream: refuse anyway
                pass
            await refuse(None, context)

        # Match the handler's shape; the request is never deserialized.
        if handler is None or (not handler.request_streaming and not handler.response_streaming):
            return grpc.unary_unary_rpc_method_handler(refuse)
        if not handler.request_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        if not handler.response_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse_stream)
        return grpc.stream_stream_rpc_method_handler(refuse_stream)

    def _checking(
        self, handler: grpc.RpcMethodHandler, method: str, fields: tuple[str, str, str, str]
    ) -> grpc.RpcMethodHandler:
        auth = self._auth
        deserialize = handler.request_deserializer

        def checked_deserializer(raw: bytes) -> _Checked:
            try:
                auth.verify(method, fields, bytes(raw))
            except _Refused as exc:
                return _Checked(None, str(exc))
            if deserialize is None:
                return _Checked(raw, None)
            try:
                return _Checked(deserialize(raw), None)
            except Exception:  # noqa: BLE001 - signed but corrupt: the caller's error, not UNKNOWN
                return _Checked(None, "malformed request message", grpc.StatusCode.INVALID_ARGUMENT)

        async def refuse(checked: _Checked, context: grpc.aio.ServicerContext) -> bool:
            if checked.refusal is None:
                return False
            auth.log_call_refusal(context, method, checked.refusal)
            await context.abort(checked.code, checked.refusal)
            return True

        if handler.response_streaming:
            behavior = handler.unary_stream

            async def unary_stream(checked: _Checked, context: grpc.aio.ServicerContext) -> None:
                if not await refuse(checked, context):
                    await _call_stream_response(behavior, checked.message, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, checked_deserializer, handler.response_serializer)

        behavior = handler.unary_unary

        async def unary_unary(checked: _Checked, context: grpc.aio.ServicerContext) -> Any:
            if not await refuse(checked, context):
                return await _call_unary_response(behavior, checked.message, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, checked_deserializer, handler.response_serializer)
