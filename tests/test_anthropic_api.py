"""The Anthropic Messages API of one real node, through the ``anthropic`` package: answers equal the
OpenAI route's for the same conversation (and mlx_lm.generate's), the stream's events come in
order, stop reasons and usage are Anthropic's, bad input gets Anthropic-shaped 4xx errors, and the
key is taken as x-api-key. Two families, weight formats and chat templates: llama 4-bit with the
plain template, and qwen3 bfloat16 with the "agent" template (tools, <think>: its answers are
thinking blocks). A first request as Claude Code sends it (a system turn in messages, a deferred
tool, adaptive thinking, context_management) is served. The framing of text, thinking and tool
calls together is tested on constructed deltas too, through the SDK's own stream accumulator.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from mlx_lm import generate as mlx_generate
from mlx_lm import load as mlx_load
from openai import OpenAI

from meshnode.api import anthropic as surface
from meshnode.api.anthropic_schema import parse
from meshnode.api.core import Answer, Generation
from meshnode.api.validation import Limits
from meshnode.errors import ApiError
from meshnode.model.build import build_model
from meshnode.serving.engine import Delta, ToolCall
from tests.helpers import running_node

KEY = "anthropic-test-key"
SYSTEM = "You are terse."
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
GREEDY = {"temperature": 0}  # the anthropic package has no sampling arguments; the API takes them
FORMATS = {"llama-4bit": ("llama", "4bit", "bfloat16", "plain"), "qwen3-bf16": ("qwen3", None, "bfloat16", "agent")}
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic")
    return {
        name: build_model(
            root / name,
            family,
            num_layers=2,
            hidden_size=64,
            intermediate_size=128,
            dtype=dtype,
            quantize=quantize,
            chat=chat,
        )
        for name, (family, quantize, dtype, chat) in FORMATS.items()
    }


@pytest.fixture(scope="module")
def nodes(models, tmp_path_factory):
    from contextlib import ExitStack

    with ExitStack() as stack:
        out = {
            name: stack.enter_context(running_node(path, tmp_path_factory.mktemp(name), max_context=512, api_key=KEY))
            for name, path in models.items()
        }
        # Claude Code's tools need a longer context; its max_tokens (32000) is capped at a few tokens
        out["claude-code"] = stack.enter_context(
            running_node(
                models["qwen3-bf16"], tmp_path_factory.mktemp("cc"), max_context=4096, max_tokens_limit=4, api_key=KEY
            )
        )
        yield out


@pytest.fixture(params=list(FORMATS))
def node(request, nodes):
    return nodes[request.param]


@pytest.fixture(params=list(FORMATS))
def node_and_model(request, nodes, models):
    return nodes[request.param], models[request.param]


@pytest.fixture
def llama(nodes):
    return nodes["llama-4bit"]


@pytest.fixture
def agent(nodes):
    return nodes["qwen3-bf16"]


def parts(msg) -> tuple[str, str]:
    """A message's text and thinking."""
    return (
        "".join(b.text for b in msg.content if b.type == "text"),
        "".join(b.thinking for b in msg.content if b.type == "thinking"),
    )


def claude(base, key=KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=60)


def chat(base, model, messages=MESSAGES, system=SYSTEM, **kw):
    """The same conversation through /v1/chat/completions."""
    c = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
    return c.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system}] + messages, temperature=0, **kw
    )


def create(base, model, **kw):
    args = dict(model=model, system=SYSTEM, messages=MESSAGES, max_tokens=20, extra_body=GREEDY) | kw
    return claude(base).messages.create(**args)


