"""The Ollama surface: what Open WebUI and the ``ollama`` client ask of a server under ``/api/``,
framed as Ollama does (NDJSON streams ending in ``done: true``, durations in ns, errors as
``{"error": message}``). ``<id>:latest`` is ``<id>``."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from functools import partial
from typing import Any

from aiohttp import web

from meshnode.api import core
from meshnode.api import ollama_schema as schema
from meshnode.api.validation import GenerationRequest, Limits
from meshnode.errors import ApiError
from meshnode.serving.answer import ToolCall
from meshnode.serving.engine import Delta, TokenLogprob
from meshnode.weights.profile import ModelProfile

# The Ollama release whose request fields this surface implements (some clients refuse older).
OLLAMA_VERSION = "0.9.0"
NEVER = "2999-12-31T23:59:59Z"  # /api/ps expires_at: a mesh keeps its model loaded


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


STARTED = _now()  # modified_at of every model


# --------------------------------------------------------------------------- answers (pure)


def tool_calls(calls: tuple[ToolCall, ...] | list[ToolCall]) -> list[dict[str, Any]]:
    """Tool calls as Ollama sends them: the arguments as an object, not JSON text."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            arguments = call.arguments
        out.append({"id": call.id, "function": {"name": call.name, "arguments": arguments}})
    return out


def logprobs(entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
    out = []
    for e in entries:
        item: dict[str, Any] = {"token": e.token, "logprob": e.logprob}
        if e.top:
            item["top_logprobs"] = [{"token": t, "logprob": lp} for t, lp in e.top]
        out.append(item)
    return out


def piece(endpoint: str, model: str, delta: Delta) -> dict[str, Any]:
    """One streamed object (``done: false``) holding this delta."""
    obj: dict[str, Any] = {"model": model, "created_at": _now()}
    if endpoint == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": delta.text}
        if delta.reasoning:
            message["thinking"] = delta.reasoning
        if delta.tool_calls:
            message["tool_calls"] = tool_calls(delta.tool_calls)
        obj["message"] = message
    else:
        obj["response"] = delta.text
        if delta.reasoning:
            obj["thinking"] = delta.reasoning
    if delta.logprobs:
        obj["logprobs"] = logprobs(delta.logprobs)
    obj["done"] = False
    return obj


def done_reason(finish: str | None) -> str:
    return "length" if finish == "length" else "stop"  # Ollama ends a tool call with "stop"


class Clock:
    """When a generation's parts happened (perf_counter_ns), for Ollama's durations."""

    def __init__(self, received: int):
        self.received = received
        self.started = time.perf_counter_ns()  # the engine runs
        self.first: int | None = None  # the first piece came
        self.last: int | None = None

    def tick(self) -> None:
        self.last = time.perf_counter_ns()
        self.first = self.first or self.last

    def stats(self, prompt_tokens: int, last: Delta) -> dict[str, Any]:
        end = time.perf_counter_ns()
        first = self.first or end
        return {
            "done_reason": done_reason(last.finish_reason),
            "total_duration": end - self.received,
            "load_duration": 0,  # the model is loaded before any request is taken
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": first - self.started,
            "eval_count": last.completion_tokens,
            "eval_duration": (self.last or end) - first,
        }


async def _timed(deltas: AsyncGenerator[Delta, None], clock: Clock) -> AsyncGenerator[Delta, None]:
    try:
        async for delta in deltas:
            clock.tick()
            yield delta
    finally:
        await deltas.aclose()


def _line(obj: Any) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


class NdjsonStream:
    """A streamed answer: one JSON object per line, the last ``done: true`` with the stats."""

    content_type = "application/x-ndjson"

    def __init__(self, endpoint: str, gen: core.Generation, clock: Clock):
        self.endpoint, self.gen, self.clock = endpoint, gen, clock

    def opening(self) -> list[bytes]:
        return []

    def delta(self, delta: Delta) -> list[bytes]:
        return [_line(piece(self.endpoint, self.gen.model, delta))]

    def closing(self, last: Delta) -> list[bytes]:
        obj = piece(self.endpoint, self.gen.model, Delta("", last.completion_tokens))
        obj.update(done=True, **self.clock.stats(self.gen.prompt_tokens, last))
        return [_line(obj)]

    def keepalive(self) -> list[bytes]:
        # NDJSON has no comment: a piece with nothing in it, as a client reads any other
        return [_line(piece(self.endpoint, self.gen.model, Delta("", self.gen.completion_tokens)))]

    def failure(self, err: ApiError) -> list[bytes]:
        return [_line({"error": err.message})]


def whole(endpoint: str, gen: core.Generation, answer: core.Answer, clock: Clock) -> dict[str, Any]:
    """The one object of an answer that is not streamed."""
    delta = Delta(
        answer.text,
        answer.last.completion_tokens,
        reasoning=answer.reasoning,
        tool_calls=tuple(answer.tool_calls),
        logprobs=tuple(answer.logprobs),
    )
    obj = piece(endpoint, gen.model, delta)
    obj.update(done=True, **clock.stats(gen.prompt_tokens, answer.last))
    return obj


# --------------------------------------------------------------------------- generations


async def _respond(
    endpoint: str, received: int, request: web.Request, gen: core.Generation, req: GenerationRequest
) -> web.StreamResponse:
    clock = Clock(received)
    gen.deltas = _timed(gen.deltas, clock)
    if req.stream:
        return await core.stream(request, gen, NdjsonStream(endpoint, gen, clock))
    return web.json_response(whole(endpoint, gen, await core.collect(request, gen), clock))


async def _generation(request: web.Request, endpoint: str) -> web.StreamResponse:
    received = time.perf_counter_ns()
    served = _served(request)

    def parse(body: Any, limits: Limits) -> GenerationRequest:
        return schema.parse(body, endpoint, limits, served)

    # Parsed first for Ollama's "load the model" call; a bad body is left to core.generate.
    try:
        req = parse(await core.json_body(request), request.app[core.SETTINGS].limits)
    except (ApiError, web.HTTPException):
        req = None
    if req is not None and schema.loads_only(req):
        request.app[core.BACKEND].engine(req.model)  # 404 for a model not served, 503 while forming
        obj = piece(endpoint, req.model, Delta("", 0))
        obj.update(done=True, done_reason="load")
        return web.json_response(obj)
    return await core.generate(
        request,
        parse if req is None else (lambda _body, _limits: req),
        partial(_respond, endpoint, received),
        id_prefix="ollama-",
    )


async def chat(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "chat")


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generation(request, "generate")


# --------------------------------------------------------------------------- models


def _served(request: web.Request) -> list[str]:
    return [m["id"] for m in request.app[core.BACKEND].models()]


def parameter_count(p: ModelProfile) -> int:
    """The model's parameters, from its shape."""
    attention = p.hidden_size * p.head_dim * 2 * (p.num_heads + p.num_kv_heads)
    if p.num_experts:
        mlp = p.num_experts * (3 * p.hidden_size * p.moe_intermediate_size + p.hidden_size)
    else:
        mlp = 3 * p.hidden_size * p.intermediate_size
    return p.num_layers * (attention + mlp) + p.vocab_size * p.hidden_size * (1 if p.tied_embeddings else 2)


def details(p: ModelProfile | None) -> dict[str, Any]:
    """Ollama's ``details`` of a model."""
    if p is None:
        return {
            "parent_model": "",
            "format": "mlx",
            "family": "",
            "families": [],
            "parameter_size": "",
            "quantization_level": "",
        }
    n = parameter_count(p)
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.2f}K"
    if p.quantization or p.quant_group_size:  # a GGUF file's type, or Q<bits> ("" from an older peer)
        level = p.quantization
    else:
        level = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(p.dtype, p.dtype.upper())
    return {
        "parent_model": "",
        "format": "mlx",
        "family": p.model_type,
        "families": [p.model_type],
        "parameter_size": size,
        "quantization_level": level,
    }


