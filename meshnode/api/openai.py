"""The OpenAI surface: /v1/chat/completions, /v1/completions and /v1/models (which Anthropic's
clients read too), and their envelopes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

from aiohttp import web

from meshnode.api import core
from meshnode.api.validation import GenerationRequest, RequestKind, parse_request
from meshnode.errors import ApiError
from meshnode.serving.answer import ToolCall
from meshnode.serving.engine import Delta, TokenLogprob


class _Envelope:
    """The parts every OpenAI answer object repeats: id, object, created, model, usage."""

    def __init__(self, gen: core.Generation, kind: RequestKind):
        self.gen, self.kind, self.created = gen, kind, int(time.time())

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt_tokens = self.gen.prompt_tokens
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def wrap(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.gen.id, "object": obj, "created": self.created, "model": self.gen.model, "choices": choices}


class _ServerSentEvents(_Envelope):
    """A streamed answer: one ``data:`` event per piece, the finish reason, usage if asked, [DONE]."""

    content_type = "text/event-stream"

    @staticmethod
    def event(obj: Any) -> bytes:
        payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        return f"data: {payload}\n\n".encode()

    def __init__(self, gen: core.Generation, kind: RequestKind, include_usage: bool):
        super().__init__(gen, kind)
        self.include_usage = include_usage
        self.calls = 0  # tool calls streamed so far: each one's index

    def chunk(self, text: str | None, finish: str | None, first: bool = False, piece: Delta | None = None) -> bytes:
        logprobs = _logprobs(self.kind, piece.logprobs) if piece is not None and piece.logprobs else None
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            elif text is not None and (first or piece is None):
                delta["content"] = text
            if piece is not None and piece.reasoning:
                delta["reasoning_content"] = piece.reasoning
            if piece is not None and piece.tool_calls:
                delta["tool_calls"] = [
                    dict(_tool_call(c), index=self.calls + i) for i, c in enumerate(piece.tool_calls)
                ]
                self.calls += len(piece.tool_calls)
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return self.event(self.wrap([choice], chunk=True))

    def opening(self) -> list[bytes]:
        return [self.chunk("", None, first=True)] if self.kind == "chat" else []

    def delta(self, delta: Delta) -> list[bytes]:
        return [self.chunk(delta.text, None, piece=delta)]

    def closing(self, last: Delta) -> list[bytes]:
        frames = [self.chunk(None if self.kind == "chat" else "", last.finish_reason)]
        if self.include_usage:
            usage = self.wrap([], chunk=True)
            usage["usage"] = self.usage(last.completion_tokens)
            frames.append(self.event(usage))
        return frames + [self.event("[DONE]")]

    def keepalive(self) -> list[bytes]:
        return [core.SSE_KEEPALIVE]

    def failure(self, err: ApiError) -> list[bytes]:
        return [self.event(err.body()), self.event("[DONE]")]


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _logprobs(kind: RequestKind, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's logprobs object: chat's ``content`` list, or the legacy completions lists."""
    if kind == "chat":

        def one(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {
            "content": [dict(one(e.token, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top]) for e in entries]
        }
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_first_of_each(e.top) for e in entries],
    }


def _first_of_each(top: Iterable[tuple[str, float]]) -> dict[str, float]:
    """{text: logprob}, most likely first; tokens that decode alike (partial UTF-8) keep the best."""
    out: dict[str, float] = {}
    for text, logprob in top:
        out.setdefault(text, logprob)
    return out


async def _respond(
    kind: RequestKind, request: web.Request, gen: core.Generation, req: GenerationRequest
) -> web.StreamResponse:
    if req.stream:
        return await core.stream(request, gen, _ServerSentEvents(gen, kind, req.include_usage))
    envelope = _Envelope(gen, kind)
    answer = await core.collect(request, gen)
    last = answer.last
    logprobs = _logprobs(kind, answer.logprobs) if req.logprobs else None
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": answer.text}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.tool_calls:
            message["tool_calls"] = [_tool_call(c) for c in answer.tool_calls]
            message["content"] = answer.text or None
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": last.finish_reason}
    else:
        choice = {"index": 0, "text": answer.text, "logprobs": logprobs, "finish_reason": last.finish_reason}
    body = envelope.wrap([choice], chunk=False)
    body["usage"] = envelope.usage(last.completion_tokens)
    return web.json_response(body)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await core.generate(
        request,
        lambda body, limits: parse_request(body, "chat", limits),
        partial(_respond, "chat"),
        id_prefix="chatcmpl-",
    )


async def completions(request: web.Request) -> web.StreamResponse:
    return await core.generate(
        request,
        lambda body, limits: parse_request(body, "completion", limits),
        partial(_respond, "completion"),
        id_prefix="cmpl-",
    )


EPOCH = "1970-01-01T00:00:00Z"  # Anthropic's created_at when the release date is unknown (created: 0)


def _model(m: dict[str, Any], max_tokens_limit: int) -> dict[str, Any]:
    """One served model in OpenAI's shape, with the fields Anthropic's ModelInfo reads too."""
    context = m.get("context_length")
    return {
        "id": m["id"],
        "object": "model",
        "created": 0,
        "owned_by": "meshnode",
        "type": "model",
        "display_name": m["id"],
        "created_at": EPOCH,
        "lifecycle": "active",
        "max_input_tokens": context,
        "max_tokens": min(context, max_tokens_limit) if context else None,  # the most one answer gets
        "state": m["state"],
        "context_length": context,
    }


async def models(request: web.Request) -> web.Response:
    """Every served model, also while the mesh forms or re-plans (a client lists what it can ask
    for; a request made before the model is ready gets a 503 with Retry-After)."""
    limit = request.app[core.SETTINGS].limits.max_tokens_limit
    data = [_model(m, limit) for m in request.app[core.BACKEND].models()]
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "has_more": False,  # Anthropic's page
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )


async def model(request: web.Request) -> web.Response:
    """One served model, as /v1/models lists it."""
    model_id = request.match_info["id"]
    served = request.app[core.BACKEND].models()
    found = next((m for m in served if m["id"] == model_id), None)
    if found is None:
        raise ApiError(
            404,
            f"model '{model_id}' is not served here; this mesh serves "
            f"{', '.join(repr(m['id']) for m in served) or 'no model yet'}",
            param="model",
            code="model_not_found",
        )
    return web.json_response(_model(found, request.app[core.SETTINGS].limits.max_tokens_limit))


def routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{id:.+}", model)
