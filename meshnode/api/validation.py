"""Check OpenAI request bodies with pydantic models and turn them into a :class:`GenerationRequest`,
the wire-independent request every API surface hands to :mod:`meshnode.api.core`. Pure: no I/O,
no model. Every problem raises :class:`ApiError` (400, ``param`` naming the field, a code, and a
message that says what to fix; pydantic's errors are translated in :mod:`meshnode.api.schema`).

An unsupported field is an error by construction: the request models forbid every field they do
not declare (400, code ``unsupported_parameter``, ``param`` = the field), so no client is led to
believe that a parameter took effect. Every field real clients send is declared in one of three
lists, each field with the type the OpenAI API documents (a wrong type is a 400 naming the field):

* honoured: the fields of the models below (model, messages / prompt, max_tokens,
  max_completion_tokens, temperature, top_p, seed, stop, stream, stream_options.include_usage,
  n = 1). They shape the answer.
* ``HARMLESS``: accepted and ignored because ignoring them cannot change the answer: who is asking
  (user, safety_identifier, metadata), the provider's storage, caching and billing (store,
  prompt_cache_key, service_tier), tool-call plumbing that only matters once tools are honoured
  (parallel_tool_calls), and switches only at their "off" value (logprobs=false, echo=false,
  best_of=1, suffix=null, modalities=["text"]); any other value is refused.
* ``NOT_HONOURED_YET``: would change the answer and are not implemented yet, but chat clients send
  them with every request (Open WebUI: tools, tool_choice, top_k, min_p, repeat_penalty,
  frequency_penalty, presence_penalty; OpenCode and Codex: tools, tool_choice, reasoning_effort,
  response_format, logit_bias), so a 400 would make those clients unusable. They are accepted,
  type-checked and logged once per field per process at WARNING. Honouring one means moving it
  from that tuple into :class:`_Sampling` (or a request model) and into :class:`GenerationRequest`.

Messages keep their old handling: roles system, developer, user, assistant and tool; content a
string or a list of text parts (joined), null only for an assistant. Other keys of a message
(name, tool_calls, tool_call_id, reasoning_content...) are chat history that clients copy back
from earlier answers; they are ignored, not refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator
from pydantic_core import PydanticCustomError

from meshnode.api.schema import JsonObject, Number, Strict, one_of, optional, validate
from meshnode.errors import ApiError

__all__ = ["ApiError", "GenerationRequest", "HARMLESS", "Limits", "NOT_HONOURED_YET", "parse_request"]

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4


@dataclass(frozen=True)
class Limits:
    max_tokens_limit: int = 4096
    default_max_tokens: int = 512


@dataclass(frozen=True)
class GenerationRequest:
    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str | list[int] | None = None
    max_tokens: int | None = None  # None: the server picks (default, capped by context)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    # Sampling beyond temperature/top_p (mlx-lm's sampler and logits processors); None: off.
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: this many alternatives per token
    # Function tools in OpenAI's form ({"type": "function", "function": {name, description,
    # parameters}}), given to the model's chat template; tool_choice "auto", "none", "required"
    # or {"type": "function", "function": {"name": ...}}.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    think: bool | None = None  # reasoning models: think first (None: the model's default)


# (name, type) pairs; every field is optional (null = absent). The lists are explained above.
HARMLESS: tuple[tuple[str, Any], ...] = (
    ("user", str),
    ("safety_identifier", str),
    ("metadata", dict[str, str]),
    ("store", bool),
    ("service_tier", str),
    ("prompt_cache_key", str),
    ("prompt_cache_retention", str),
    ("parallel_tool_calls", bool),
    ("logprobs", Literal[False]),  # true asks for log-probabilities, which are not returned
    ("modalities", list[Literal["text"]]),
)
HARMLESS_COMPLETION: tuple[tuple[str, Any], ...] = (  # /v1/completions only
    ("echo", Literal[False]),  # true would repeat the prompt before the answer
    ("best_of", Literal[1]),  # more would sample several answers and return the best
    ("suffix", None),  # a suffix asks for an insertion, not a continuation
)
NOT_HONOURED_YET: tuple[tuple[str, Any], ...] = (
    ("tools", list[JsonObject]),
    ("tool_choice", Annotated[str | JsonObject, one_of("must be a string or an object")]),
    ("functions", list[JsonObject]),  # the older form of tools
    ("function_call", Annotated[str | JsonObject, one_of("must be a string or an object")]),
    ("response_format", JsonObject),
    ("reasoning_effort", str),
    ("verbosity", str),
    ("logit_bias", dict[str, Number]),
    ("frequency_penalty", Annotated[Number, Field(ge=-2, le=2)]),
    ("presence_penalty", Annotated[Number, Field(ge=-2, le=2)]),
    ("repeat_penalty", Annotated[Number, Field(gt=0)]),  # Ollama's and llama.cpp's name
    ("repetition_penalty", Annotated[Number, Field(gt=0)]),  # vLLM's and mlx-lm's name
    ("top_k", Annotated[int, Field(ge=0)]),
    ("min_p", Annotated[Number, Field(ge=0, le=1)]),
)
_warned: set[str] = set()


_Accepted = create_model("_Accepted", __base__=Strict, **optional(HARMLESS + NOT_HONOURED_YET))


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # harmless: there is no obfuscation padding to leave out


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

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, value: str | list[str] | None) -> list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise PydanticCustomError("invalid_value", "takes at most {most} strings", {"most": MAX_STOP})
        return [value] if isinstance(value, str) else value

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _within_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        limit = info.context["limits"].max_tokens_limit
        if value is not None and value > limit:
            raise PydanticCustomError("invalid_value", "must be at most {limit} on this server", {"limit": limit})
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)  # other keys (cache_control...) ignored
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)  # other keys ignored (see the module docstring)
    role: Literal[ROLES]
    content: Annotated[str | list[TextPart] | None, one_of("must be a string or a list of text parts "
                                                            "{'type': 'text', 'text': ...}")] \
        = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _null_for_assistant_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError("invalid_type", "must be a string or a list of text parts")
        return value

    def plain(self) -> dict[str, str]:
        """The message as the chat template takes it: role and content text."""
        if isinstance(self.content, list):
            return {"role": self.role, "content": "".join(part.text for part in self.content)}
        return {"role": self.role, "content": self.content or ""}


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)


_Completion = create_model("_Completion", __base__=_Sampling, **optional(HARMLESS_COMPLETION))
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Completion):
    prompt: Annotated[Annotated[str, Field(min_length=1)] | TokenIds,
                      one_of("must be a non-empty string or a list of token ids")]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) else value


def parse_request(body: Any, kind: str, limits: Limits) -> GenerationRequest:
    req = validate(ChatRequest if kind == "chat" else CompletionRequest, body, {"limits": limits})
    _warn_not_honoured(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    common = dict(
        model=req.model,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        seed=req.seed,
        stop=tuple(s for s in req.stop or () if s),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )
    if isinstance(req, ChatRequest):
        return GenerationRequest(kind="chat", messages=[m.plain() for m in req.messages], **common)
    return GenerationRequest(kind="completion", prompt=req.prompt, **common)


def _warn_not_honoured(req: BaseModel) -> None:
    for name, _ in NOT_HONOURED_YET:
        if name not in _warned and getattr(req, name) is not None:
            _warned.add(name)
            log.warning("request field '%s' is accepted but not honoured yet", name)
