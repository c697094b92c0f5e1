"""What the API surfaces (OpenAI, Ollama, Anthropic) share: one generation from a checked
:class:`GenerationRequest` to its deltas, which each surface collects or streams in its own
:class:`StreamFormat`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiohttp import web

from meshnode.api.validation import GenerationRequest, Limits
from meshnode.config import Settings
from meshnode.errors import ApiError
from meshnode.ids import ModelId, RequestId
from meshnode.logonce import Once
from meshnode.metrics import NodeMetrics, outcome_for_status
from meshnode.serving.answer import AnswerShape, ToolCall, initial_state
from meshnode.serving.engine import Delta, Engine, TokenLogprob
from meshnode.serving.grammar import grammar_error, grammar_from_schema
from meshnode.serving.sampling import SamplingParams
from meshnode.tracing import mark

if TYPE_CHECKING:
    from meshnode.weights.profile import ModelProfile

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how often a generation with nothing new looks whether its client is still there
KEEPALIVE_S = 5.0  # the longest a stream stays silent: clients' idle timeouts read silence as a dead server
SSE_KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it


class Backend(Protocol):
    def engine(self, model: str) -> Engine:
        """The engine serving ``model`` now, or ApiError: 404 if not served here, 503 while it cannot be."""

    async def ready_engine(self, model: str) -> Engine:
        """As :meth:`engine`, for a generation: a re-plan that is loading is waited out (bounded)."""

    def models(self) -> list[dict[str, Any]]:
        """Every model this mesh serves, ready or not: ``id`` and ``state``."""

    def mesh_status(self) -> dict[str, Any]: ...

    def health(self) -> tuple[bool, dict[str, Any]]: ...

    async def add_model(self, spec: str) -> dict[str, Any]:
        """Offer one more model."""

    async def remove_model(self, model_id: str) -> dict[str, Any]:
        """Stop offering a model."""

    def model_profile(self, model: str) -> ModelProfile | None:
        """The served model's shape and sizes, None before they are known."""


@dataclass(frozen=True)
class ApiSettings:
    limits: Limits = Limits()
    max_body_bytes: int = 1 << 20
    max_concurrent_requests: int = 8
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()  # web origins whose pages may call the API
    access_log: bool = True  # one INFO line per request

    @classmethod
    def of(cls, s: Settings) -> ApiSettings:
        return cls(
            limits=Limits(max_tokens_limit=s.max_tokens_limit, default_max_tokens=s.default_max_tokens),
            max_body_bytes=s.max_body_bytes,
            max_concurrent_requests=s.max_concurrent_requests,
            api_key=s.api_key,
            cors_origins=s.cors_origins,
            access_log=s.access_log,
        )


BACKEND: web.AppKey[Backend] = web.AppKey("backend")
SETTINGS = web.AppKey("settings", ApiSettings)
ACTIVE = web.AppKey("active", list)
METRICS = web.AppKey("metrics", NodeMetrics)
OUTCOME = web.ResponseKey("outcome", str)  # how a generation ended
ACCESS = web.RequestKey("access", dict)  # what a generation adds to its access line


async def json_body(request: web.Request) -> Any:
    limit = request.app[SETTINGS].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    raw = await request.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"invalid JSON body: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "invalid JSON body: nested too deeply", code="invalid_json") from None


@dataclass
class Generation:
    """One running generation, for the surface to frame."""

    id: RequestId
    model: ModelId
    prompt_tokens: int
    deltas: AsyncGenerator[Delta, None]
    access: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.access.update(model=self.model, prompt_tokens=self.prompt_tokens, completion_tokens=0)

    @property
    def completion_tokens(self) -> int:
        count: int = self.access["completion_tokens"]
        return count

    def advance(self, delta: Delta) -> None:
        self.access["completion_tokens"] = delta.completion_tokens


Req = TypeVar("Req", bound=GenerationRequest)  # a surface's own request
Respond = Callable[[web.Request, Generation, Req], Awaitable[web.StreamResponse]]


async def generate(
    request: web.Request, parse: Callable[[Any, Limits], Req], respond: Respond[Req], id_prefix: str = ""
) -> web.StreamResponse:
    """Serve one generation request and count it by outcome."""
    outcome = "error"
    try:
        response = await _serve(request, parse, respond, id_prefix)
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


async def _serve(
    request: web.Request, parse: Callable[[Any, Limits], Req], respond: Respond[Req], id_prefix: str
) -> web.StreamResponse:
    app = request.app
    limits = app[SETTINGS].limits
    req = parse(await json_body(request), limits)
    engine = await app[BACKEND].ready_engine(req.model)
    with _Slot(app), engine.arriving():
        grammar = await _grammar(engine, req)
        prompt, shape = await _prompt_tokens(engine, req)
        max_tokens = _budget(engine, req, len(prompt), limits)
        params = sampling(engine, req, max_tokens, grammar)
        gen = Generation(
            RequestId(id_prefix + uuid.uuid4().hex[:24]),
            engine.model_id,
            len(prompt),
            engine.stream(prompt, params, req.stop, shape),
        )
        request[ACCESS] = gen.access
        try:
            return await respond(request, gen, req)
        except ConnectionResetError:  # a client that stopped waiting for a whole answer
            _note_left(gen)
            response = web.Response(status=499)  # nginx's "client closed request": never sent
            response[OUTCOME] = "cancelled"
            return response
        finally:
            await gen.deltas.aclose()


