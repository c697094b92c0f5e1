"""Splits a chat answer's text into what the client sees apart: the content, the model's
reasoning (between its think markers) and its tool calls (between its tool-call markers, parsed
by the tool parser mlx-lm picked for the model's chat template).

mlx-lm's :class:`~mlx_lm.generate.TextStateMachine` matches the markers on decoded text, holding
back text that may start one; its states are "normal", "reasoning" and "tool".
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlx_lm.generate import TextStateMachine

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made (its tool-call markup parsed by mlx-lm's tool parser)."""

    id: str
    name: str
    arguments: str  # the arguments as JSON text, as OpenAI sends them


@dataclass
class Pieces:
    """What one step of the answer adds, by kind."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class AnswerShape:
    """How a chat answer is read: whether it starts inside the model's reasoning (the template
    opened it), and the tools it may call (None: its tool-call markup is plain content)."""

    reasoning: bool = False
    tools: list[dict[str, Any]] | None = None
    forced_tool: bool = False  # the prompt ends with the tool-call start marker (tool_choice required)


def initial_state(tokenizer: TokenizerWrapper, prompt: Sequence[int], forced_tool: bool = False) -> str:
    """Where the answer starts: "tool" after a forced tool-call marker, "reasoning" where the
    prompt opened a think block it did not close (as mlx_lm.server decides), else "normal"."""
    if forced_tool:
        return "tool"
    if getattr(tokenizer, "has_thinking", False) and tokenizer.rfind_think_start(
        list(prompt)
    ) > tokenizer.rfind_think_end(list(prompt)):
        return "reasoning"
    return getattr(tokenizer, "response_initial_state", None) or "normal"


class AnswerSplitter:
    """Feed it the answer's decoded text piece by piece; it returns each piece split by kind."""

    def __init__(self, tokenizer: TokenizerWrapper, shape: AnswerShape, start: str = "normal"):
        self._tokenizer, self._tools = tokenizer, shape.tools
        transitions: dict[str, list[tuple[str, str]]] = {"normal": [], "reasoning": [], "tool": []}
        if getattr(tokenizer, "has_thinking", False):
            transitions["normal"].append((tokenizer.think_start, "reasoning"))
            transitions["reasoning"].append((tokenizer.think_end, "normal"))
        calls = shape.tools is not None and getattr(tokenizer, "has_tool_calling", False)
        if calls:
            transitions["normal"].append((tokenizer.tool_call_start, "tool"))
            if getattr(tokenizer, "has_thinking", False):
                transitions["reasoning"].append((tokenizer.tool_call_start, "tool"))
            if tokenizer.tool_call_end:
                transitions["tool"].append((tokenizer.tool_call_end, "normal"))
        self._machine = TextStateMachine({k: v for k, v in transitions.items() if v} or None)
        self._state = self._machine.make_state(initial=start)
        self._tool_text = ""
        self.made_calls = False

    def feed(self, text: str) -> Pieces:
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._sort(segments, final=False)

    def finish(self) -> Pieces:
        """The rest held back, and a tool call the answer left open (no end marker, or cut short)."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        return self._sort([(state, rest)], final=True)

    def _sort(self, segments: list[tuple[str | None, str]], final: bool) -> Pieces:
        out = Pieces()
        for i, (state, text) in enumerate(segments):
            last = i == len(segments) - 1
            if state == "tool":
                self._tool_text += text
                if not last or final:  # left the tool state: the call is complete
                    out.tool_calls.extend(self._parse())
            elif state == "reasoning":
                out.reasoning += text
            elif state is not None:
                out.content += text
        return out

    def _parse(self) -> list[ToolCall]:
        text, self._tool_text = self._tool_text, ""
        if not text.strip():
            return []
        try:
            parsed = self._tokenizer.tool_parser(text, self._tools)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # json errors are ValueErrors
            log.warning(
                "a tool call the model wrote could not be parsed (%s: %s); %d characters dropped",
                type(exc).__name__,
                exc,
                len(text),
            )
            return []
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                log.warning("a tool call the model wrote has no function name; dropped")
                continue
            args = call.get("arguments", {})
            calls.append(
                ToolCall(
                    id=call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                    name=call["name"],
                    arguments=args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                )
            )
        self.made_calls = self.made_calls or bool(calls)
        return calls
