"""The Anthropic surface: ``POST /v1/messages`` and ``/v1/messages/count_tokens``, for Claude-style
clients. A 503 is ``overloaded_error``, which clients retry with backoff (``api_error`` reads as a
server bug)."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from aiohttp import web

from meshnode.api import core
from meshnode.api.anthropic_schema import AnthropicRequest, parse
from meshnode.errors import ApiError
from meshnode.serving.answer import ToolCall
from meshnode.serving.engine import Delta

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def owns(request: web.Request) -> bool:
    """Whether ``request`` is this surface's (its errors take Anthropic's shape): its routes, and
    the models routes asked by an Anthropic client (it sends anthropic-version)."""
    path = request.path
    if path == "/v1/models" or path.startswith("/v1/models/"):
        return "anthropic-version" in request.headers
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(err: ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(err.status) or ("api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def stop_reason(last: Delta | None, called: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence (tool_use only if a tool_use block was made)."""
    if last is None or last.finish_reason == "length":
        return "max_tokens", None
    if last.stop_sequence is not None:
        return "stop_sequence", last.stop_sequence
    return ("tool_use" if called else "end_turn"), None


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments (JSON text) as the object a tool_use block holds."""
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        log.warning(
            "tool call %s to %s has arguments that are not a JSON object: %.200s", call.id, call.name, call.arguments
        )
        return {}
    return value


def tool_use(call: ToolCall, input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id or f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name, "input": input}


def thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def content_blocks(answer: core.Answer, hide_thinking: bool = False) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.reasoning:
        blocks.append(thinking("" if hide_thinking else answer.reasoning))
    if answer.text or not answer.tool_calls:
        blocks.append({"type": "text", "text": answer.text})
    return blocks + [tool_use(call, tool_input(call)) for call in answer.tool_calls]


def usage(gen: core.Generation, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage; no prompt cache counts per request, so none read from it or written."""
    return {
        "input_tokens": gen.prompt_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": output_tokens,
    }


def message(gen: core.Generation, answer: core.Answer, hide_thinking: bool = False) -> dict[str, Any]:
    reason, sequence = stop_reason(answer.last, bool(answer.tool_calls))
    out_tokens = answer.last.completion_tokens if answer.last else 0
    return {
        "id": gen.id,
        "type": "message",
        "role": "assistant",
        "model": gen.model,
        "content": content_blocks(answer, hide_thinking),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(gen, out_tokens),
    }


class Events:
    """A streamed message as Anthropic's server-sent events."""

    content_type = "text/event-stream"

    def __init__(self, gen: core.Generation, hide_thinking: bool = False):
        self.gen, self.hide = gen, hide_thinking
        self.index = -1  # the last block opened
        self.open: str | None = None  # the type of the block open now
        self.texts = self.calls = 0  # text blocks and tool_use blocks sent

    @staticmethod
    def event(name: str, data: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def opening(self) -> list[bytes]:
        start: dict[str, Any] = {
            "id": self.gen.id,
            "type": "message",
            "role": "assistant",
            "model": self.gen.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(self.gen, 0),
        }
        return [
            self.event("message_start", {"type": "message_start", "message": start}),
            *self.keepalive(),
        ]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self.index += 1
        self.open = block["type"]
        self.texts += block["type"] == "text"
        return frames + [
            self.event(
                "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}
            )
        ]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self.event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def delta(self, delta: Delta) -> list[bytes]:
        frames: list[bytes] = []
        if delta.reasoning:
            if self.open != "thinking":
                frames += self._start(thinking(""))
            if not self.hide:
                frames.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.text:
            if self.open != "text":
                frames += self._start({"type": "text", "text": ""})
            frames.append(self._delta({"type": "text_delta", "text": delta.text}))
        for call in delta.tool_calls:
            args = tool_input(call)
            frames += self._start(tool_use(call, {}))
            frames.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(args)}))
            frames += self._close()
            self.calls += 1
        return frames

    def closing(self, last: Delta | None) -> list[bytes]:
        frames = self._start({"type": "text", "text": ""}) if not self.texts and not self.calls else []
        reason, sequence = stop_reason(last, self.calls > 0)
        counted = usage(self.gen, last.completion_tokens if last else 0)
        return (
            frames
            + self._close()
            + [
                self.event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": counted,
                    },
                ),
                self.event("message_stop", {"type": "message_stop"}),
            ]
        )

    def keepalive(self) -> list[bytes]:
        return [self.event("ping", {"type": "ping"})]

    def failure(self, err: ApiError) -> list[bytes]:
        return [self.event("error", error_body(err))]


async def _respond(request: web.Request, gen: core.Generation, req: AnthropicRequest) -> web.StreamResponse:
    if req.stream:
        return await core.stream(request, gen, Events(gen, req.hide_thinking))
    return web.json_response(message(gen, await core.collect(request, gen), req.hide_thinking))


async def messages(request: web.Request) -> web.StreamResponse:
    return await core.generate(request, parse, _respond, id_prefix="msg_")


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens, as /v1/messages would make them."""
    req = parse(await core.json_body(request), request.app[core.SETTINGS].limits, count=True)
    engine = request.app[core.BACKEND].engine(req.model)
    prompt, _ = await core.chat_prompt(engine, req)
    return web.json_response({"input_tokens": len(prompt)})


def routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