def post(url, body, headers=None):
    """(status, body) of a raw POST, for what the client hides."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


# --------------------------------------------------------------------------- through a real node


def test_greedy_answer_equals_the_openai_route(node):
    n, base = node
    msg = create(base, n.model_id)
    ref = chat(base, n.model_id, max_tokens=20)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == n.model_id
    said = ref.choices[0].message
    thought = (said.model_extra or {}).get("reasoning_content") or ""
    assert [b.type for b in msg.content] == (["thinking"] if thought else []) + ["text"]
    assert parts(msg) == (said.content, thought)
    assert msg.usage.input_tokens == ref.usage.prompt_tokens
    assert msg.usage.output_tokens == ref.usage.completion_tokens
    assert (msg.usage.cache_creation_input_tokens, msg.usage.cache_read_input_tokens) == (0, 0)
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.choices[0].finish_reason]
    assert msg.stop_sequence is None


def test_greedy_answer_matches_mlx_lm(llama, models):
    n, base = llama
    model, tokenizer = mlx_load(str(models["llama-4bit"]))
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}] + MESSAGES, add_generation_prompt=True
    )
    assert create(base, n.model_id).content[0].text == mlx_generate(model, tokenizer, prompt=prompt, max_tokens=20)


def test_stream_equals_the_whole_answer(node):
    n, base = node
    whole = create(base, n.model_id)
    with claude(base).messages.stream(
        model=n.model_id, system=SYSTEM, messages=MESSAGES, max_tokens=20, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == parts(whole)[0]
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


def test_stream_events_come_in_order(llama):
    n, base = llama
    events = list(
        claude(base).messages.create(
            model=n.model_id, system=SYSTEM, messages=MESSAGES, max_tokens=8, extra_body=GREEDY, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.content == [] and events[0].message.usage.input_tokens > 0
    assert events[1].index == 0 and events[1].content_block.type == "text"
    assert all(e.delta.type == "text_delta" for e in events[2:-3])
    assert events[-2].usage.output_tokens == 8 and events[-2].delta.stop_reason == "max_tokens"
    for counted in (events[0].message.usage, events[-2].usage):  # integers, as Anthropic sends them
        assert (counted.cache_creation_input_tokens, counted.cache_read_input_tokens) == (0, 0)
    # on the wire: a ping after message_start, and each event named as its data's type
    status, raw = post(
        f"{base}/v1/messages",
        {"model": n.model_id, "messages": MESSAGES, "max_tokens": 4, "stream": True},
        {"x-api-key": KEY},
    )
    assert status == 200
    frames = [f.split("\n") for f in raw.strip().split("\n\n")]
    names = [f[0].removeprefix("event: ") for f in frames]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert all(json.loads(f[1].removeprefix("data: "))["type"] == name for f, name in zip(frames, names))


def test_stop_sequences(node):
    n, base = node
    full = create(base, n.model_id, max_tokens=30, thinking=NO_THINKING).content[0].text
    cut = next((full[i : i + 2] for i in range(len(full) // 2, len(full) - 1) if full[i : i + 2].isalpha()), None)
    if cut is None or full.index(cut) == 0:
        pytest.skip("no usable stop string in this output")
    msg = create(base, n.model_id, max_tokens=30, thinking=NO_THINKING, stop_sequences=["never in it", cut])
    assert msg.content[0].text == full[: full.index(cut)]
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == cut
    with claude(base).messages.stream(
        model=n.model_id,
        system=SYSTEM,
        messages=MESSAGES,
        max_tokens=30,
        extra_body=GREEDY,
        stop_sequences=[cut],
        thinking=NO_THINKING,
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", cut)
    assert final.content[0].text == msg.content[0].text


def test_max_tokens(llama):
    n, base = llama
    msg = create(base, n.model_id, max_tokens=3)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_count_tokens_is_the_prompt_of_create(node):
    n, base = node
    c = claude(base)
    counted = c.messages.count_tokens(model=n.model_id, system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == create(base, n.model_id, max_tokens=1).usage.input_tokens


def test_history_blocks_become_the_chat_templates_messages(node_and_model):
    """Tool use, tool results and thinking in the history: the prompt is the chat template applied
    to their template form (tool messages, an assistant's tool_calls, thinking left out)."""
    (n, base), path = node_and_model
    history = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather in Paris?", "cache_control": {"type": "ephemeral"}}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny, 21 C"}]},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    expected = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    _, tokenizer = mlx_load(str(path))
    counted = claude(base).messages.count_tokens(model=n.model_id, system=SYSTEM, messages=history)
    assert counted.input_tokens == len(tokenizer.apply_chat_template(expected, add_generation_prompt=True))
    msg = create(base, n.model_id, messages=history, max_tokens=5)
    assert msg.usage.input_tokens == counted.input_tokens and msg.content[-1].type == "text"


