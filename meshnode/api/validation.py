"""Check OpenAI request bodies and turn them into a :class:`GenerationRequest`. Pure. Undeclared
fields are refused, so no client believes a parameter took effect; ``HARMLESS`` fields are ignored
because ignoring them cannot change the answer."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator
from pydantic_core import PydanticCustomError

from meshnode.api.schema import JsonObject, Number, Strict, one_of, optional, validate
from meshnode.errors import ApiError

__all__ = ["ApiError", "GenerationRequest", "HARMLESS", "Limits", "parse_request"]

log = logging.getLogger(__name__)

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)
MAX_STOP = 4
# What a request asks for: a chat turn from messages, or a completion of a prompt.
RequestKind = Literal["chat", "completion"]


@dataclass(frozen=True)
class Limits:
    max_tokens_limit: int = 4096
    default_max_tokens: int = 0  # 0: the room left in the context


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request, the same whichever API it came through."""

    kind: RequestKind
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str | list[int] | None = None
    max_tokens: int | None = None  # None: the server picks
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    # mlx-lm's other sampler filters and logits processors; None: off.
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: this many alternatives per token
    # Function tools in OpenAI's form, for the chat template; tool_choice as OpenAI's.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    think: bool | None = None  # reasoning models: think first (None: the model's default)
    json_schema: dict[str, Any] | None = None  # the answer is JSON valid under it
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # more for the chat template


# (name, type) pairs; every field is optional (null = absent).
HARMLESS: tuple[tuple[str, Any], ...] = (
    ("user", str),
    ("safety_identifier", str),
    ("metadata", dict[str, str]),
    ("store", bool),
    ("service_tier", str),
    ("prompt_cache_key", str),
    ("prompt_cache_retention", str),
    ("parallel_tool_calls", bool),
    ("modalities", list[Literal["text"]]),
    ("verbosity", Literal["medium"]),  # OpenAI's default; no open model takes a length hint
)
HARMLESS_COMPLETION: tuple[tuple[str, Any], ...] = (  # /v1/completions only
    ("echo", Literal[False]),  # true would repeat the prompt before the answer
    ("best_of", Literal[1]),  # more would sample several answers and return the best
    ("suffix", None),  # a suffix asks for an insertion, not a continuation
)
if TYPE_CHECKING:  # a model made by create_model is a class the type checker cannot see into
    _Accepted = Strict
else:
    _Accepted = create_model("_Accepted", __base__=Strict, **optional(HARMLESS))


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # harmless: there is no obfuscation padding


class _Sampling(_Accepted):
    """The honoured fields both endpoints share."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name; wins over max_tokens
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: Annotated[str | list[str], one_of("must be a string or a list of strings")] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1)  # one choice per request
    # mlx-lm's sampler filters and logits processors
    top_k: int | None = Field(None, ge=0)
    min_p: Number | None = Field(None, ge=0, le=1)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    repetition_penalty: Number | None = Field(None, gt=0)  # vLLM's and mlx-lm's name
    repeat_penalty: Number | None = Field(None, gt=0)  # Ollama's and llama.cpp's name, sent by Open WebUI
    logit_bias: dict[str, Annotated[Number, Field(ge=-100, le=100)]] | None = None  # token id -> bias

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        bad = next((k for k in value or () if not k.isdigit()), None)
        if bad is not None:
            raise PydanticCustomError("invalid_value", "takes token ids as keys, got {key}", {"key": json.dumps(bad)})
        return value

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, value: str | list[str] | None) -> list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise PydanticCustomError("invalid_value", "takes at most {most} strings", {"most": MAX_STOP})
        return [value] if isinstance(value, str) else value


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)  # other keys (cache_control...) ignored
    type: Literal["text"]
    text: str


class _CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)
    name: str
    arguments: str | JsonObject = "{}"  # JSON text (OpenAI); some clients send the object


class _ToolCallIn(BaseModel):
    """A tool call in an earlier assistant turn, copied back by the client."""

    model_config = ConfigDict(strict=True, frozen=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: _CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)  # other keys ignored
    role: Role
    tool_calls: list[_ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None
    content: Annotated[
        str | list[TextPart] | None, one_of("must be a string or a list of text parts {'type': 'text', 'text': ...}")
    ] = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _null_for_assistant_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError("invalid_type", "must be a string or a list of text parts")
        return value

    def plain(self) -> dict[str, Any]:
        """The message as the chat template takes it (tool call arguments as an object)."""
        text = "".join(part.text for part in self.content) if isinstance(self.content, list) else self.content
        # OpenAI's newer name for system; templates know "system" (Qwen's drops unknown roles)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": text or ""}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _arguments(value: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value or "{}")
    except json.JSONDecodeError:
        raise ApiError(
            400,
            "a tool call's arguments in the chat history are not valid JSON",
            param="messages",
            code="invalid_value",
        ) from None
    return parsed if isinstance(parsed, dict) else {"value": parsed}


class _Function(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: _Function


class _Named(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: _Named


class _JsonSchema(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """text, json_object (any JSON object) or json_schema (an answer valid under the schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None

    @field_validator("json_schema")
    @classmethod
    def _only_for_json_schema(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("type") != "json_schema":
            raise PydanticCustomError("invalid_value", "goes with type json_schema only")
        return value


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: (
        Annotated[
            Literal["none", "auto", "required"] | NamedToolChoice,
            one_of('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'),
        ]
        | None
    ) = None
    functions: list[_Function] | None = None  # the older form of tools
    function_call: (
        Annotated[Literal["none", "auto"] | _Named, one_of('must be "none", "auto" or {"name": ...}')] | None
    ) = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: JsonObject | None = None  # vLLM's and mlx_lm.server's: {"enable_thinking": false}


if TYPE_CHECKING:

    class _Completion(_Sampling):
        logprobs: int | None
else:
    _Completion = create_model(
        "_Completion",
        __base__=_Sampling,
        **optional(HARMLESS_COMPLETION),
        logprobs=(Annotated[int, Field(ge=0, le=20)] | None, None),
    )  # the legacy top-n
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Completion):
    prompt: Annotated[
        Annotated[str, Field(min_length=1)] | TokenIds, one_of("must be a non-empty string or a list of token ids")
    ]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) else value


