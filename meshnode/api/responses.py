"""The OpenAI Responses API (``/v1/responses``), for Codex CLI and ``client.responses``. Responses
with ``store`` not false are kept in memory (bounded) for ``previous_response_id`` and GET."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from aiohttp import web

from meshnode.api import core
from meshnode.api.responses_schema import (
    HOSTED,
    ITEMS,
    LOGPROBS,
    PARTS,
    ResponsesBody,
    json_schema,
    leading_system,
    template_messages,
    template_tools,
    tool_choice,
)
from meshnode.api.schema import validate
from meshnode.api.validation import GenerationRequest, Limits
from meshnode.errors import ApiError
from meshnode.serving.answer import ToolCall
from meshnode.serving.engine import Delta

STORE_SIZE = 256
STORE_SECONDS = 30 * 60.0


class ResponseStore:
    """The recent stored responses of this node: each one's Response and conversation."""

    def __init__(
        self, size: int = STORE_SIZE, seconds: float = STORE_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.size, self.seconds, self.clock = size, seconds, clock
        self._kept: OrderedDict[str, tuple[float, dict[str, Any], tuple[dict[str, Any], ...]]] = OrderedDict()

    def _expire(self) -> None:
        now = self.clock()
        while self._kept and (len(self._kept) > self.size or next(iter(self._kept.values()))[0] <= now):
            self._kept.popitem(last=False)

    def put(self, response: dict[str, Any], history: tuple[dict[str, Any], ...]) -> None:
        self._kept[response["id"]] = (self.clock() + self.seconds, response, history)
        self._expire()

    def history(self, response_id: str) -> tuple[dict[str, Any], ...] | None:
        self._expire()
        kept = self._kept.get(response_id)
        return kept[2] if kept else None

    def response(self, response_id: str) -> dict[str, Any] | None:
        self._expire()
        kept = self._kept.get(response_id)
        return kept[1] if kept else None

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was kept."""
        self._expire()
        return self._kept.pop(response_id, None) is not None


STORE = web.AppKey("responses_store", ResponseStore)

# What a Response repeats of its request when the request left it out: OpenAI's defaults.
DEFAULTS: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": {"effort": None, "summary": None},
    "service_tier": "default",
    "store": True,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}, "verbosity": "medium"},
    "tool_choice": "auto",
    "tools": [],
    "top_logprobs": 0,
    "top_p": 1.0,
    "truncation": "disabled",
    "user": None,
    "background": False,
    "safety_identifier": None,
    "prompt_cache_key": None,
}


@dataclasses.dataclass(frozen=True)
class ResponsesRequest(GenerationRequest):
    history: tuple[dict[str, Any], ...] = ()  # the conversation without instructions: what a follow-up continues
    names: dict[str, tuple[str, str | None, str]] = dataclasses.field(default_factory=dict)  # seen -> type, ns, name
    echo: dict[str, Any] = dataclasses.field(default_factory=dict)  # the body, for the fields a Response repeats
    store: bool = True


# the types that tag a union's members in pydantic's paths
_TAGS = set(PARTS + ITEMS + HOSTED + ("custom_tool_call_output", "function", "custom", "namespace"))
_TAG = re.compile(r"(\])\.(?:" + "|".join(re.escape(t) for t in _TAGS) + r")\b")
Lookup = Callable[[str], "tuple[dict[str, Any], ...] | None"]


def parse(body: Any, limits: Limits, lookup: Lookup = lambda _id: None) -> ResponsesRequest:
    """A /v1/responses body as the request every surface hands on; ``lookup`` gives the stored
    conversation of a previous response (None: unknown or expired)."""
    try:
        req = validate(ResponsesBody, body, {"limits": limits})
    except ApiError as err:  # a union member's tag is a step of pydantic's path: input[0].message.content
        err.param = _TAG.sub(r"\1", err.param) if err.param else None
        err.message = _TAG.sub(r"\1", err.message)
        err.args = (err.message,)
        raise
    tools, names = template_tools(req.tools or [])
    choice = tool_choice(req.tool_choice, names)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        before = lookup(req.previous_response_id)
        if before is None:
            raise ApiError(
                400,
                f"Previous response with id '{req.previous_response_id}' not found: this node keeps "
                "the responses it made with store not false, for a while (see docs/api.md); send the "
                "whole conversation in 'input' instead",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = list(before)
    history += template_messages(req.input, history)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    wanted = json_schema(req.text.format if req.text else None)
    if wanted is not None and tools and choice != "none":
        raise ApiError(
            400,
            "text.format json and tools cannot both shape one answer here; send one",
            param="text.format",
            code="invalid_value",
        )
    effort = req.reasoning.effort if req.reasoning else None
    logprobs = LOGPROBS in (req.include or ())
    if req.top_logprobs and not logprobs:
        raise ApiError(
            400, f"'top_logprobs' needs include [\"{LOGPROBS}\"]", param="top_logprobs", code="invalid_value"
        )
    return ResponsesRequest(
        kind="chat",
        model=req.model,
        messages=leading_system(messages),
        max_tokens=req.max_output_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        stream=bool(req.stream),
        logprobs=logprobs,
        top_logprobs=req.top_logprobs or 0,
        tools=tools or None,
        tool_choice=choice,
        json_schema=wanted,
        think=None if effort is None else effort not in ("none", "minimal"),
        template_kwargs={"reasoning_effort": "high" if effort in ("xhigh", "max") else effort} if effort else {},
        history=tuple(history),
        names=names,
        echo=dict(body),
        store=req.store is not False,
    )


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _logprobs(delta: Delta) -> list[dict[str, Any]]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "bytes": list(token.encode()), "logprob": logprob}

    return [dict(one(e.token, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top]) for e in delta.logprobs]


class Output:
    """A response's output items as the deltas come and, when streaming, its events; the
    non-streamed answer is built the same way, so both end in the same Response."""

    content_type = "text/event-stream"

    def __init__(self, gen: core.Generation, req: ResponsesRequest, store: ResponseStore | None, streaming: bool):
        self.gen, self.req, self.store, self.streaming = gen, req, store, streaming
        self.created_at = int(time.time())
        self.items: list[dict[str, Any]] = []  # the finished output items
        self.open: dict[str, Any] | None = None  # the reasoning or message item being written
        self.written: list[str] = []  # its text so far
        self.written_logprobs: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] = []  # logprobs of tokens whose text is held back
        self.said: list[str] = []  # the answer's text and calls, for the stored conversation
        self.calls: list[dict[str, Any]] = []
        self.reasoning_tokens = 0
        self.seq = 0
        self.frames: list[bytes] = []
        self.final: dict[str, Any] | None = None

    # ----------------------------------------------------------------- events

    def _event(self, kind: str, **data: Any) -> None:
        if self.streaming:
            data = {"type": kind, "sequence_number": self.seq, **data}
            self.seq += 1
            payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
            self.frames.append(f"event: {kind}\ndata: {payload}\n\n".encode())

    def _take(self) -> list[bytes]:
        frames, self.frames = self.frames, []
        return frames

    def response(self, status: str, usage: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        echo = {k: v for k, v in self.req.echo.items() if k in DEFAULTS}
        return {
            "id": self.gen.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.gen.model,
            "output": list(self.items),
            "usage": usage,
            **DEFAULTS,
            **echo,
            **extra,
        }

    # ----------------------------------------------------------------- items

    def _where(self) -> dict[str, Any]:
        assert self.open is not None, "an item is open while its parts are written"
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _start(self, kind: str) -> None:
        self._close("completed")
        part: dict[str, Any]
        if kind == "reasoning":
            self.open = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            self.open = {
                "id": _id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._event("response.output_item.added", output_index=len(self.items), item=self.open)
        self._event("response.content_part.added", **self._where(), content_index=0, part=part)

    def _write(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> None:
        if self.open is None or self.open["type"] != kind:
            self._start(kind)
        self.written.append(text)
        if kind == "reasoning":
            self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)
        else:
            self.written_logprobs += logprobs or []
            self._event(
                "response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=logprobs or []
            )

    def _close(self, status: str) -> None:
        if self.open is None:
            return
        text, where = "".join(self.written), self._where()
        part: dict[str, Any]
        if self.open["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            self._event("response.reasoning_text.done", **where, content_index=0, text=text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self.written_logprobs}
            self._event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=self.written_logprobs
            )
            self.said.append(text)
        self._event("response.content_part.done", **where, content_index=0, part=part)
        item = {**self.open, "status": status, "content": [part]}
        self._event("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)
        self.open, self.written, self.written_logprobs = None, [], []

    def _call(self, call: ToolCall) -> None:
        self._close("completed")
        kind, namespace, name = self.req.names.get(call.name, ("function", None, call.name))
        where = {"output_index": len(self.items)}
        if kind == "custom":
            text = _custom_input(call.arguments)
            item = {"id": _id("ctc"), "type": "custom_tool_call", "call_id": call.id, "name": name, "input": ""}
            arguments: dict[str, Any] = {"input": text}
            events = ("response.custom_tool_call_input", "input")
        else:
            text = call.arguments
            item = {
                "id": _id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call.id,
                "name": name,
                "arguments": "",
            }
            arguments = _object(call.arguments)
            events = ("response.function_call_arguments", "arguments")
        if namespace:
            item["namespace"] = namespace
        self._event("response.output_item.added", **where, item=item)
        self._event(f"{events[0]}.delta", item_id=item["id"], **where, delta=text)
        self._event(f"{events[0]}.done", item_id=item["id"], **where, **{events[1]: text})
        item = {**item, events[1]: text} | ({"status": "completed"} if "status" in item else {})
        self._event("response.output_item.done", **where, item=item)
        self.items.append(item)
        self.calls.append({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}})

    # ----------------------------------------------------------------- StreamFormat

    def opening(self) -> list[bytes]:
        self._event("response.created", response=self.response("in_progress"))
        self._event("response.in_progress", response=self.response("in_progress"))
        return self._take()

    def delta(self, delta: Delta) -> list[bytes]:
        if delta.reasoning:
            self._write("reasoning", delta.reasoning)
            self.reasoning_tokens = delta.completion_tokens
        if self.req.logprobs and not delta.reasoning:  # a held-back piece's logprobs go with the text after it
            self.pending += _logprobs(delta)
        if delta.text:
            self._write("message", delta.text, self.pending)
            self.pending = []
        for call in delta.tool_calls:
            self._call(call)
        return self._take()

    def closing(self, last: Delta | None) -> list[bytes]:
        cut = last is not None and last.finish_reason == "length"
        self._close("incomplete" if cut else "completed")
        out_tokens = last.completion_tokens if last is not None else 0
        usage = {
            "input_tokens": self.gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},  # no per-request count of either
            "output_tokens": out_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.gen.prompt_tokens + out_tokens,
        }
        if cut:
            self.final = self.response("incomplete", usage, incomplete_details={"reason": "max_output_tokens"})
        else:
            self.final = self.response("completed", usage, completed_at=int(time.time()))
        if self.store is not None and self.req.store:  # the answer's turn, its reasoning left out (as in history)
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(self.said)}
            if self.calls:
                turn["tool_calls"] = self.calls
            self.store.put(self.final, self.req.history + (turn,))
        self._event("response.incomplete" if cut else "response.completed", response=self.final)
        return self._take()

    def keepalive(self) -> list[bytes]:
        return [core.SSE_KEEPALIVE]

    def failure(self, err: ApiError) -> list[bytes]:
        code = "rate_limit_exceeded" if err.status == 429 else "server_error"
        self._event("error", code=err.code or code, message=err.message, param=err.param)
        self._event("response.failed", response=self.response("failed", error={"code": code, "message": err.message}))
        return self._take()


def _object(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as the object the chat template renders."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def _custom_input(arguments: str) -> str:
    """A custom tool's input: the ``input`` argument the model was offered, else what it wrote."""
    value = _object(arguments).get("input")
    return value if isinstance(value, str) else arguments


async def _respond(request: web.Request, gen: core.Generation, req: ResponsesRequest) -> web.StreamResponse:
    out = Output(gen, req, request.app.get(STORE), req.stream)
    if req.stream:
        return await core.stream(request, gen, out)
    last = None
    async with contextlib.aclosing(core.answered(request, gen)) as deltas:
        async for delta in deltas:
            out.delta(delta)
            last = delta
    out.closing(last)
    return web.json_response(out.final)


async def create(request: web.Request) -> web.StreamResponse:
    store = request.app.get(STORE)
    lookup = store.history if store is not None else (lambda _id: None)
    return await core.generate(request, lambda body, limits: parse(body, limits, lookup), _respond, id_prefix="resp_")


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found (this node keeps the responses it made "
        "with store not false, for a while)",
        param="id",
        code="not_found",
    )


async def retrieve(request: web.Request) -> web.Response:
    response_id = request.match_info["id"]
    store = request.app.get(STORE)
    found = store.response(response_id) if store is not None else None
    if found is None:
        raise _not_found(response_id)
    return web.json_response(found)


async def delete(request: web.Request) -> web.Response:
    """Forget a stored response (a later GET or previous_response_id does not find it)."""
    response_id = request.match_info["id"]
    store = request.app.get(STORE)
    if store is None or not store.delete(response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


def routes(app: web.Application) -> None:
    app[STORE] = ResponseStore()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{id}", retrieve)
    app.router.add_delete("/v1/responses/{id}", delete)