def test_tools_and_thinking_are_served(agent):
    n, base = agent
    c = claude(base)
    for choice in ({"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "none"}):
        msg = create(
            base,
            n.model_id,
            max_tokens=12,
            tools=TOOLS,
            tool_choice=choice,
            thinking=NO_THINKING,
            metadata={"user_id": "u-1"},
        )
        counted = c.messages.count_tokens(
            model=n.model_id, system=SYSTEM, messages=MESSAGES, tools=TOOLS, tool_choice=choice, thinking=NO_THINKING
        )
        assert msg.usage.input_tokens == counted.input_tokens
        assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use") and msg.content
        assert "thinking" not in [b.type for b in msg.content]
        assert all(isinstance(b.input, dict) for b in msg.content if b.type == "tool_use")
        assert (msg.stop_reason == "tool_use") == any(b.type == "tool_use" for b in msg.content)
    plain = dict(model=n.model_id, system=SYSTEM, messages=MESSAGES, thinking=NO_THINKING)
    assert counted.input_tokens == c.messages.count_tokens(**plain).input_tokens  # "none" leaves the tools out
    assert c.messages.count_tokens(**plain, tools=TOOLS).input_tokens > counted.input_tokens
    thought = create(base, n.model_id, max_tokens=12, thinking={"type": "enabled", "budget_tokens": 1024})
    assert thought.content[0].type == "thinking" and thought.content[0].thinking and thought.content[0].signature == ""
    hidden = create(base, n.model_id, max_tokens=12, thinking={"type": "adaptive", "display": "omitted"})
    assert hidden.content[0].type == "thinking" and hidden.content[0].thinking == ""
    assert hidden.usage == thought.usage


def test_output_config_format_constrains_the_answer(node):
    n, base = node
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    for _ in range(2):  # sampled: whatever the model draws, the answer is valid
        msg = create(
            base,
            n.model_id,
            max_tokens=60,
            extra_body={"temperature": 1.0, "output_config": {"format": {"type": "json_schema", "schema": schema}}},
        )
        answer = json.loads(parts(msg)[0])
        assert set(answer) == {"ok", "n"} and answer["n"] in (1, 2, 3) and msg.stop_reason == "end_turn"


def test_tools_for_a_model_that_cannot_call_them(llama):
    """Tools are always accepted; a model whose template has no place for them answers without them,
    and a tool_choice that promises a call (any, tool) is refused."""
    n, base = llama
    with_tools = create(base, n.model_id, tools=TOOLS)
    without = create(base, n.model_id)
    assert with_tools.content == without.content and with_tools.usage == without.usage
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        with pytest.raises(anthropic.BadRequestError) as refused:
            create(base, n.model_id, tools=TOOLS, tool_choice=choice)
        assert refused.value.body["error"]["type"] == "invalid_request_error"
        assert "no tool-call format" in refused.value.body["error"]["message"]


def test_errors_have_anthropics_shape(llama):
    n, base = llama
    c = claude(base)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(
            model=n.model_id,
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}],
        )
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[1]" in bad.value.body["error"]["message"] and "image" in bad.value.message
    with pytest.raises(anthropic.BadRequestError, match="top_logprobs"):
        c.messages.create(model=n.model_id, max_tokens=5, messages=MESSAGES, extra_body={"top_logprobs": 2})
    # Claude Code asks for 32000: more than the room left is capped there (stop_reason max_tokens), not refused.
    capped = c.messages.create(
        model=n.model_id, messages=MESSAGES, max_tokens=10**6, extra_body={"temperature": 0, "top_k": 1}
    )
    assert capped.stop_reason in ("max_tokens", "end_turn")
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="no-such-model", max_tokens=5, messages=MESSAGES)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        c.messages.count_tokens(model="no-such-model", messages=MESSAGES)
    status, body = post(f"{base}/v1/messages", {"model": n.model_id, "messages": MESSAGES}, {"x-api-key": KEY})
    assert status == 400 and json.loads(body)["error"]["message"] == "'max_tokens' is required"


def test_the_key_is_taken_as_x_api_key(llama):
    n, base = llama
    with pytest.raises(anthropic.AuthenticationError) as denied:
        claude(base, key="wrong").messages.create(model=n.model_id, max_tokens=5, messages=MESSAGES)
    assert denied.value.body["error"]["type"] == "authentication_error"
    assert post(f"{base}/v1/messages", {"model": n.model_id, "messages": MESSAGES, "max_tokens": 2})[0] == 401
    # both headers on every route; the OpenAI routes keep their OpenAI-shaped errors
    body = {"model": n.model_id, "messages": MESSAGES, "max_tokens": 2}
    assert post(f"{base}/v1/chat/completions", body, {"x-api-key": KEY})[0] == 200
    assert post(f"{base}/v1/messages", body, {"Authorization": f"Bearer {KEY}"})[0] == 200
    status, text = post(f"{base}/v1/chat/completions", body, {"x-api-key": "wrong"})
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"