def _entry(backend: Any, model_id: str) -> dict[str, Any]:
    p = backend.model_profile(model_id)  # None: details stay empty
    return {
        "name": model_id,
        "model": model_id,
        "modified_at": STARTED,
        "size": p.weight_bytes() if p else 0,
        "digest": hashlib.sha256(model_id.encode()).hexdigest(),  # of the name: there is no manifest
        "details": details(p),
    }


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_VERSION})


async def tags(request: web.Request) -> web.Response:
    """Every served model, also while the mesh forms."""
    backend = request.app[core.BACKEND]
    return web.json_response({"models": [_entry(backend, m["id"]) for m in backend.models()]})


async def ps(request: web.Request) -> web.Response:
    """The models ready to answer now."""
    backend, running = request.app[core.BACKEND], []
    for m in backend.models():
        if m["state"] != "ready":
            continue  # loading, or loaded on demand (several models on one mesh)
        try:
            engine = backend.engine(m["id"])
        except ApiError:
            continue
        entry = _entry(backend, m["id"])
        running.append({**entry, "expires_at": NEVER, "size_vram": entry["size"], "context_length": engine.max_context})
    return web.json_response({"models": running})


async def show(request: web.Request) -> web.Response:
    backend = request.app[core.BACKEND]
    engine = backend.engine(schema.show_model(await core.json_body(request), _served(request)))
    tokenizer, p = engine.tokenizer, backend.model_profile(engine.model_id)
    capabilities = (
        ["completion"]
        + (["tools"] if getattr(tokenizer, "has_tool_calling", False) else [])
        + (["thinking"] if getattr(tokenizer, "has_thinking", False) else [])
    )
    template = getattr(tokenizer, "chat_template", None)
    parameters = "\n".join(f"{name} {value}" for name, value in schema.DEFAULTS.items())
    arch = p.model_type if p else "unknown"
    info: dict[str, Any] = {
        "general.architecture": arch,
        "general.basename": engine.model_id,
        f"{arch}.context_length": engine.max_context,
    }
    if p is not None:
        info.update(
            {
                "general.parameter_count": parameter_count(p),
                f"{arch}.block_count": p.num_layers,
                f"{arch}.embedding_length": p.hidden_size,
                f"{arch}.attention.head_count": p.num_heads,
                f"{arch}.attention.head_count_kv": p.num_kv_heads,
                f"{arch}.vocab_size": p.vocab_size,
            }
        )
    return web.json_response(
        {
            "modelfile": f"# Modelfile of meshnode's model {engine.model_id}\nFROM {engine.model_id}\n"
            + "".join(f"PARAMETER {line}\n" for line in parameters.splitlines()),
            "parameters": parameters,
            "template": template if isinstance(template, str) else "",
            "details": details(p),
            "model_info": info,
            "capabilities": capabilities,
            "modified_at": STARTED,
        }
    )


def routes(app: web.Application) -> None:
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/tags", tags)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)


def owns(request: web.Request) -> bool:
    """Whether ``request`` is this surface's (its errors take Ollama's shape)."""
    return request.path.startswith("/api/")


def error_body(err: ApiError) -> dict[str, Any]:
    return {"error": err.message}
