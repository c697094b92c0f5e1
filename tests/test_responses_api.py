"""The OpenAI Responses API (``/v1/responses``) of one real node, through the ``openai`` package:
greedy answers equal /v1/chat/completions' for the same conversation, instructions are the system
message, max_output_tokens makes a response incomplete, usage counts, the stream's typed events
come in order and end in the same Response, previous_response_id continues a stored conversation
(an unknown one is refused). Two families, weight formats and chat templates: llama 4-bit with the
plain template, qwen3 bfloat16 with the "agent" template (tools, <think>: reasoning items).

A function call end to end on the taught qwen3 of tests/agent_model.py: the call comes back as a
function_call item, its output goes back as a function_call_output item (with the whole history,
or with previous_response_id) and the answer is the taught one. The framing of reasoning, text,
namespaced and custom tool calls is tested on constructed deltas too, through the SDK's own
stream accumulator. Last, Codex CLI itself (npm @openai/codex, marked slow) runs ``codex exec``
against a node and exits 0 with the answer.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from contextlib import ExitStack

import openai
import pytest
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseIncompleteEvent, ResponseStreamEvent

from meshnode.api.core import Generation
from meshnode.api.responses import Output, ResponseStore, parse
from meshnode.api.validation import Limits
from meshnode.errors import ApiError
from meshnode.model.build import build_model
from meshnode.serving.engine import Delta, ToolCall
from tests.agent_model import ASK, FINAL, RESULT, SAID, TOOLS, scripted_model
from tests.helpers import codex_cli, codex_setup, run_group, running_node

KEY = "responses-test-key"
SYSTEM = "You are terse."
SEA = "Tell me about the sea."
FORMATS = {"llama-4bit": ("llama", "4bit", "bfloat16", "plain"), "qwen3-bf16": ("qwen3", None, "bfloat16", "agent")}
FUNCTION = {"type": "function", **TOOLS[0]["function"]}  # get_weather as a Responses function tool


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
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
    with ExitStack() as stack:
        yield {
            name: stack.enter_context(running_node(path, tmp_path_factory.mktemp(name), max_context=512, api_key=KEY))
            for name, path in models.items()
        }


@pytest.fixture(params=list(FORMATS))
def node(request, nodes):
    return nodes[request.param]


@pytest.fixture
def llama(nodes):
    return nodes["llama-4bit"]


@pytest.fixture
def qwen(nodes):
    return nodes["qwen3-bf16"]


@pytest.fixture(scope="module")
def agent(taught, tmp_path_factory):
    with running_node(taught, tmp_path_factory.mktemp("agent-node"), max_context=1024) as (n, base):
        yield n, base


def client(base: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def create(base: str, model: str, **kw):
    return client(base).responses.create(
        **{"model": model, "instructions": SYSTEM, "input": SEA, "max_output_tokens": 20, "temperature": 0, **kw}
    )


def chat(base: str, model: str, messages: list[dict], **kw):
    return client(base).chat.completions.create(model=model, messages=messages, temperature=0, **kw)


def reasoning(response) -> str:
    return "".join(c.text for item in response.output if item.type == "reasoning" for c in item.content or ())


def comparable(response) -> dict:
    """A Response (the SDK's) without what differs between two answers alike: ids and times."""
    return _same(response.model_dump())


def post(url: str, body: dict, key: str = KEY) -> tuple[int, str]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


# --------------------------------------------------------------------------- through a real node


@pytest.mark.slow
def test_greedy_answer_equals_chat_completions(node):
    n, base = node
    r = create(base, n.model_id)
    ref = chat(
        base, n.model_id, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": SEA}], max_tokens=20
    )
    said = ref.choices[0].message
    thought = (said.model_extra or {}).get("reasoning_content") or ""
    assert r.id.startswith("resp_") and r.object == "response" and r.model == n.model_id
    assert (r.output_text, reasoning(r)) == (said.content or "", thought)
    assert [i.type for i in r.output] == (["reasoning"] if thought else []) + (["message"] if said.content else [])
    assert r.usage.input_tokens == ref.usage.prompt_tokens and r.usage.output_tokens == ref.usage.completion_tokens
    assert r.usage.total_tokens == ref.usage.total_tokens and r.usage.input_tokens_details.cached_tokens == 0
    assert (r.usage.output_tokens_details.reasoning_tokens > 0) == bool(thought)
    assert ref.choices[0].finish_reason == "length" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.output[-1].status == "incomplete"
    assert (r.instructions, r.temperature, r.max_output_tokens, r.tool_choice, r.tools) == (SYSTEM, 0, 20, "auto", [])


@pytest.mark.slow
def test_instructions_are_the_system_message(node):
    n, base = node
    given = create(base, n.model_id, max_output_tokens=8)
    for system in ("system", "developer"):  # developer is system for the chat template
        items = [
            {"role": system, "content": SYSTEM},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": SEA}]},
        ]
        same = create(base, n.model_id, instructions=None, input=items, max_output_tokens=8)
        assert (same.output_text, reasoning(same), same.usage) == (given.output_text, reasoning(given), given.usage)
    without = create(base, n.model_id, instructions=None, max_output_tokens=8)
    assert without.usage.input_tokens < given.usage.input_tokens


@pytest.mark.slow
def test_max_output_tokens_and_logprobs(llama):
    n, base = llama
    r = create(base, n.model_id, max_output_tokens=5, include=["message.output_text.logprobs"], top_logprobs=2)
    assert r.status == "incomplete" and r.usage.output_tokens == 5
    ref = chat(
        base,
        n.model_id,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": SEA}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
    )
    got = r.output[0].content[0].logprobs
    want = ref.choices[0].logprobs.content
    assert [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in got] == [
        (lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in want
    ]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        create(base, n.model_id, top_logprobs=2)


def test_stream_events_come_in_order_and_end_in_the_same_response(node):
    n, base = node
    whole = create(base, n.model_id)
    events = list(create(base, n.model_id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete" and comparable(events[-1].response) == comparable(whole)
    kinds = [e.type for e in events]
    expected = ["response.created", "response.in_progress"]
    for item in whole.output:
        text = "reasoning_text" if item.type == "reasoning" else "output_text"
        expected += [
            "response.output_item.added",
            "response.content_part.added",
            f"response.{text}.delta",
            f"response.{text}.done",
            "response.content_part.done",
            "response.output_item.done",
        ]
    expected.append("response.incomplete")
    assert [k for i, k in enumerate(kinds) if k != kinds[i - 1] or not k.endswith(".delta")] == expected
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[0].response.id == events[-1].response.id
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    # on the wire: each event named as its data's type
    status, raw = post(
        f"{base}/v1/responses", {"model": n.model_id, "input": SEA, "max_output_tokens": 3, "stream": True}
    )
    assert status == 200
    frames = [f.split("\n") for f in raw.strip().split("\n\n") if not f.startswith(":")]  # keep-alives
    assert all(json.loads(f[1].removeprefix("data: "))["type"] == f[0].removeprefix("event: ") for f in frames)


def test_previous_response_id_continues_the_conversation(node):
    n, base = node
    c = client(base)
    first = create(base, n.model_id, max_output_tokens=6)
    follow = c.responses.create(
        model=n.model_id, previous_response_id=first.id, input="And the hills?", max_output_tokens=6, temperature=0
    )
    # the instructions are not carried over (as OpenAI documents); the earlier reasoning is left out
    ref = chat(
        base,
        n.model_id,
        [
            {"role": "user", "content": SEA},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And the hills?"},
        ],
        max_tokens=6,
    )
    assert follow.output_text == (ref.choices[0].message.content or "")
    assert follow.usage.input_tokens == ref.usage.prompt_tokens and follow.previous_response_id == first.id
    assert comparable(c.responses.retrieve(first.id)) == comparable(first)
    unstored = create(base, n.model_id, max_output_tokens=2, store=False)
    for gone in ("resp_nope", unstored.id):
        with pytest.raises(openai.BadRequestError) as refused:
            c.responses.create(model=n.model_id, previous_response_id=gone, input="And?")
        assert refused.value.code == "previous_response_not_found" and refused.value.param == "previous_response_id"
        assert gone in refused.value.message
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_usage_as_the_sdk_requires_and_a_deleted_response(llama):
    """The SDK's strict validation of the Response and of the stream's last event (every usage field
    its types require); DELETE forgets a stored response, as OpenAI answers it."""
    n, base = llama
    strict = openai.OpenAI(
        base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60, _strict_response_validation=True
    )
    r = strict.responses.create(model=n.model_id, input=SEA, max_output_tokens=3, temperature=0)
    assert r.usage.input_tokens_details.model_dump() == {
        "cached_tokens": 0,
        "cache_write_tokens": 0,
        "cache_write_tokens_details": None,
    }
    body = {"model": n.model_id, "input": SEA, "max_output_tokens": 3, "temperature": 0, "stream": True}
    status, raw = post(f"{base}/v1/responses", body)
    last = json.loads(raw.strip().split("\n\n")[-1].split("\n")[1].removeprefix("data: "))
    assert status == 200 and ResponseIncompleteEvent.model_validate(last).response.usage == r.usage
    req = urllib.request.Request(f"{base}/v1/responses/{r.id}", headers={"Authorization": f"Bearer {KEY}"})
    req.method = "DELETE"
    with urllib.request.urlopen(req, timeout=60) as deleted:
        assert json.loads(deleted.read()) == {"id": r.id, "object": "response", "deleted": True}
    for gone in (strict.responses.retrieve, strict.responses.delete):
        with pytest.raises(openai.NotFoundError):
            gone(r.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_not_found|not found"):
        strict.responses.create(model=n.model_id, input="And?", previous_response_id=r.id)


def test_structured_output(node):
    n, base = node
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    r = create(
        base,
        n.model_id,
        max_output_tokens=60,
        temperature=1.0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )
    answer = json.loads(r.output_text)
    assert set(answer) == {"ok", "n"} and r.status == "completed" and r.text.format.type == "json_schema"


def test_hosted_tools_are_left_out_and_the_rest_refused(llama):
    n, base = llama
    c = client(base)
    plain = create(base, n.model_id, max_output_tokens=6)
    searching = create(
        base,
        n.model_id,
        max_output_tokens=6,
        tools=[{"type": "web_search"}],
        store=False,
        parallel_tool_calls=True,
        reasoning={"summary": "auto"},
        prompt_cache_key="k",
        include=["reasoning.encrypted_content"],
        extra_body={"client_metadata": {"a": "b"}},
    )
    assert searching.output_text == plain.output_text and searching.usage == plain.usage
    cases = [
        (dict(extra_body={"bogus": 1}), "bogus", "unsupported_parameter"),
        (dict(tools=[{"type": "local_shell"}]), "tools[0]", "invalid_value"),
        (
            dict(
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is this?"},
                            {"type": "input_image", "image_url": "data:,"},
                        ],
                    }
                ]
            ),
            "input[0].content[1]",
            "invalid_value",
        ),
        (
            dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}]),
            "input[0].arguments",
            "invalid_value",
        ),
        (dict(tool_choice={"type": "function", "name": "nope"}), "tool_choice", "invalid_value"),
        (dict(truncation="auto"), "truncation", "invalid_value"),
    ]
    for kw, param, code in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            create(base, n.model_id, **kw)
        assert (bad.value.param, bad.value.code) == (param, code), bad.value.message
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="no-such-model", input=SEA)
    with pytest.raises(openai.AuthenticationError):
        client(base, "wrong").responses.create(model=n.model_id, input=SEA)