def _cc_tool(name: str, properties: dict, **extra) -> dict:
    return {"name": name, "description": name, "input_schema": {"type": "object", "properties": properties}, **extra}


TEXT = {"type": "string"}
BASH_SCHEMA = {
    "type": "object",
    "properties": {"command": TEXT},
    "required": ["command"],
    "additionalProperties": False,
    "$schema": "http://json-schema.org/draft-07/schema#",
}
# Claude Code's tools, in short: the last is an MCP tool it defers (for its tool search tool)
CC_TOOLS = (
    [{"name": "Bash", "description": "Runs a command.", "input_schema": BASH_SCHEMA}]
    + [_cc_tool(name, {"path": TEXT}) for name in ("Glob", "Grep", "Read", "Edit", "Write", "NotebookEdit")]
    + [_cc_tool(name, {"q": TEXT}) for name in ("Task", "WebFetch", "TodoWrite", "WebSearch")]
    + [_cc_tool("mcp__ide__getDiagnostics", {"uri": TEXT}, defer_loading=True, cache_control={"type": "ephemeral"})]
)
ENVIRONMENT = "# Environment\n - Primary working directory: /home/user/project\n - Platform: linux"


def claude_code_body(model: str, environment: str = ENVIRONMENT) -> dict:
    """A first request as Claude Code sends it: a system turn inside messages besides the system
    prompt, a deferred tool, adaptive thinking, output_config, context_management, metadata."""
    return {
        "model": model,
        "max_tokens": 32000,
        "stream": True,
        "temperature": 1,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"}]},
            {"role": "system", "content": environment},
            {"role": "user", "content": [{"type": "text", "text": "Say hi.", "cache_control": {"type": "ephemeral"}}]},
        ],
        "tools": CC_TOOLS,
        "metadata": {"user_id": "user_0a1b_account__session_2c3d"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }


def claude_code_prompt(tokenizer, environment: str = ENVIRONMENT) -> list[int]:
    """The prompt that body makes: the system turn's text joins the system prompt, every tool goes to
    the template, the effort is its reasoning_effort."""
    messages = [
        {"role": "system", "content": "You are Claude Code.\n\n" + environment},
        {"role": "user", "content": "<system-reminder>Be brief.</system-reminder>"},
        {"role": "user", "content": "Say hi."},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in CC_TOOLS
    ]
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, reasoning_effort="medium")


def test_what_claude_code_sends_is_served(nodes, models):
    n, base = nodes["claude-code"]
    _, tokenizer = mlx_load(str(models["qwen3-bf16"]))
    status, raw = post(f"{base}/v1/messages?beta=true", claude_code_body(n.model_id), {"x-api-key": KEY})
    assert status == 200, raw
    frames = [f.split("\n") for f in raw.strip().split("\n\n")]
    names = [f[0].removeprefix("event: ") for f in frames]
    events = [json.loads(f[1].removeprefix("data: ")) for f in frames]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in names and names[-3] == "content_block_stop"
    assert events[0]["message"]["usage"]["input_tokens"] == len(claude_code_prompt(tokenizer))
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 4
    assert not [e for e in events if e.get("delta", {}).get("type") == "thinking_delta"]  # display: omitted
    # Claude Code's own system turn is some 9 kB ("# Environment", git status, recent commits)
    environment = ENVIRONMENT + "".join(f"\n M src/module_{i:03d}/handler.py" for i in range(300))
    counting = {
        k: v
        for k, v in claude_code_body(n.model_id, environment).items()
        if k not in ("max_tokens", "stream", "temperature", "metadata")
    }
    status, counted = post(f"{base}/v1/messages/count_tokens?beta=true", counting, {"x-api-key": KEY})
    assert status == 200, counted
    assert json.loads(counted)["input_tokens"] == len(claude_code_prompt(tokenizer, environment))


def test_count_tokens_takes_what_the_sdk_sends_it():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "speed": "standard"}
    req = parse(body, Limits(), count=True)
    assert req.messages == [{"role": "user", "content": "hi"}]


