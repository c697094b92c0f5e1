"""An agent's whole loop through a real node (issues 12 and 12b): tool definitions in, a tool call
out, the tool's result sent back, a final answer, through the ``openai`` (chat completions,
streamed and not), ``anthropic`` and ``ollama`` packages.

Random weights never call a tool, so the fixture teaches a tiny qwen3 (the "agent" chat template:
tools, <tool_call> JSON, <think>) two exchanges with plain MLX training on the CPU
(tests/agent_model.py, harness/teach.py): asked about the weather in Paris with the tool offered,
it calls get_weather; given the result, it answers from it. Everything after that is the product:
the template rendering the tools and the history, mlx-lm's tool parser, each surface's shape.
"""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pytest

from tests.agent_model import ASK, FINAL, RESULT, TOOLS
from tests.helpers import running_node

pytestmark = pytest.mark.slow  # every test asks a model taught when the module starts


@pytest.fixture(scope="module")
def agent(taught):
    return taught


@pytest.fixture(scope="module")
def node(agent, tmp_path_factory):
    with running_node(agent, tmp_path_factory.mktemp("agent-node"), max_context=1024) as (n, base):
        yield n, base


def test_chat_completions_call_the_tool_and_answer_from_its_result(node):
    n, base = node
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.chat.completions.create(model=n.model_id, messages=ASK, tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id
    # The agent runs the tool and sends the call and its result back, as the SDK hands them over.
    messages = ASK + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    final = c.chat.completions.create(model=n.model_id, messages=messages, tools=TOOLS, temperature=0)
    assert final.choices[0].message.content == FINAL and final.choices[0].finish_reason == "stop"
    # Streamed: the call arrives as one tool_calls delta with an index, then finish_reason tool_calls.
    chunks = list(c.chat.completions.create(model=n.model_id, messages=ASK, tools=TOOLS, temperature=0, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # A named tool_choice forces the call (the prompt ends with the call marker).
    forced = c.chat.completions.create(
        model=n.model_id,
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_anthropic_tool_use_and_tool_result(node):
    n, base = node
    c = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60)
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    msg = c.messages.create(model=n.model_id, max_tokens=100, messages=ASK, tools=tools, extra_body={"temperature": 0})
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    final = c.messages.create(
        model=n.model_id,
        max_tokens=100,
        tools=tools,
        extra_body={"temperature": 0},
        messages=[
            *ASK,
            {"role": "assistant", "content": msg.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]},
        ],
    )
    assert [b.text for b in final.content if b.type == "text"] == [FINAL] and final.stop_reason == "end_turn"
    with c.messages.stream(
        model=n.model_id, max_tokens=100, messages=ASK, tools=tools, extra_body={"temperature": 0}
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [("get_weather", {"city": "Paris"})]


def test_ollama_tool_calls_and_tool_message(node):
    n, base = node
    c = ollama.Client(host=base)
    r = c.chat(model=n.model_id, messages=ASK, tools=TOOLS, options={"temperature": 0})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == {"city": "Paris"}
    final = c.chat(
        model=n.model_id,
        tools=TOOLS,
        options={"temperature": 0},
        messages=[*ASK, r.message, {"role": "tool", "content": RESULT, "tool_name": "get_weather"}],
    )
    assert final.message.content == FINAL