def test_a_required_call_from_a_model_that_cannot_make_one_is_a_400(llama):
    """llama's plain template has no tool-call format: a tool_choice that promises a call is
    refused; "auto" answers without the tools."""
    n, base = llama
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        with pytest.raises(openai.BadRequestError) as refused:
            create(base, n.model_id, tools=[FUNCTION], tool_choice=choice, max_output_tokens=2)
        assert (refused.value.param, refused.value.code) == ("tool_choice", "unsupported_value")
        assert "no tool-call format" in refused.value.message
    auto = create(base, n.model_id, tools=[FUNCTION], tool_choice="auto", max_output_tokens=2)
    assert [i.type for i in auto.output] == ["message"]


def test_what_codex_sends_is_served(qwen):
    """A body shaped as Codex CLI 0.169 sends it, history included (items with ids and statuses,
    a namespaced call, reasoning with encrypted_content, developer messages)."""
    n, base = qwen
    body = {
        "model": n.model_id,
        "stream": True,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0a1b",
        "client_metadata": {"session_id": "0a1b", "turn_id": "t"},
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "description": "Runs a command.",
                "strict": False,
                "parameters": {
                    "type": "object",
                    "properties": {"cmd": {"type": "string"}},
                    "required": ["cmd"],
                    "additionalProperties": False,
                },
            },
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "Sub-agents.",
                "tools": [
                    {
                        "type": "function",
                        "name": "wait_agent",
                        "strict": False,
                        "description": "Wait.",
                        "parameters": {"type": "object", "properties": {}},
                    }
                ],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "input": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "developer",
                "content": [{"type": "input_text", "text": "You are Codex."}],
            },
            {"type": "message", "id": "msg_2", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Hm."}],
                "encrypted_content": None,
            },
            {
                "type": "function_call",
                "status": "completed",
                "id": "fc_1",
                "name": "wait_agent",
                "namespace": "multi_agent_v1",
                "arguments": "{}",
                "call_id": "call_a",
            },
            {"type": "function_call_output", "id": "fco_1", "call_id": "call_a", "output": "no agents"},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_3",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Done.", "annotations": []}],
            },
            {"type": "message", "id": "msg_4", "role": "user", "content": [{"type": "input_text", "text": "Bye"}]},
        ],
    }
    status, raw = post(f"{base}/v1/responses", {**body, "max_output_tokens": 4})
    assert status == 200, raw
    last = json.loads(raw.strip().split("\n\n")[-1].split("\n")[1].removeprefix("data: "))
    assert last["type"] in ("response.completed", "response.incomplete")
    assert 0 < last["response"]["usage"]["output_tokens"] <= 4 and last["response"]["store"] is False


