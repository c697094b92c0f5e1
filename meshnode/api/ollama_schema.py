"""Ollama's request bodies as strict pydantic models, translated into a :class:`GenerationRequest`.
Pure. Fields that would change the answer but are not implemented are refused."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator
from pydantic_core import PydanticCustomError

from meshnode.api.schema import JsonObject, Number, Strict, one_of, optional, validate
from meshnode.api.validation import GenerationRequest, Limits
from meshnode.errors import ApiError

# What Ollama's docs give as the defaults (docs/modelfile.md, "Valid Parameters and Values").
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}

IGNORED: tuple[tuple[str, Any], ...] = (
    ("num_ctx", int),
    ("num_batch", int),
    ("num_gpu", int),
    ("main_gpu", int),
    ("num_thread", int),
    ("num_keep", int),
    ("low_vram", bool),
    ("f16_kv", bool),
    ("logits_all", bool),
    ("vocab_only", bool),
    ("use_mmap", bool),
    ("use_mlock", bool),
    ("numa", bool),
    ("embedding_only", bool),
    ("mirostat_tau", Number),
    ("mirostat_eta", Number),
)


def _off(off: Any) -> AfterValidator:
    def check(value: Any) -> Any:
        if value is not None and value != off:
            raise PydanticCustomError(
                "invalid_value", "is not supported; only {off} (off) is accepted", {"off": str(off).lower()}
            )
        return value

    return AfterValidator(check)


OFF_ONLY: tuple[tuple[str, Any], ...] = (
    ("mirostat", Annotated[int, _off(0)]),
    ("typical_p", Annotated[Number, _off(1)]),
    ("tfs_z", Annotated[Number, _off(1)]),
    ("penalize_newline", Annotated[bool, _off(False)]),
)

if TYPE_CHECKING:  # a model made by create_model is a class the type checker cannot see into
    _OptionsBase = Strict
else:
    _OptionsBase = create_model("_OptionsBase", __base__=Strict, **optional(IGNORED + OFF_ONLY))


class Options(_OptionsBase):
    temperature: Number | None = Field(None, ge=0)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # 0: off
    min_p: Number | None = Field(None, ge=0, le=1)  # 0: off
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    num_predict: int | None = None  # -1: no limit but the server's
    stop: Annotated[str | list[str], one_of("must be a string or a list of strings")] | None = None
    repeat_penalty: Number | None = Field(None, gt=0)  # 1: off
    presence_penalty: Number | None = None  # 0: off
    frequency_penalty: Number | None = None  # 0: off
    repeat_last_n: int | None = None

    @field_validator("num_predict")
    @classmethod
    def _budget(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise PydanticCustomError("invalid_value", "must be -1 (no limit) or a positive number")
        return value

    @field_validator("repeat_last_n")
    @classmethod
    def _window(cls, value: int | None, info: ValidationInfo) -> int | None:
        penalties = (
            info.data.get("repeat_penalty") not in (None, 1),
            info.data.get("presence_penalty") not in (None, 0),
            info.data.get("frequency_penalty") not in (None, 0),
        )
        if value is not None and any(penalties):
            raise PydanticCustomError("invalid_value", "is not supported: penalties look back a fixed 20 tokens")
        return value


class _Function(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)
    name: str = Field(min_length=1)
    arguments: JsonObject
    index: int | None = None  # Open WebUI numbers the calls


class ToolCallIn(Strict):
    function: _Function
    id: str | None = None
    type: Literal["function"] | None = None
    index: int | None = None


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None  # the ollama client leaves an empty content out
    thinking: str | None = None
    images: list[Any] | None = None  # refused in parse() unless empty
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="allow")  # JSON schema keys pass through
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: JsonObject | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: ToolSpec


def _refused(what: str) -> AfterValidator:
    """A field that is refused unless empty (how clients spell "not used")."""

    def check(value: Any) -> Any:
        if value:
            raise PydanticCustomError("invalid_value", "is not supported yet: {what}", {"what": what})
        return value

    return AfterValidator(check)


def _think(value: bool | str) -> bool | str:
    if isinstance(value, str):
        raise PydanticCustomError("invalid_value", "takes true or false here; thinking levels are not supported")
    return value


# Structured output: "json" (any JSON object) or a JSON schema ("": none, as Ollama reads it).
Format = Annotated[Literal["json", ""] | JsonObject, one_of('must be "json" or a JSON schema object')]


class _Common(Strict):
    model: str = Field(min_length=1)
    stream: bool | None = None  # Ollama's default: true
    options: Options | None = None
    format: Format | None = None
    keep_alive: Annotated[str | Number, one_of("must be a duration string or a number")] | None = None
    think: Annotated[bool | str, AfterValidator(_think)] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    template: Annotated[str, _refused("a template of the request's own")] | None = None


class ChatBody(_Common):
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    system: str | None = None  # not a field of Ollama's /api/chat: ignored there too
    metadata: JsonObject | None = None  # Open WebUI's; who is asking


class GenerateBody(_Common):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    suffix: Annotated[str, _refused("fill-in-the-middle (suffix)")] | None = None
    context: Annotated[list[int], _refused("the context of an earlier answer; send the text instead")] | None = None
    images: Annotated[list[str], _refused("this server serves text models only")] | None = None


class ShowBody(Strict):
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool | None = None


def resolve(name: str, served: list[str]) -> str:
    """``<id>:latest`` (how Ollama clients spell a name without a tag) is the served ``<id>``."""
    if name not in served and name.endswith(":latest") and name[: -len(":latest")] in served:
        return name[: -len(":latest")]
    return name


def show_model(body: Any, served: list[str]) -> str:
    req = validate(ShowBody, body)
    name = req.model or req.name
    if not name:
        raise ApiError(400, "'model' is required", param="model", code="missing_required_parameter")
    return resolve(name, served)


def parse(body: Any, endpoint: str, limits: Limits, served: list[str]) -> GenerationRequest:
    """A /api/chat or /api/generate body as a GenerationRequest (nothing to answer: Ollama's "load
    the model" call, :func:`loads_only`)."""
    if isinstance(body, dict) and isinstance(body.get("messages"), list):  # images: a clear message first
        for i, m in enumerate(body["messages"]):
            if isinstance(m, dict) and m.get("images"):
                raise ApiError(
                    400,
                    f"'messages[{i}].images' is not supported yet: this server serves text models only",
                    param=f"messages[{i}].images",
                    code="invalid_value",
                )
    req = validate(ChatBody if endpoint == "chat" else GenerateBody, body, {"limits": limits})
    common = dict(
        model=resolve(req.model, served),
        stream=req.stream is not False,
        think=req.think,
        logprobs=bool(req.logprobs),
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        json_schema={"type": "object"} if req.format == "json" else (req.format or None),
        **sampling(req.options),
    )
    if isinstance(req, ChatBody):
        tools = [t.model_dump(exclude_none=True) for t in req.tools or ()] or None
        return GenerationRequest(kind="chat", messages=template_messages(req.messages or []), tools=tools, **common)
    if req.raw:
        if req.system:
            raise ApiError(
                400,
                "'system' cannot be used with raw: a raw prompt is sent as it is",
                param="system",
                code="invalid_value",
            )
        return GenerationRequest(kind="completion", prompt=req.prompt or "", **common)
    messages = [{"role": "system", "content": req.system}] if req.system else []
    if req.prompt:
        messages.append({"role": "user", "content": req.prompt})
    return GenerationRequest(kind="chat", messages=messages, **common)


def loads_only(req: GenerationRequest) -> bool:
    return not req.messages and not req.prompt


def sampling(options: Options | None) -> dict[str, Any]:
    """The fields ``options`` sets, with Ollama's defaults; neutral values are off."""
    o = options or Options()

    def value(name: str, neutral: float | None = None) -> Any:
        v = getattr(o, name)
        return None if v is None or v == neutral else v

    stop = [o.stop] if isinstance(o.stop, str) else o.stop or []
    return dict(
        temperature=float(DEFAULTS["temperature"] if o.temperature is None else o.temperature),
        top_p=float(DEFAULTS["top_p"] if o.top_p is None else o.top_p),
        top_k=DEFAULTS["top_k"] if o.top_k is None else (o.top_k or None),
        min_p=value("min_p", 0),
        seed=o.seed,
        max_tokens=None if o.num_predict in (None, -1) else o.num_predict,
        stop=tuple(s for s in stop if s),
        repetition_penalty=value("repeat_penalty", 1),
        presence_penalty=value("presence_penalty", 0),
        frequency_penalty=value("frequency_penalty", 0),
    )


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama's messages in OpenAI's shape, tool calls given ids matched to their results."""
    out: list[dict[str, Any]] = []
    open_calls: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.thinking:
            d["reasoning_content"] = m.thinking  # the key chat templates that keep thinking read
        if m.tool_calls:
            calls: list[dict[str, Any]] = [
                {
                    "id": c.id or f"call_{i}_{j}",
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": dict(c.function.arguments)},
                }
                for j, c in enumerate(m.tool_calls)
            ]
            d["tool_calls"], open_calls = calls, list(calls)
        if m.role == "tool":
            if m.tool_name:
                d["name"] = m.tool_name
            answered = (
                next((c for c in open_calls if m.tool_call_id and c["id"] == m.tool_call_id), None)
                or next((c for c in open_calls if c["function"]["name"] == m.tool_name), None)
                or (open_calls[0] if open_calls else None)
            )
            if answered is not None:
                open_calls.remove(answered)
                d.setdefault("name", answered["function"]["name"])
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            elif answered is not None:
                d["tool_call_id"] = answered["id"]
        out.append(d)
    return out
