"""The OpenAI surface: /v1/chat/completions, /v1/completions and /v1/models, and their envelopes
(chat.completion, chat.completion.chunk, text_completion, usage, the SSE stream ending in
``[DONE]``, an error event mid-stream). Bodies are checked in :mod:`meshnode.api.validation`;
the generation itself is :mod:`meshnode.api.core`'s.
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import Any

from aiohttp import web

from meshnode.api import core
from meshnode.api.validation import GenerationRequest, parse_request
from meshnode.errors import ApiError
from meshnode.serving.engine import Delta


class _Envelope:
    """The parts every OpenAI answer object repeats: id, object, created, model, usage."""

    def __init__(self, gen: core.Generation, kind: str):
        self.gen, self.kind, self.created = gen, kind, int(time.time())

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt_tokens = self.gen.prompt_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def wrap(self, choices: list, chunk: bool) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else ("chat.completion.chunk" if chunk else "chat.completion")
        return {"id": self.gen.id, "object": obj, "created": self.created, "model": self.gen.model, "choices": choices}


class _ServerSentEvents(_Envelope):
    """A streamed answer: one ``data:`` event per piece, the finish reason, usage if asked, [DONE]."""

    content_type = "text/event-stream"

    def __init__(self, gen: core.Generation, kind: str, include_usage: bool):
        super().__init__(gen, kind)
        self.include_usage = include_usage

    @staticmethod
    def event(obj: Any) -> bytes:
        payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        return f"data: {payload}\n\n".encode()

    def chunk(self, text: str | None, finish: str | None, first: bool = False) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self.event(self.wrap([choice], chunk=True))

    def opening(self) -> list[bytes]:
        return [self.chunk("", None, first=True)] if self.kind == "chat" else []

    def delta(self, delta: Delta) -> list[bytes]:
        return [self.chunk(delta.text, None)]

    def closing(self, last: Delta) -> list[bytes]:
        frames = [self.chunk(None if self.kind == "chat" else "", last.finish_reason)]
        if self.include_usage:
            usage = self.wrap([], chunk=True)
            usage["usage"] = self.usage(last.completion_tokens)
            frames.append(self.event(usage))
        return frames + [self.event("[DONE]")]

    def failure(self, err: ApiError) -> list[bytes]:
        return [self.event(err.body()), self.event("[DONE]")]


async def _respond(kind: str, request: web.Request, gen: core.Generation, req: GenerationRequest):
    if req.stream:
        return await core.stream(request, gen, _ServerSentEvents(gen, kind, req.include_usage))
    envelope = _Envelope(gen, kind)
    answer = await core.collect(gen)
    last = answer.last
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": answer.text}, "logprobs": None,
                  "finish_reason": last.finish_reason}
    else:
        choice = {"index": 0, "text": answer.text, "logprobs": None, "finish_reason": last.finish_reason}
    body = envelope.wrap([choice], chunk=False)
    body["usage"] = envelope.usage(last.completion_tokens)
    return web.json_response(body)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await core.generate(request, lambda body, limits: parse_request(body, "chat", limits),
                               partial(_respond, "chat"), id_prefix="chatcmpl-")


async def completions(request: web.Request) -> web.StreamResponse:
    return await core.generate(request, lambda body, limits: parse_request(body, "completion", limits),
                               partial(_respond, "completion"), id_prefix="cmpl-")


async def models(request: web.Request) -> web.Response:
    """Every served model, also while the mesh forms or re-plans (a client lists what it can ask
    for; a request made before the model is ready gets a 503 with Retry-After)."""
    return web.json_response({"object": "list", "data": [
        {"id": m["id"], "object": "model", "created": 0, "owned_by": "meshnode", "state": m["state"]}
        for m in request.app[core.BACKEND].models()
    ]})


def routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
