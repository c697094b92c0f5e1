"""The OpenAI Responses API's request bodies as pydantic models, in the chat template's form. Pure.
Hosted tools are left out rather than refused: Codex sends web_search with every request."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

from meshnode.api.schema import JsonObject, Number, Strict, one_of
from meshnode.errors import ApiError
from meshnode.logonce import Once

log = logging.getLogger(__name__)

JOIN = "\n\n"
SEP = "__"  # between a namespace and the name of one of its tools, as the model sees it
Hosted = Literal[
    "web_search",
    "web_search_preview",
    "web_search_2025_08_26",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "image_generation",
    "mcp",
    "tool_search",
]
HOSTED: tuple[str, ...] = get_args(Hosted)
CLIENT_BUILTINS = ("local_shell", "shell", "apply_patch", "computer", "computer_use_preview")
Includable = Literal[
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]
LOGPROBS = "message.output_text.logprobs"
PARTS = ("input_text", "output_text", "refusal")
ITEMS = ("message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output", "reasoning")


def _only(kinds: tuple[str, ...], what: str, why: dict[str, str] | None = None) -> WrapValidator:
    """An object of another type is refused by name, with the reason if there is a known one."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(value, dict) and kind not in kinds:
            reason = (why or {}).get(kind, "") if isinstance(kind, str) else ""
            raise PydanticCustomError(
                "invalid_value",
                "is {a} {what} {kind}, which this server does not take{reason}; it takes {kinds}",
                {
                    "a": "an" if what[0] in "aeiou" else "a",
                    "what": what,
                    "reason": reason,
                    "kinds": ", ".join(kinds),
                    "kind": f"of type '{kind}'" if isinstance(kind, str) else "without a type",
                },
            )
        return handler(value)

    return WrapValidator(check)


def _listed(one: Callable[[str], dict[str, Any]], what: str) -> BeforeValidator:
    """A string is shorthand for a list of one; anything else but a list is refused as a whole."""

    def check(value: Any) -> Any:
        if isinstance(value, str):
            return [one(value)]
        if not isinstance(value, list):
            raise PydanticCustomError("invalid_type", "must be a string or a list of {what}", {"what": what})
        return value

    return BeforeValidator(check)


class _Loose(BaseModel):
    """History clients copy back: unused keys are ignored, not refused."""

    model_config = ConfigDict(strict=True, frozen=True)


class TextPart(_Loose):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Loose):
    type: Literal["refusal"]
    refusal: str


_NOT_TEXT = {k: " (it serves a text model)" for k in ("input_image", "input_file", "input_audio")}
Part = Annotated[TextPart | RefusalPart, Field(discriminator="type"), _only(PARTS, "content part", _NOT_TEXT)]
Content = Annotated[list[Part], _listed(lambda text: {"type": "input_text", "text": text}, "content parts")]


def _text(parts: list[Part]) -> str:
    return JOIN.join(p.text if isinstance(p, TextPart) else p.refusal for p in parts)


class MessageItem(_Loose):
    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(_Loose):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    namespace: str | None = None