def test_system_messages_join_the_system_prompt_in_order():
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": "First.",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Second."}, {"type": "text", "text": "Third."}]},
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Fourth."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    }
    assert parse(body, Limits()).messages == [
        {"role": "system", "content": "First.\n\nSecond.\n\nThird.\n\nFourth."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    without = dict(body, system=None, messages=[{"role": "system", "content": "Rules."}, *body["messages"][1:2]])
    assert parse(without, Limits()).messages[0] == {"role": "system", "content": "Rules."}
    result = {"type": "tool_result", "tool_use_id": "t", "content": "x"}
    for messages, param in (
        ([{"role": "system", "content": [result]}, {"role": "user", "content": "Hi"}], "messages[0].content[0]"),
        ([{"role": "system", "content": "Rules."}], "messages"),
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}, body["messages"][2]],
            "messages[1]",
        ),
    ):
        with pytest.raises(ApiError) as refused:
            parse(dict(body, messages=messages), Limits())
        assert refused.value.status == 400 and refused.value.param == param, refused.value.message


# --------------------------------------------------------------------------- framing, on constructed deltas


def _gen() -> Generation:
    async def none():
        yield Delta("", 0)

    return Generation("msg_test", "tiny", 7, none())


CALLS = (ToolCall("toolu_a", "get_weather", '{"city": "Paris"}'), ToolCall("toolu_b", "get_time", "{}"))


def _events(deltas, hide=False) -> list[dict]:
    fmt = surface.Events(_gen(), hide)
    raw = b"".join(fmt.opening() + [f for d in deltas for f in fmt.delta(d)] + fmt.closing(deltas[-1]))
    out = []
    for frame in raw.decode().strip().split("\n\n"):
        name, data = frame.split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {out[-1]['type']}"
    return out


def _accumulated(events):
    snapshot = None
    for event in events:
        if event["type"] != "ping":
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs={})
    return snapshot


def test_thinking_text_and_tool_calls_stream_as_blocks_in_order():
    deltas = [
        Delta("", 2, reasoning="Let me "),
        Delta("", 3, reasoning="think."),
        Delta("Calling.", 4),
        Delta("", 9, "tool_calls", tool_calls=CALLS),
    ]
    events = _events(deltas)
    starts = [(e["index"], e["content_block"]["type"]) for e in events if e["type"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    final = _accumulated(events)  # what the anthropic SDK makes of the stream
    answer = Answer("Calling.", "Let me think.", list(CALLS), [], deltas[-1])
    whole = surface.message(_gen(), answer)
    assert final.to_dict(exclude_none=True) == {k: v for k, v in whole.items() if v is not None}
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole["content"][2]["input"] == {"city": "Paris"} and whole["stop_reason"] == "tool_use"


def test_hidden_thinking_and_only_tool_calls():
    deltas = [Delta("", 1, reasoning="secret"), Delta("", 5, "tool_calls", tool_calls=CALLS[:1])]
    events = _events(deltas, hide=True)
    assert not [e for e in events if e.get("delta", {}).get("type") == "thinking_delta"]
    blocks = _accumulated(events).to_dict()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"] and blocks[0]["thinking"] == ""
    answer = Answer("", "secret", list(CALLS[:1]), [], deltas[-1])
    assert [b["type"] for b in surface.message(_gen(), answer, True)["content"]] == ["thinking", "tool_use"]


def test_stop_reasons_and_an_empty_answer():
    assert surface.stop_reason(Delta("", 3, "length"), False) == ("max_tokens", None)
    assert surface.stop_reason(Delta("", 3, "stop"), False) == ("end_turn", None)
    assert surface.stop_reason(Delta("", 3, "stop", stop_sequence="\n\n"), False) == ("stop_sequence", "\n\n")
    assert surface.stop_reason(Delta("", 3, "tool_calls"), True) == ("tool_use", None)
    assert surface.stop_reason(Delta("", 3, "tool_calls"), False) == ("end_turn", None)  # its call was dropped
    assert surface.stop_reason(Delta("", 3, "length"), True) == ("max_tokens", None)
    events = _events([Delta("", 0, "stop")])  # nothing said: still one (empty) text block, as create gives
    assert [b["type"] for b in _accumulated(events).to_dict()["content"]] == ["text"]
    assert surface.message(_gen(), Answer("", "", [], [], Delta("", 0, "stop")))["content"] == [
        {"type": "text", "text": ""}
    ]


def test_error_types_and_the_mid_stream_error_event():
    types = {s: surface.error_body(ApiError(s, "x"))["error"]["type"] for s in (400, 401, 404, 413, 429, 500, 503)}
    assert types == {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        503: "overloaded_error",
    }
    frame = surface.Events(_gen()).failure(ApiError(503, "the mesh is re-planning"))[0].decode()
    assert frame.startswith("event: error\ndata: ") and json.loads(frame.split("data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the mesh is re-planning"},
    }
