"""Anthropic Messages API bodies, checked and turned into a :class:`GenerationRequest`. Pure;
docs/api.md lists what is honoured. context_management is accepted but not honoured (logged once)
because Claude Code sends it with every request.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

from meshnode.api.schema import JsonObject, Number, Strict, validate
from meshnode.api.validation import GenerationRequest, Limits
from meshnode.errors import ApiError
from meshnode.logonce import Once

log = logging.getLogger(__name__)

MAX_STOP_SEQUENCES = 16
JOIN = "\n\n"  # between the text blocks of one message (and of the system prompt)
BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class _Block(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True)  # other keys (cache_control, citations) ignored


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: JsonObject


def _only(kinds: tuple[str, ...]) -> WrapValidator:
    """A block of another type (image, document, a server tool's result...) is refused by name."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(value, dict) and kind not in kinds:
            raise PydanticCustomError(
                "invalid_value",
                "is a block {kind}, which this server does not take (it serves a text model); it takes {kinds} blocks",
                {"kind": f"of type '{kind}'" if isinstance(kind, str) else "without a type", "kinds": ", ".join(kinds)},
            )
        return handler(value)

    return WrapValidator(check)


def _text_or(what: str) -> BeforeValidator:
    """A string is shorthand for one text block; anything else but a list is refused as a whole."""

    def check(value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        if not isinstance(value, list):
            raise PydanticCustomError("invalid_type", "must be a string or a list of {what}", {"what": what})
        return value

    return BeforeValidator(check)


TextBlocks = Annotated[list[Annotated[TextBlock, _only(("text",))]], _text_or("text blocks")]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: TextBlocks = Field(default_factory=list)
    is_error: bool | None = None

    def text(self) -> str:
        text = JOIN.join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Block):  # earlier thinking, copied back: history, left out of the prompt
    type: Literal["thinking"]


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
    _only(BLOCKS),
]


class Message(Strict):
    role: Literal["user", "assistant", "system"]  # system: Claude Code's turn of context, joins the system prompt
    content: Annotated[list[Block], _text_or("content blocks")]