def parse_request(body: Any, kind: RequestKind, limits: Limits) -> GenerationRequest:
    req = validate(ChatRequest if kind == "chat" else CompletionRequest, body, {"limits": limits})
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    repetition = req.repetition_penalty if req.repetition_penalty is not None else req.repeat_penalty
    common = dict(
        model=req.model,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        seed=req.seed,
        stop=tuple(s for s in req.stop or () if s),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        top_k=req.top_k or None,
        min_p=req.min_p or None,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=repetition,
        logit_bias={int(k): float(v) for k, v in req.logit_bias.items()} if req.logit_bias else None,
    )
    if isinstance(req, CompletionRequest):
        logprobs = req.logprobs is not None
        return GenerationRequest(
            kind="completion", prompt=req.prompt, logprobs=logprobs, top_logprobs=req.logprobs or 0, **common
        )
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    tools, choice = _tools(req)
    kwargs = dict(req.chat_template_kwargs or {})
    think = None
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort  # gpt-oss's template takes it as it is
        think = req.reasoning_effort not in ("none", "minimal")
    schema = _json_schema(req.response_format)
    if schema is not None and tools and choice != "none":
        raise ApiError(
            400,
            "response_format json and tools cannot both shape one answer here; send one",
            param="response_format",
            code="invalid_value",
        )
    return GenerationRequest(
        kind="chat",
        messages=[m.plain() for m in req.messages],
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        tools=tools,
        tool_choice=choice,
        think=think,
        template_kwargs=kwargs,
        json_schema=schema,
        **common,
    )


def _json_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError(
            400,
            "'response_format.json_schema.schema' is required for type json_schema",
            param="response_format.json_schema.schema",
            code="missing_required_parameter",
        )
    return fmt.json_schema.schema_


def _tools(req: ChatRequest) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """The request's tools and tool_choice (older functions/function_call read as those)."""
    if req.functions is not None and req.tools is not None:
        raise ApiError(400, "send 'tools' or the older 'functions', not both", param="functions", code="invalid_value")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools is not None else None
    if req.functions is not None:
        tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in req.functions]
    asked = req.tool_choice if req.tool_choice is not None else req.function_call
    choice: str | dict[str, Any] | None
    if isinstance(asked, NamedToolChoice | _Named):
        name = asked.function.name if isinstance(asked, NamedToolChoice) else asked.name
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise ApiError(
                400,
                f"tool_choice names '{name}', which is not one of the request's tools",
                param="tool_choice",
                code="invalid_value",
            )
        choice = {"type": "function", "function": {"name": name}}
    else:
        choice = asked
    if choice == "required" and not tools:
        raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice", code="invalid_value")
    return (tools or None), choice
