"""Parse and check OpenAI-style request bodies. Pure: no I/O, no model.

Every problem raises :class:`ApiError` with the HTTP status, an OpenAI-style error type and
code, and a message that says what to fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from meshnode.errors import ApiError

__all__ = ["ApiError", "GenerationRequest", "Limits", "parse_request"]

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


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"'{name}' must be a number", name, "invalid_type")
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise _bad(f"'{name}' must be in {bound}, got {value}", name, "invalid_value")
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name, "invalid_type")
    if value < lo or value > hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {value}", name, "invalid_value")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(value) > MAX_STOP:
        raise _bad(f"'stop' takes at most {MAX_STOP} strings", "stop", "invalid_value")
    return tuple(s for s in value if s)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("'messages' must be a non-empty list", "messages", "invalid_value")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", where, "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role", "invalid_value")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _bad(
                        f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}",
                        f"{where}.content",
                        "invalid_value",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"{where}.content must be a string or a list of text parts", f"{where}.content", "invalid_type")
        out.append({"role": role, "content": content})
    return out


def parse_request(body: Any, kind: str, limits: Limits) -> GenerationRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model", "invalid_type")
    if body.get("n", 1) != 1:
        raise _bad("only n=1 is supported", "n", "invalid_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream", "invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
    max_tokens = _integer(body, "max_completion_tokens", 1, limits.max_tokens_limit)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, limits.max_tokens_limit)
    seed = _integer(body, "seed", -(2**63), 2**63 - 1)
    common = dict(
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=seed,
        stop=_stop(body),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )
    if kind == "chat":
        return GenerationRequest(kind="chat", messages=_messages(body.get("messages")), **common)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return GenerationRequest(kind="completion", prompt=list(prompt), **common)
    if not isinstance(prompt, str) or not prompt:
        raise _bad("'prompt' must be a non-empty string or a list of token ids", "prompt", "invalid_value")
    return GenerationRequest(kind="completion", prompt=prompt, **common)