@pytest.mark.slow
def test_a_function_call_and_its_output(agent):
    n, base = agent
    c = client(base)
    r = c.responses.create(model=n.model_id, input=ASK[0]["content"], tools=[FUNCTION], temperature=0)
    assert r.status == "completed" and [i.type for i in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    # The whole history, as an agent that keeps it sends it back...
    whole = c.responses.create(
        model=n.model_id,
        tools=[FUNCTION],
        temperature=0,
        input=[{"role": "user", "content": ASK[0]["content"]}, call.model_dump(exclude_none=True), output],
    )
    assert whole.output_text == FINAL and whole.status == "completed"
    # ...or only the output, continuing the stored response.
    follow = c.responses.create(
        model=n.model_id, tools=[FUNCTION], temperature=0, previous_response_id=r.id, input=[output]
    )
    assert follow.output_text == FINAL and follow.usage.input_tokens == whole.usage.input_tokens
    # Streamed: the call's arguments as a delta and a done, and the SDK's final response equals r.
    with c.responses.stream(model=n.model_id, input=ASK[0]["content"], tools=[FUNCTION], temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds[-1] == "response.completed" and comparable(final) == comparable(r)
    forced = c.responses.create(
        model=n.model_id,
        input=ASK[0]["content"],
        tools=[FUNCTION],
        temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert forced.output[-1].type == "function_call" and forced.output[-1].name == "get_weather"


# --------------------------------------------------------------------------- framing, on constructed deltas


def _gen() -> Generation:
    async def none():
        yield Delta("", 0)

    return Generation("resp_test", "tiny", 7, none())


def _without_none(value):
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return [_without_none(v) for v in value] if isinstance(value, list) else value


def _same(response: dict) -> dict:
    """A Response as a dict without what differs between two answers alike: ids and times (and what
    the SDK's stream adds: parsed_arguments)."""
    out = {k: v for k, v in response.items() if k not in ("id", "created_at", "completed_at")}
    return out | {
        "output": [
            {k: v for k, v in item.items() if k not in ("id", "call_id", "parsed_arguments")} for item in out["output"]
        ]
    }


def _request(tools: list[dict]):
    return parse({"model": "tiny", "input": "hi", "tools": tools}, Limits())


NAMESPACED = [
    {"type": "namespace", "name": "weather", "description": "Weather tools.", "tools": [FUNCTION]},
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "Patch files.",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
    },
]


def test_reasoning_text_and_calls_stream_as_items_in_order():
    req = _request(NAMESPACED)
    assert [t["function"]["name"] for t in req.tools] == ["weather__get_weather", "apply_patch"]
    assert req.tools[0]["function"]["description"] == "Weather tools.: Weather"
    assert req.tools[1]["function"]["parameters"]["required"] == ["input"]
    calls = (
        ToolCall("call_a", "weather__get_weather", '{"city": "Paris"}'),
        ToolCall("call_b", "apply_patch", '{"input": "*** Begin Patch"}'),
    )
    deltas = [
        Delta("", 2, reasoning="Let me "),
        Delta("", 3, reasoning="think."),
        Delta("Calling.", 4),
        Delta("", 9, "tool_calls", tool_calls=calls),
    ]
    whole = Output(_gen(), req, None, streaming=False)
    for d in deltas:
        whole.delta(d)
    whole.closing(deltas[-1])
    streamed = Output(_gen(), req, None, streaming=True)
    raw = b"".join(streamed.opening() + [f for d in deltas for f in streamed.delta(d)] + streamed.closing(deltas[-1]))
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)  # what the SDK makes of the stream
    for frame in raw.decode().strip().split("\n\n"):
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    final = state._completed_response.model_dump(exclude_none=True)
    assert _same(final) == _same(_without_none(whole.final))
    out = whole.final["output"]
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call", "custom_tool_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}] and out[0]["summary"] == []
    assert out[2]["namespace"] == "weather" and out[2]["name"] == "get_weather" and out[2]["call_id"] == "call_a"
    assert out[3] == {
        "id": out[3]["id"],
        "type": "custom_tool_call",
        "call_id": "call_b",
        "name": "apply_patch",
        "input": "*** Begin Patch",
    }
    assert [i["type"] for i in final["output"]] == [i["type"] for i in out]
    assert whole.final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    assert whole.final["status"] == "completed"


