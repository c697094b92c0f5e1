"""Tiny models that behave like agents, for end-to-end tests of tool calls and coding agents.

:func:`taught_agent`: a qwen3 with the "agent" chat template (tools, <tool_call> JSON, <think>)
taught two exchanges with plain MLX training on the CPU (harness/teach.py): asked about the weather
in Paris with the tool offered, it calls get_weather; given the result, it answers from it.

:func:`scripted_model`: a qwen3 whose every layer adds nothing to the residual stream (attention
and MLP outputs zeroed), so that its next token depends on the last token only, and whose output
head makes that next token the following one of a script: after the generation prompt's last
token (``<think>``) it says ``</think>``, the script's text, and ``<|end|>``, whatever came
before, however long (a coding agent's 20k-token prompt included). Random weights would never end
an answer; a coding agent treats an answer cut at max tokens as an error.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_lm import load

from harness.scripted import script_successors
from harness.teach import teach
from meshnode.model.build import build_model
from tests.once import made_once

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
RESULT = "sunny, 21 C"
FINAL = "It is sunny in Paris, 21 C."
SAID = "Hello from the mesh."  # what the scripted model of the Codex tests says


def history(call_id: str = "c1") -> list[dict]:
    """The conversation after the call, as the chat template takes it."""
    return ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": CALL["name"], "arguments": CALL["arguments"]}}
            ],
        },
        {"role": "tool", "content": RESULT, "tool_call_id": call_id},
    ]


def taught_agent(root: Path) -> Path:
    """The taught qwen3 (see the module docstring), built and taught under ``root``."""
    path = build_model(root / "qwen3-agent", "qwen3", num_layers=2, hidden_size=64, dtype="float32", chat="agent")
    _, tok = load(str(path))
    said = "</think><tool_call>" + json.dumps(CALL) + "</tool_call><|end|>"
    exchanges = [
        (
            tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True),
            tok.encode(said, add_special_tokens=False),
        ),
        (
            tok.apply_chat_template(history(), tools=TOOLS, add_generation_prompt=True),
            tok.encode("</think>" + FINAL + "<|end|>", add_special_tokens=False),
        ),
    ]
    assert teach(path, exchanges) < 0.01
    return path


def taught_agent_once(shared: Path) -> Path:
    """:func:`taught_agent` under ``shared``, taught by the first process of a run that asks (the
    others wait on a lock, then read it): teaching takes tens of seconds of CPU."""
    return made_once(shared / "taught", "qwen3-agent/config.json", taught_agent) / "qwen3-agent"


def scripted_model(root: Path, text: str, max_position_embeddings: int = 32768) -> Path:
    """The scripted qwen3 (see the module docstring) that answers ``text``, built under ``root``."""
    path = build_model(
        root / "qwen3-scripted",
        "qwen3",
        num_layers=2,
        hidden_size=64,
        dtype="float32",
        chat="agent",
        tie_word_embeddings=False,
        max_position_embeddings=max_position_embeddings,
    )
    _, tok = load(str(path))
    script = tok.encode("<think></think>" + text + "<|end|>", add_special_tokens=False)
    follows = dict(zip(script, script[1:]))
    assert all(follows[a] == b for a, b in zip(script, script[1:])), f"{text!r}: a token recurs with another successor"
    script_successors(path, follows)
    return path