class CustomCallItem(_Loose):
    type: Literal["custom_tool_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: str
    namespace: str | None = None


class OutputItem(_Loose):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str = Field(min_length=1)
    output: Content


class ReasoningItem(_Loose):  # earlier reasoning, copied back: history, left out of the prompt
    type: Literal["reasoning"]


def _message_by_default(value: Any) -> Any:
    """An item without a type that has a role is a message (the "easy input message")."""
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return {**value, "type": "message"}
    return value


_REFERENCE = {"item_reference": " (send the item itself, or previous_response_id)"}
Item = Annotated[
    MessageItem | FunctionCallItem | CustomCallItem | OutputItem | ReasoningItem,
    Field(discriminator="type"),
    _only(ITEMS, "input item", _REFERENCE),
    BeforeValidator(_message_by_default),
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None  # accepted: arguments are the model's, as with chat completions
    output_schema: JsonObject | None = None  # harmless: what the client's tool returns
    defer_loading: Literal[False] | None = None  # true needs the tool search tool


class CustomFormat(Strict):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomTool(Strict):
    type: Literal["custom"]
    name: str = Field(min_length=1)
    description: str | None = None
    format: CustomFormat | None = None
    defer_loading: Literal[False] | None = None


class HostedTool(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")
    type: Hosted


_BUILTIN = {k: " (a model here cannot make its call items; send it as a function tool)" for k in CLIENT_BUILTINS}
Inner = Annotated[
    FunctionTool | CustomTool, Field(discriminator="type"), _only(("function", "custom"), "tool", _BUILTIN)
]


class NamespaceTool(Strict):
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[Inner]


Tool = Annotated[
    FunctionTool | CustomTool | NamespaceTool | HostedTool,
    Field(discriminator="type"),
    _only(("function", "custom", "namespace") + HOSTED, "tool", _BUILTIN),
]


class NamedChoice(Strict):
    type: Literal["function", "custom"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default; no open model takes a length hint


Summary = Literal["auto", "concise", "detailed"]


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Summary | None = None  # harmless: the raw reasoning is returned, no summary is made
    generate_summary: Summary | None = None  # the older name of summary


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # harmless: there is no obfuscation padding


class ResponsesBody(Strict):
    model: str = Field(min_length=1)
    input: Annotated[
        list[Item], _listed(lambda text: {"type": "message", "role": "user", "content": text}, "input items")
    ]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    store: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[Includable] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: (
        Annotated[
            Literal["none", "auto", "required"] | NamedChoice,
            one_of('must be "none", "auto", "required" or {"type": "function", "name": ...}'),
        ]
        | None
    ) = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop input items to fit
    background: Literal[False] | None = None
    metadata: dict[str, str] | None = None
    client_metadata: JsonObject | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None


_warned = Once()  # hosted tool types left out of a request


def template_tools(given: list[Tool]) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str | None, str]]]:
    """The tools as the chat template takes them, and what each name the model sees stands for."""
    tools: list[dict[str, Any]] = []
    names: dict[str, tuple[str, str | None, str]] = {}

    def add(tool: FunctionTool | CustomTool, namespace: str | None, context: str | None) -> None:
        seen = f"{namespace}{SEP}{tool.name}" if namespace else tool.name
        description = ": ".join(d for d in (context, tool.description) if d)
        if isinstance(tool, FunctionTool):
            parameters = tool.parameters or {"type": "object", "properties": {}}
        else:
            fmt = tool.format
            note = "The input is free text"
            if fmt is not None and fmt.type == "grammar" and fmt.definition:
                note += f" following this {fmt.syntax or 'lark'} grammar:\n{fmt.definition}"
            parameters = {
                "type": "object",
                "properties": {"input": {"type": "string", "description": note}},
                "required": ["input"],
            }
        names[seen] = (tool.type, namespace, tool.name)
        tools.append(
            {"type": "function", "function": {"name": seen, "description": description, "parameters": parameters}}
        )

    for tool in given:
        if isinstance(tool, NamespaceTool):
            for inner in tool.tools:
                add(inner, tool.name, tool.description)
        elif isinstance(tool, HostedTool):
            if _warned.first(tool.type):
                log.warning("the request's '%s' tool is left out: this server runs no hosted tools", tool.type)
        else:
            add(tool, None, None)
    return tools, names


def tool_choice(
    choice: Literal["none", "auto", "required"] | NamedChoice | None, names: dict[str, tuple[str, str | None, str]]
) -> str | dict[str, Any] | None:
    if isinstance(choice, NamedChoice):
        seen = next(
            (s for s, (kind, _ns, name) in names.items() if choice.name in (s, name) and kind == choice.type), None
        )
        if seen is None:
            raise ApiError(
                400,
                f"tool_choice names '{choice.name}', which is not one of the request's {choice.type} tools",
                param="tool_choice",
                code="invalid_value",
            )
        return {"type": "function", "function": {"name": seen}}
    if choice == "required" and not names:
        raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice", code="invalid_value")
    return choice


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        raise ApiError(
            400, f"'{where}.arguments' is not valid JSON", param=f"{where}.arguments", code="invalid_value"
        ) from None
    return value if isinstance(value, dict) else {"value": value}


def template_messages(items: list[Item], before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as the chat template's messages: developer is system, function calls join
    the assistant turn before them. ``before``: the conversation they continue."""
    out: list[dict[str, Any]] = []
    called = {c["id"]: c["function"]["name"] for m in before for c in m.get("tool_calls", ())}  # call_id -> name
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, (FunctionCallItem, CustomCallItem)):
            name = f"{item.namespace}{SEP}{item.name}" if item.namespace else item.name
            arguments = (
                _arguments(item.arguments, f"input[{i}]")
                if isinstance(item, FunctionCallItem)
                else {"input": item.input}
            )
            called[item.call_id] = name
            call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, OutputItem):
            message = {"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id}
            if item.call_id in called:
                message["name"] = called[item.call_id]
            out.append(message)
    return out


def leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system messages before the first other one, joined into one."""
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    joined = [{"role": "system", "content": JOIN.join(m["content"] for m in messages[:lead])}]
    return messages if lead < 2 else joined + messages[lead:]


def json_schema(fmt: TextFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.schema_ is None:
        raise ApiError(
            400,
            "'text.format.schema' is required for type json_schema",
            param="text.format.schema",
            code="missing_required_parameter",
        )
    return fmt.schema_