async def _grammar(engine: Engine, req: GenerationRequest) -> str:
    """The grammar for the request's JSON schema, checked against the tokenizer ("" for none)."""
    if req.json_schema is None:
        return ""
    try:
        grammar = grammar_from_schema(req.json_schema)
        why = await asyncio.to_thread(grammar_error, grammar, engine.tokenizer)
    except ValueError as exc:
        why = str(exc)
    if why:
        raise ApiError(
            400,
            f"response_format: this JSON schema cannot be followed: {why}",
            param="response_format",
            code="invalid_value",
        )
    return grammar


def sampling(engine: Engine, req: GenerationRequest, max_tokens: int, grammar: str = "") -> SamplingParams:
    """The request's sampling, its token ids checked against the vocabulary."""
    vocab = engine.vocab_size
    bias = req.logit_bias or {}
    bad = next((t for t in bias if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            400,
            f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})",
            param="logit_bias",
            code="invalid_value",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        top_k=min(req.top_k or 0, vocab),
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=tuple(sorted(bias.items())),
        top_logprobs=req.top_logprobs if req.logprobs else -1,
        grammar=grammar,
    )


async def _prompt_tokens(engine: Engine, req: GenerationRequest) -> tuple[list[int], AnswerShape | None]:
    """The prompt's token ids, and for a chat how its answer is read."""
    tokenizer = engine.tokenizer
    if req.kind == "chat":
        return await chat_prompt(engine, req)
    if isinstance(req.prompt, list):
        vocab = engine.vocab_size
        bad = next((t for t in req.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt", code="invalid_value"
            )
        return list(req.prompt), None
    return list(await asyncio.to_thread(tokenizer.encode, req.prompt)), None


_TOOLLESS = Once()  # models whose template has no place for tools


async def chat_prompt(engine: Engine, req: GenerationRequest) -> tuple[list[int], AnswerShape]:
    """The chat template applied, with tools and thinking switch; tool_choice "required" ends the
    prompt with the tool-call marker (a named function: "required" with only that tool)."""
    tokenizer = engine.tokenizer
    tools, choice = req.tools, req.tool_choice
    if choice == "none":
        tools = None
    if tools and not (getattr(tokenizer, "has_tool_calling", False) and getattr(tokenizer, "chat_template", None)):
        if choice == "required" or isinstance(choice, dict):  # a call must come: the model cannot make one
            raise ApiError(
                400,
                f"tool_choice asks for a tool call, and model {engine.model_id} cannot make one: its chat "
                "template has no tool-call format; send tool_choice auto or none",
                param="tool_choice",
                code="unsupported_value",
            )
        # Tools are always accepted (Open WebUI sends some with every chat); a template without
        # a place for them answers without them.
        if _TOOLLESS.first(engine.model_id):
            log.warning(
                "model %s has no tool-call format in its chat template: requests with tools are answered without them",
                engine.model_id,
            )
        tools = None
    if isinstance(choice, dict) and tools:
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    forced = bool(tools) and (choice == "required" or isinstance(choice, dict))
    if not getattr(tokenizer, "chat_template", None):
        if req.think is not None or req.template_kwargs:
            raise ApiError(
                400,
                f"model {engine.model_id} has no chat template to take template options",
                param="chat_template_kwargs",
                code="unsupported_value",
            )
        text = "".join(f"{m['role']}: {m['content']}\n" for m in req.messages) + "assistant: "
        return list(await asyncio.to_thread(tokenizer.encode, text)), AnswerShape()
    kwargs = dict(req.template_kwargs)
    if tools:
        kwargs["tools"] = tools
    think = req.think
    if think is None and req.json_schema is not None:
        think = False  # the answer is the JSON document from its first token
    if think is not None:
        kwargs["enable_thinking"] = think  # mlx-lm's wrapper renames it for the model's template

    def render() -> list[int]:
        try:
            tokens = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a template that raises on this chat
            raise ApiError(
                400, f"the model's chat template refused these messages: {exc}", param="messages", code="invalid_value"
            ) from None
        if isinstance(tokens, dict):  # transformers may return a BatchEncoding
            tokens = tokens["input_ids"]
        tokens = list(tokens)
        if forced:
            if initial_state(tokenizer, tokens) == "reasoning":  # the template opened a think block: close it
                tokens += tokenizer.encode(tokenizer.think_end, add_special_tokens=False)
            tokens += tokenizer.encode(tokenizer.tool_call_start, add_special_tokens=False)
        return tokens

    prompt = await asyncio.to_thread(render)
    return prompt, AnswerShape(tools=tools or None, forced_tool=forced)


def _budget(engine: Engine, req: GenerationRequest, prompt_len: int, limits: Limits) -> int:
    room = engine.max_context - prompt_len
    if room <= 0:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens; this model's context is {engine.max_context} tokens",
            param="messages" if req.kind == "chat" else "prompt",
            code="context_length_exceeded",
        )
    # Room, not refusal: agents ask for more than the context holds and expect "length" at the
    # room left, as mlx_lm.server and Ollama do.
    cap = min(room, limits.max_tokens_limit)
    if req.max_tokens is None:  # the room left (a reasoning model's thinking is not cut short)
        return min(limits.default_max_tokens or cap, cap)
    return min(req.max_tokens, cap)