class Tool(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: JsonObject
    type: Literal["custom"] | None = None
    cache_control: JsonObject | None = None  # harmless
    eager_input_streaming: bool | None = None  # harmless: how the input streams, not what it is
    strict: Literal[False] | None = None  # true asks for a guarantee this server does not give
    defer_loading: bool | None = None  # true: offered to the template like any other (no tool search here)


def _client_tool(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (None, "custom"):
        raise PydanticCustomError(
            "invalid_value",
            "is a server tool ('{kind}'); this server runs no tools, it "
            "takes client tools (name, description, input_schema)",
            {"kind": str(kind)},
        )
    return handler(value)


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # harmless, like OpenAI's parallel_tool_calls


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)  # accepted, not enforced
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: JsonObject = Field(alias="schema")


class OutputConfig(Strict):
    # the chat template's reasoning_effort (gpt-oss's low/medium/high; the two above it are "high")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None  # structured output: the answer is JSON valid under the schema


class Metadata(Strict):
    user_id: str | None = None


class CountRequest(Strict):
    """The fields of ``/v1/messages/count_tokens``: what makes the prompt."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: TextBlocks | None = None
    tools: list[Annotated[Tool, WrapValidator(_client_tool)]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: JsonObject | None = None  # harmless: there is no prompt cache to mark
    context_management: JsonObject | None = None  # not honoured (Claude Code sends it)
    output_config: OutputConfig | None = None
    speed: Literal["standard", "fast"] | None = None  # harmless: it changes no prompt


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    temperature: Number | None = Field(None, ge=0, le=1)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = None
    metadata: Metadata | None = None  # harmless
    service_tier: Literal["auto", "standard_only"] | None = None  # harmless
    inference_geo: str | None = None  # harmless


@dataclasses.dataclass(frozen=True)
class AnthropicRequest(GenerationRequest):
    hide_thinking: bool = False  # thinking.display "omitted": thinking blocks carry no text


_TAG = re.compile(r"(content\[\d+\])\.(?:" + "|".join(BLOCKS) + r")\b")
_warned = Once()  # request fields accepted but not honoured


def parse(body: Any, limits: Limits, count: bool = False) -> AnthropicRequest:
    """A /v1/messages body (``count``: a count_tokens body) as the request every surface hands on."""
    try:
        req = validate(CountRequest if count else MessagesRequest, body, {"limits": limits})
    except ApiError as err:  # a block's type is a step of pydantic's path: content[0].text.text
        err.param = _TAG.sub(r"\1", err.param) if err.param else None
        err.message = _TAG.sub(r"\1", err.message)
        err.args = (err.message,)
        raise
    out = req.output_config
    schema = out.format.schema_ if out is not None and out.format is not None else None
    effort = out.effort if out is not None else None
    for name, given in (("context_management", req.context_management),):
        if given is not None and _warned.first(name):
            log.warning("request field '%s' is accepted but not honoured", name)
    thinking = req.thinking
    if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens is None:
        raise ApiError(
            400,
            "'thinking.budget_tokens' is required when thinking is enabled",
            param="thinking.budget_tokens",
            code="missing_required_parameter",
        )
    tools = [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in req.tools or ()
    ]
    sampling: dict[str, Any] = {}
    if not count:
        sampling = dict(
            max_tokens=req.max_tokens,
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            top_k=req.top_k or None,  # 0: off
            stop=tuple(s for s in req.stop_sequences or () if s),
            stream=bool(req.stream),
        )
    return AnthropicRequest(
        kind="chat",
        model=req.model,
        messages=template_messages(req),
        tools=tools or None,
        tool_choice=_tool_choice(req.tool_choice, tools),
        think=None if thinking is None or thinking.type == "adaptive" else thinking.type == "enabled",
        hide_thinking=bool(thinking and thinking.display == "omitted"),
        json_schema=schema,
        template_kwargs={"reasoning_effort": min(effort, "high", key=EFFORTS.index)} if effort else {},
        **sampling,
    )


EFFORTS = ("low", "medium", "high", "xhigh", "max")


def _tool_choice(choice: ToolChoice | None, tools: list[dict[str, Any]]) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(
                400,
                "'tool_choice.name' is required when tool_choice.type is 'tool'",
                param="tool_choice.name",
                code="missing_required_parameter",
            )
        if choice.name not in {t["function"]["name"] for t in tools}:
            raise ApiError(
                400,
                f"'tool_choice.name' names '{choice.name}', which is not one of 'tools'",
                param="tool_choice.name",
                code="invalid_value",
            )
        return {"type": "function", "function": {"name": choice.name}}
    if choice.name is not None:
        raise ApiError(
            400,
            f"'tool_choice.name' is only taken with type 'tool', not '{choice.type}'",
            param="tool_choice.name",
            code="invalid_value",
        )
    if choice.type == "any" and not tools:
        raise ApiError(400, "tool_choice 'any' needs 'tools'", param="tool_choice", code="invalid_value")
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def template_messages(req: CountRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it; thinking blocks are history, left out. The
    text of system messages joins the system prompt, after ``system``, in their order: templates
    take one system message, first."""
    system = [JOIN.join(b.text for b in req.system or ())]
    turns = [(i, m) for i, m in enumerate(req.messages) if m.role != "system"]
    for i, message in enumerate(req.messages):
        if message.role == "system":
            system.append(JOIN.join(_system_text(i, j, block) for j, block in enumerate(message.content)))
    if not turns:
        raise ApiError(
            400, "'messages' holds only system messages; send a user message", param="messages", code="invalid_value"
        )
    last, final = turns[-1]
    if final.role == "assistant":
        raise ApiError(
            400,
            f"the last message (messages[{last}]) is an assistant's: this server does not "
            "continue a prefilled answer; end with a user message",
            param=f"messages[{last}]",
            code="invalid_value",
        )
    out: list[dict[str, Any]] = []
    if any(system):
        out.append({"role": "system", "content": JOIN.join(t for t in system if t)})
    for i, message in turns:
        texts, calls = [], []
        for j, block in enumerate(message.content):
            allowed = ("tool_result",) if message.role == "user" else ("tool_use", "thinking", "redacted_thinking")
            if block.type != "text" and block.type not in allowed:
                raise ApiError(
                    400,
                    f"'messages[{i}].content[{j}]' is a {block.type} block, which a {message.role} message cannot hold",
                    param=f"messages[{i}].content[{j}]",
                    code="invalid_value",
                )
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolResultBlock):
                out.append({"role": "tool", "content": block.text(), "tool_call_id": block.tool_use_id})
            elif isinstance(block, ToolUseBlock):
                calls.append(
                    {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
                )
        if texts or calls or not any(isinstance(b, ToolResultBlock) for b in message.content):
            turn: dict[str, Any] = {"role": message.role, "content": JOIN.join(texts)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def _system_text(i: int, j: int, block: Any) -> str:
    """A system message's block: text only."""
    if not isinstance(block, TextBlock):
        raise ApiError(
            400,
            f"'messages[{i}].content[{j}]' is a {block.type} block, which a system message cannot hold; it takes text",
            param=f"messages[{i}].content[{j}]",
            code="invalid_value",
        )
    return block.text