def test_history_items_become_the_chat_templates_messages():
    req = parse(
        {
            "model": "tiny",
            "instructions": "Be brief.",
            "tools": NAMESPACED,
            "input": [
                {"role": "developer", "content": "Project rules."},
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Weather?"}, {"type": "input_text", "text": "Now."}],
                },
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "namespace": "weather",
                    "arguments": '{"city": "Paris"}',
                },
                {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "patch"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]},
            ],
        },
        Limits(),
    )
    assert req.messages == [
        {"role": "system", "content": "Be brief.\n\nProject rules."},
        {"role": "user", "content": "Weather?\n\nNow."},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather__get_weather", "arguments": {"city": "Paris"}},
                },
                {"id": "c2", "type": "function", "function": {"name": "apply_patch", "arguments": {"input": "patch"}}},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "weather__get_weather"},
        {"role": "tool", "content": "ok", "tool_call_id": "c2", "name": "apply_patch"},
    ]
    # what a follow-up continues: the instructions left out, the developer message kept as it came
    assert req.history == ({"role": "system", "content": "Project rules."},) + tuple(req.messages[1:])


def test_the_store_keeps_the_last_responses_for_a_while():
    now = [0.0]
    store = ResponseStore(size=2, seconds=10, clock=lambda: now[0])
    for i in range(3):
        store.put({"id": f"r{i}"}, ({"role": "user", "content": str(i)},))
    assert store.history("r0") is None and store.history("r2") == ({"role": "user", "content": "2"},)
    now[0] = 10.0
    assert store.response("r1") is None and store.response("r2") is None