class _Slot:
    """Admission control: at most N generations at once on this node; 429 beyond."""

    def __init__(self, app: web.Application):
        self._active = app[ACTIVE]
        self._limit = app[SETTINGS].max_concurrent_requests

    def __enter__(self) -> _Slot:
        if len(self._active) >= self._limit:
            raise ApiError(
                429,
                f"too many concurrent requests (limit {self._limit}); retry shortly",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._active.remove(self)


@dataclass
class Answer:
    """A whole answer, with the last delta (finish reason, completion tokens)."""

    text: str
    reasoning: str
    tool_calls: list[ToolCall]
    logprobs: list[TokenLogprob]
    last: Delta


def _client_left(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _note_left(gen: Generation) -> None:
    """Note a client that left ``gen``: one line, no traceback."""
    log.info("client disconnected from %s after %d tokens; generation stopped", gen.id, gen.completion_tokens)
    gen.access["disconnected"] = True


async def watched(request: web.Request, gen: Generation) -> AsyncGenerator[Delta | None, None]:
    """``gen``'s deltas, and None after each WATCH_S that brings none (a prefill, a queue); raises
    ConnectionResetError once the client has gone, which closes the generation on every stage."""
    step: asyncio.Future[Delta] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(gen.deltas))
            while not (await asyncio.wait({step}, timeout=WATCH_S))[0]:
                if _client_left(request):
                    raise ConnectionResetError("client went away")
                yield None
            try:
                delta = step.result()
            except StopAsyncIteration:
                return
            step = None
            gen.advance(delta)
            yield delta
    finally:
        if step is not None and not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)  # the generation has let go of its stages


async def answered(request: web.Request, gen: Generation) -> AsyncGenerator[Delta, None]:
    """``gen``'s deltas, for a surface that does not stream; ConnectionResetError once the client has gone."""
    async with contextlib.aclosing(watched(request, gen)) as pieces:
        async for delta in pieces:
            if delta is not None:
                yield delta


async def collect(request: web.Request, gen: Generation) -> Answer:
    """The whole answer, for a surface that does not stream."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    logprobs: list[TokenLogprob] = []
    last: Delta | None = None
    async with contextlib.aclosing(answered(request, gen)) as deltas:
        async for delta in deltas:
            text.append(delta.text)
            reasoning.append(delta.reasoning)
            calls.extend(delta.tool_calls)
            logprobs.extend(delta.logprobs)
            last = delta
    assert last is not None, "a generation ends with its final delta"
    return Answer("".join(text), "".join(reasoning), calls, logprobs, last)


class StreamFormat(Protocol):
    """How a surface frames a streamed answer; each method returns the frames to send."""

    content_type: str

    def opening(self) -> list[bytes]: ...

    def delta(self, delta: Delta) -> list[bytes]:
        """Frames for one piece."""

    def closing(self, last: Delta) -> list[bytes]: ...

    def keepalive(self) -> list[bytes]:
        """Frames that carry nothing, sent while a long prompt is prefilled or queued."""

    def failure(self, err: ApiError) -> list[bytes]:
        """After the headers are sent an error can only be framed into the stream."""


async def stream(request: web.Request, gen: Generation, fmt: StreamFormat) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": fmt.content_type, "Cache-Control": "no-cache"})
    await response.prepare(request)
    written = asyncio.get_running_loop().time()

    async def send(frames: list[bytes]) -> None:
        nonlocal written
        for frame in frames:
            if _client_left(request):
                raise ConnectionResetError("client went away")
            await response.write(frame)
        written = asyncio.get_running_loop().time()
        mark("api.written")

    try:
        await send(fmt.opening())
        last: Delta | None = None
        async with contextlib.aclosing(watched(request, gen)) as pieces:
            async for delta in pieces:
                if delta is None:
                    if asyncio.get_running_loop().time() - written >= KEEPALIVE_S:
                        await send(fmt.keepalive())
                    continue
                last = delta
                if delta.carries:
                    await send(fmt.delta(delta))
        assert last is not None, "a generation ends with its final delta"
        await send(fmt.closing(last))
    except ConnectionResetError:  # a client leaving is normal: one line, no traceback
        _note_left(gen)
        response[OUTCOME] = "cancelled"  # counted by generate
    except asyncio.CancelledError:
        _note_left(gen)
        raise
    except ApiError as err:
        response[OUTCOME] = outcome_for_status(err.status)  # counted by generate
        await send(fmt.failure(err))
    except Exception:  # headers are sent: a 500 now would corrupt the stream
        log.exception("generation %s failed mid-stream", gen.id)
        response[OUTCOME] = "error"
        await send(fmt.failure(ApiError(500, "internal error", type="server_error")))
    return response
