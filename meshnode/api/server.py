"""The HTTP API: OpenAI-compatible chat and completions, models, health and mesh status.

Every node serves it. Requests are parsed and checked in :mod:`meshnode.api.validation`;
generation goes to whatever :class:`~meshnode.serving.engine.Engine` the node's backend hands out
(local pipeline, or the mesh's head node). Errors are OpenAI-style JSON with a 4xx/5xx.

Every request gets one INFO line in the log (logger ``meshnode.access``, setting ``access_log``):
method, path, status, seconds, and for generations the model and tokens (prompt+completion). A
client that goes away mid-stream (a chat UI's Stop) is normal: the generation stops with one INFO
line, no traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from meshnode.api.validation import ApiError, GenerationRequest, Limits, parse_request
from meshnode.serving.engine import Delta, Engine
from meshnode.serving.generation import SamplingParams
from meshnode.metrics import NodeMetrics, outcome_for_status

STATIC = Path(__file__).resolve().parent / "static"  # the dashboard (GET /)

log = logging.getLogger(__name__)
access = logging.getLogger("meshnode.access")


class _MalformedHttpFilter(logging.Filter):
    """aiohttp logs every request its parser rejects (not HTTP, bad method, oversized header: the
    client's fault, answered 400 and closed) at ERROR with a traceback, so anyone who can reach the
    port can fill the log. Keep one line per peer every 10 s instead (found by tests/test_fuzz.py)."""

    def __init__(self):
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


class Backend(Protocol):
    def engine(self) -> Engine:
        """The engine to serve with now, or raise ApiError (e.g. 503 while re-planning)."""

    def mesh_status(self) -> dict[str, Any]: ...

    def health(self) -> tuple[bool, dict[str, Any]]: ...


@dataclass(frozen=True)
class ApiSettings:
    limits: Limits = Limits()
    max_body_bytes: int = 1 << 20
    max_concurrent_requests: int = 8
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()  # web origins whose pages may call the API; empty = none
    access_log: bool = True  # one INFO line per request (logger meshnode.access)


BACKEND = web.AppKey("backend", object)
SETTINGS = web.AppKey("settings", ApiSettings)
ACTIVE = web.AppKey("active", list)
METRICS = web.AppKey("metrics", NodeMetrics)


def _error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


OUTCOME = web.ResponseKey("outcome", str)  # how a generation ended (meshnode_requests_total)
ACCESS = web.RequestKey("access", dict)  # what a generation adds to its access line (model, tokens)


@web.middleware
async def access_middleware(request: web.Request, handler):
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
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        return _error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        message = exc.reason
        if exc.status == 413:
            limit = request.app[SETTINGS].max_body_bytes
            message = f"request body too large (limit {limit} bytes)"
        keep = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        return _error_response(ApiError(exc.status, message, type=kind, headers=keep))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return _error_response(ApiError(500, "internal error", type="server_error"))


@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = request.app[SETTINGS].api_key
    # Open without the key: /health, and the dashboard's own files (it asks for the key and sends
    # it with every API call it makes). /metrics and every /v1 route need it.
    # A CORS preflight carries no credentials by design; aiohttp-cors answers it and runs nothing.
    preflight = request.method == "OPTIONS" and bool(request.app[SETTINGS].cors_origins)
    if key and not preflight and request.path != "/health" and request.path != "/" \
            and not request.path.startswith("/static/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", type="authentication_error",
                           code="invalid_api_key")
    return await handler(request)


async def _json_body(request: web.Request) -> Any:
    if request.content_length is not None and request.content_length > request.app[SETTINGS].max_body_bytes:
        raise web.HTTPRequestEntityTooLarge(
            max_size=request.app[SETTINGS].max_body_bytes, actual_size=request.content_length
        )
    raw = await request.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"invalid JSON body: {exc}", code="invalid_json") from None


async def _prompt_tokens(engine: Engine, req: GenerationRequest) -> list[int]:
    tokenizer = engine.tokenizer
    if req.kind == "chat":
        if getattr(tokenizer, "chat_template", None):
            tokens = await asyncio.to_thread(
                tokenizer.apply_chat_template, req.messages, add_generation_prompt=True, tokenize=True
            )
            if isinstance(tokens, dict):  # transformers may return a BatchEncoding
                tokens = tokens["input_ids"]
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in req.messages) + "assistant: "
            tokens = await asyncio.to_thread(tokenizer.encode, text)
        return list(tokens)
    if isinstance(req.prompt, list):
        vocab = engine.vocab_size
        bad = next((t for t in req.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt",
                           code="invalid_value")
        return list(req.prompt)
    return list(await asyncio.to_thread(tokenizer.encode, req.prompt))


def _budget(engine: Engine, req: GenerationRequest, prompt_len: int, limits: Limits) -> int:
    room = engine.max_context - prompt_len
    if room <= 0:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens; this model's context is {engine.max_context} tokens",
            param="messages" if req.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    if req.max_tokens is None:
        return min(limits.default_max_tokens, room)
    if req.max_tokens > room:
        raise ApiError(
            400,
            f"max_tokens {req.max_tokens} plus the prompt's {prompt_len} tokens exceeds the context of "
            f"{engine.max_context} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return req.max_tokens


class _Slot:
    """Admission control: at most N generations at once on this node; 429 beyond."""

    def __init__(self, app: web.Application):
        self._active = app[ACTIVE]
        self._limit = app[SETTINGS].max_concurrent_requests

    def __enter__(self):
        if len(self._active) >= self._limit:
            raise ApiError(429, f"too many concurrent requests (limit {self._limit}); retry shortly",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self._active.append(self)
        return self

    def __exit__(self, *exc):
        self._active.remove(self)


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    """Serve one generation request and count it by outcome (meshnode_requests_total)."""
    outcome = "error"
    try:
        response = await _serve_generation(request, kind)
        outcome = response.get(OUTCOME, "ok")
        return response
    except ApiError as err:
        outcome = outcome_for_status(err.status)
        raise
    except web.HTTPException as exc:
        outcome = outcome_for_status(exc.status)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        outcome = "cancelled"
        raise
    finally:
        request.app[METRICS].request(outcome)


async def _serve_generation(request: web.Request, kind: str) -> web.StreamResponse:
    app = request.app
    settings: ApiSettings = app[SETTINGS]
    req = parse_request(await _json_body(request), kind, settings.limits)
    engine = app[BACKEND].engine()
    if req.model != engine.model_id:
        raise ApiError(404, f"model '{req.model}' is not served here; this mesh serves '{engine.model_id}'",
                       param="model", code="model_not_found")
    with _Slot(app):
        prompt = await _prompt_tokens(engine, req)
        max_tokens = _budget(engine, req, len(prompt), settings.limits)
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed)
        deltas = engine.stream(prompt, params, req.stop)
        meta = _Meta(kind, engine.model_id, len(prompt))
        request[ACCESS] = meta.access
        if req.stream:
            return await _stream(request, deltas, meta, req.include_usage)
        return await _collect(deltas, meta)


@dataclass
class _Meta:
    kind: str
    model: str
    prompt_tokens: int
    id: str = ""
    created: int = 0
    access: dict | None = None  # model and tokens for the access log

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.access = {"model": self.model, "prompt_tokens": self.prompt_tokens, "completion_tokens": 0}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def envelope(self, choices: list, chunk: bool) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else ("chat.completion.chunk" if chunk else "chat.completion")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


async def _collect(deltas: AsyncIterator[Delta], meta: _Meta) -> web.Response:
    parts, last = [], None
    async for delta in deltas:
        parts.append(delta.text)
        last = delta
        meta.access["completion_tokens"] = delta.completion_tokens
    text = "".join(parts)
    if meta.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": last.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
    body = meta.envelope([choice], chunk=False)
    body["usage"] = meta.usage(last.completion_tokens)
    return web.json_response(body)


async def _stream(request: web.Request, deltas: AsyncIterator[Delta], meta: _Meta, include_usage: bool):
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(obj: Any) -> None:
        if request.transport is None or request.transport.is_closing():
            raise ConnectionResetError("client went away")
        payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        await response.write(f"data: {payload}\n\n".encode())

    def choice(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if meta.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    try:
        if meta.kind == "chat":
            await send(meta.envelope([choice("", None, first=True)], chunk=True))
        last = None
        async for delta in deltas:
            last = delta
            meta.access["completion_tokens"] = delta.completion_tokens
            if delta.text:
                await send(meta.envelope([choice(delta.text, None)], chunk=True))
        await send(meta.envelope([choice(None if meta.kind == "chat" else "", last.finish_reason)], chunk=True))
        if include_usage:
            usage = meta.envelope([], chunk=True)
            usage["usage"] = meta.usage(last.completion_tokens)
            await send(usage)
        await send("[DONE]")
    except ConnectionResetError:  # a client that goes away (Stop) is normal: one line, no traceback
        log.info("client disconnected from %s after %d tokens; generation stopped", meta.id,
                 meta.access["completion_tokens"])
        meta.access["disconnected"] = True
        response[OUTCOME] = "cancelled"  # counted by _generate
        await deltas.aclose()
        return response
    except asyncio.CancelledError:
        log.info("client disconnected from %s after %d tokens; generation stopped", meta.id,
                 meta.access["completion_tokens"])
        meta.access["disconnected"] = True
        await deltas.aclose()
        raise
    except ApiError as err:
        response[OUTCOME] = outcome_for_status(err.status)  # counted by _generate
        await send(err.body())
        await send("[DONE]")
    except Exception:  # noqa: BLE001 - headers are sent: a 500 now would corrupt the stream
        log.exception("generation %s failed mid-stream", meta.id)
        response[OUTCOME] = "error"
        await send(ApiError(500, "internal error", type="server_error").body())
        await send("[DONE]")
    finally:
        await deltas.aclose()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def models(request: web.Request) -> web.Response:
    engine = request.app[BACKEND].engine()
    return web.json_response({"object": "list", "data": [
        {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "meshnode"}
    ]})


async def health(request: web.Request) -> web.Response:
    ok, body = request.app[BACKEND].health()
    return web.json_response(body, status=200 if ok else 503)


async def mesh(request: web.Request) -> web.Response:
    return web.json_response(request.app[BACKEND].mesh_status())


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS]
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


def make_app(backend: Backend, settings: ApiSettings = ApiSettings()) -> web.Application:
    # aiohttp enforces the body limit itself (413) for reads beyond it.
    middlewares = ([access_middleware] if settings.access_log else []) + [errors_middleware, auth_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    app[BACKEND] = backend
    app[SETTINGS] = settings
    app[ACTIVE] = []
    # The node's own metrics (one registry per node); a backend without any gets a fresh set.
    app[METRICS] = getattr(backend, "metrics", None) or NodeMetrics()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/mesh", mesh)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", dashboard)
    app.router.add_static("/static/", STATIC)
    if settings.cors_origins:
        _allow_origins(app, settings.cors_origins)
    return app


def _allow_origins(app: web.Application, origins: tuple[str, ...]) -> None:
    """CORS for the API routes (aiohttp-cors): pages of these origins may call them, sending the
    Authorization header; no cookies are involved."""
    import aiohttp_cors

    options = aiohttp_cors.ResourceOptions(allow_credentials=False, expose_headers="*", allow_headers="*",
                                           allow_methods=["GET", "POST"], max_age=600)
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in origins})
    for route in list(app.router.routes()):
        if not isinstance(route.resource, web.StaticResource):
            cors.add(route)
