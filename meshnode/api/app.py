"""The HTTP app every node serves: middlewares (access log, errors, API key), CORS, and each API
surface's routes over one core. Errors are OpenAI-style JSON, except in Anthropic's and Ollama's paths."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web
from aiohttp.typedefs import Handler

from meshnode.api import anthropic, ollama, openai, ops, responses
from meshnode.api.core import ACCESS, ACTIVE, BACKEND, METRICS, SETTINGS, ApiSettings, Backend
from meshnode.errors import ApiError
from meshnode.metrics import NodeMetrics

__all__ = ["ApiSettings", "Backend", "make_app"]

SURFACES = (openai.routes, responses.routes, anthropic.routes, ollama.routes, ops.routes)

log = logging.getLogger(__name__)
access = logging.getLogger("meshnode.access")


class _MalformedHttpFilter(logging.Filter):
    """aiohttp logs each rejected request with a traceback, so anyone could fill the log: one line
    per peer every 10 s instead."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import BadHttpMessage

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, BadHttpMessage):
            return True
        peer = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "?"
        now = time.monotonic()
        if now - self._last.get(peer, -1e9) >= 10.0:
            if len(self._last) > 4096:
                self._last.clear()
            self._last[peer] = now
            first = str(exc.message if hasattr(exc, "message") else exc).strip().splitlines()
            log.warning("malformed HTTP request from %s: %s", peer, first[0][:200] if first else type(exc).__name__)
        return False


logging.getLogger("aiohttp.server").addFilter(_MalformedHttpFilter())


def _error_response(err: ApiError, request: web.Request) -> web.Response:
    shaped = next((s for s in (anthropic, ollama) if s.owns(request)), None)
    body = shaped.error_body(err) if shaped else err.body()
    return web.json_response(body, status=err.status, headers=err.headers)


@web.middleware
async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One line per request: method, path, status, seconds, model and tokens (generations)."""
    started = time.perf_counter()
    status: int | str = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    finally:
        info = request.get(ACCESS) or {}
        extra = ""
        if info.get("model"):
            extra = f" model={info['model']} tokens={info.get('prompt_tokens', 0)}+{info.get('completion_tokens', 0)}"
        if info.get("disconnected"):
            extra += " client-disconnected"
        access.info("%s %s %s %.3fs%s", request.method, request.path, status, time.perf_counter() - started, extra)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return _error_response(err, request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        message = exc.reason
        if exc.status == 413:
            limit = request.app[SETTINGS].max_body_bytes
            message = f"request body too large (limit {limit} bytes)"
        keep = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        return _error_response(ApiError(exc.status, message, type=kind, headers=keep), request)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # a bug in a handler is a 500 for its request, never the server's end
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return _error_response(ApiError(500, "internal error", type="server_error"), request)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[SETTINGS].api_key
    # Open: /health, the dashboard's files (it sends the key itself), and CORS preflights (no
    # credentials by design, and they run nothing).
    preflight = request.method == "OPTIONS" and bool(request.app[SETTINGS].cors_origins)
    if (
        key
        and not preflight
        and request.path != "/health"
        and request.path != "/"
        and not request.path.startswith("/static/")
    ):
        # Authorization: Bearer <key> (OpenAI clients), or x-api-key: <key> (Anthropic clients)
        bearer = hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {key}".encode())
        x_api_key = hmac.compare_digest(request.headers.get("x-api-key", "").encode(), key.encode())
        if not (bearer or x_api_key):
            raise ApiError(
                401,
                "missing or wrong API key (Authorization: Bearer ... or x-api-key: ...)",
                type="authentication_error",
                code="invalid_api_key",
            )
    return await handler(request)


def make_app(backend: Backend, settings: ApiSettings | None = None) -> web.Application:
    settings = ApiSettings() if settings is None else settings
    middlewares = ([access_middleware] if settings.access_log else []) + [errors_middleware, auth_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    app[BACKEND] = backend
    app[SETTINGS] = settings
    app[ACTIVE] = []
    # One registry per node; a backend without any gets a fresh set.
    app[METRICS] = getattr(backend, "metrics", None) or NodeMetrics()
    for add_routes in SURFACES:
        add_routes(app)
    if settings.cors_origins:
        _allow_origins(app, settings.cors_origins)
    return app


def _allow_origins(app: web.Application, origins: tuple[str, ...]) -> None:
    """CORS: pages of these origins may call the API with an Authorization header."""
    import aiohttp_cors

    options = aiohttp_cors.ResourceOptions(
        allow_credentials=False, expose_headers="*", allow_headers="*", allow_methods=["GET", "POST"], max_age=600
    )
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in origins})
    for route in list(app.router.routes()):
        if not isinstance(route.resource, web.StaticResource):
            cors.add(route)