@pytest.mark.slow
def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    out = Output(_gen(), _request([]), None, streaming=True)
    out.opening()
    frames = [f.decode() for f in out.failure(ApiError(503, "the mesh is re-planning"))]
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    assert [e["type"] for e in events] == ["error", "response.failed"]
    assert events[0]["message"] == "the mesh is re-planning" and events[0]["sequence_number"] == 2
    assert events[1]["response"]["status"] == "failed" and events[1]["response"]["error"]["code"] == "server_error"


# --------------------------------------------------------------------------- Codex CLI itself


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_codex_cli_exec_against_a_node(tmp_path):
    """``codex exec`` with a custom model provider (wire_api "responses") answers from the node
    and exits 0. Codex sends its defaults: its tools (functions, a namespace, web_search),
    developer messages, reasoning.summary, store false, include, client_metadata, stream. The model
    is the scripted one of tests/agent_model.py (it ends its answer, which Codex requires); only
    Codex's long base instructions are swapped for a line (model_instructions_file) so that the
    CPU prefill stays short."""
    codex = codex_cli()
    model = scripted_model(tmp_path, SAID)
    with running_node(model, tmp_path / "node", max_context=32768) as (n, base):
        work, env = codex_setup(tmp_path, n.model_id, f"{base}/v1")
        status, out, err = run_group(
            [str(codex), "exec", "--skip-git-repo-check", "Say hello."], timeout=420, cwd=work, env=env
        )
    assert status == 0, (out[-2000:], err[-3000:])
    assert out.strip() == SAID, (out[-2000:], err[-3000:])
