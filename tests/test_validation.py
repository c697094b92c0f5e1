"""Request parsing (pure) and the engine's stop-string handling."""

import asyncio

import pytest

from meshnode.api import validation
from meshnode.api.validation import HARMLESS, ApiError, Limits, parse_request
from meshnode.serving.answer import AnswerShape
from meshnode.serving.engine import Engine
from meshnode.serving.generation import SamplingParams

L = Limits(max_tokens_limit=100, default_max_tokens=10)
MSG = [{"role": "user", "content": "hi"}]


def test_chat_defaults_follow_openai():
    r = parse_request({"model": "m", "messages": MSG}, "chat", L)
    assert (r.temperature, r.top_p, r.max_tokens, r.stream, r.stop) == (1.0, 1.0, None, False, ())


def test_a_developer_message_is_a_system_message_to_the_template():
    r = parse_request({"model": "m", "messages": [{"role": "developer", "content": "Be brief."}, *MSG]}, "chat", L)
    assert r.messages[0] == {"role": "system", "content": "Be brief."}


def test_content_parts_are_joined():
    r = parse_request(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        },
        "chat",
        L,
    )
    assert r.messages[0]["content"] == "ab"


def test_completion_prompt_forms():
    assert parse_request({"model": "m", "prompt": ["x"]}, "completion", L).prompt == "x"
    assert parse_request({"model": "m", "prompt": [1, 2]}, "completion", L).prompt == [1, 2]


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"model": "m", "messages": MSG, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"model": "m", "messages": MSG, "max_tokens": True}, "max_tokens", "invalid_type"),
        ({"model": "m", "messages": MSG, "max_completion_tokens": 2.0}, "max_completion_tokens", "invalid_type"),
        ({"model": "m", "messages": MSG, "temperature": float("nan")}, "temperature", "invalid_value"),
        ({"model": "m", "messages": MSG, "temperature": 10**400}, "temperature", "invalid_type"),
        ({"model": "m", "messages": MSG, "top_p": 1.5}, "top_p", "invalid_value"),
        ({"model": "m", "messages": MSG, "top_p": 0}, "top_p", "invalid_value"),
        ({"model": "m", "messages": MSG, "seed": "x"}, "seed", "invalid_type"),
        ({"model": "m", "messages": MSG, "seed": 2**64}, "seed", "invalid_value"),
        ({"model": "m", "messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"model": "m", "messages": MSG, "stop": [1]}, "stop", "invalid_type"),
        ({"model": "m", "messages": MSG, "stream": "yes"}, "stream", "invalid_type"),
        ({"model": "m", "messages": MSG, "stream_options": 3}, "stream_options", "invalid_type"),
        ({"model": "m", "messages": MSG, "n": 3}, "n", "invalid_value"),
        ({"model": 3, "messages": MSG}, "model", "invalid_type"),
        ({"messages": MSG}, "model", "missing_required_parameter"),
        ({"model": "m", "messages": []}, "messages", "invalid_value"),
        ({"model": "m", "messages": [MSG[0], {"role": "wizard", "content": "x"}]}, "messages[1].role", "invalid_value"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "invalid_type"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            "invalid_type",
        ),
        ({"model": "m", "messages": MSG, "top_logprobs": 21, "logprobs": True}, "top_logprobs", "invalid_value"),
        ({"model": "m", "messages": MSG, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"model": "m", "messages": MSG, "logit_bias": {"x": 1}}, "logit_bias", "invalid_value"),
        ({"model": "m", "messages": MSG, "logit_bias": {"5": 101}}, "logit_bias.5", "invalid_value"),
        ({"model": "m", "messages": MSG, "presence_penalty": 3}, "presence_penalty", "invalid_value"),
        ({"model": "m", "messages": MSG, "response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
        (
            {"model": "m", "messages": MSG, "response_format": {"type": "json_schema"}},
            "response_format.json_schema.schema",
            "missing_required_parameter",
        ),
        (
            {"model": "m", "messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "missing_required_parameter",
        ),
        ({"model": "m", "messages": MSG, "tool_choice": "required"}, "tool_choice", "invalid_value"),
        (
            {"model": "m", "messages": MSG, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "invalid_value",
        ),
        ({"model": "m", "messages": MSG, "verbosity": "low"}, "verbosity", "invalid_value"),
    ],
)
def test_rejected(body, param, code):
    with pytest.raises(ApiError) as e:
        parse_request(body, "chat", L)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code)
    assert e.value.message and param.split("[")[0] in e.value.message


def test_an_unknown_field_is_refused_by_name():
    with pytest.raises(ApiError) as e:
        parse_request({"model": "m", "messages": MSG, "frobnicate": 1}, "chat", L)
    assert (e.value.status, e.value.param, e.value.code) == (400, "frobnicate", "unsupported_parameter")
    assert "'frobnicate'" in e.value.message
    with pytest.raises(ApiError) as e:  # a completions-only field on the chat endpoint
        parse_request({"model": "m", "messages": MSG, "echo": False}, "chat", L)
    assert e.value.param == "echo"
    with pytest.raises(ApiError) as e:  # inside an object the request declares
        parse_request({"model": "m", "messages": MSG, "stream_options": {"include_usage": True, "x": 1}}, "chat", L)
    assert e.value.param == "stream_options.x"


def test_a_logit_bias_key_that_is_no_token_id_is_quoted_in_the_message():
    with pytest.raises(ApiError) as e:
        parse_request({"model": "m", "messages": MSG, "logit_bias": {"foo": 0}}, "chat", L)
    assert e.value.message == "'logit_bias' takes token ids as keys, got \"foo\""


def test_a_wrong_type_names_the_field():
    for body, param in (
        ({"temperature": "hot"}, "temperature"),
        ({"tools": "all"}, "tools"),
        ({"tool_choice": 5}, "tool_choice"),
        ({"top_k": 1.5}, "top_k"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ):
        with pytest.raises(ApiError) as e:
            parse_request({"model": "m", "messages": MSG, **body}, "chat", L)
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_type")
        assert f"'{param}'" in e.value.message


def _open_webui_request():
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "a tool",
                "parameters": {"type": "object", "properties": {}},
            },
        }
        for i in range(36)
    ]
    return {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, *MSG],
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": tools,
        "tool_choice": "auto",
        "top_k": 40,
        "min_p": 0.05,
        "repeat_penalty": 1.1,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "seed": 42,
        "stop": ["<|im_end|>"],
        "temperature": 0.8,
        "top_p": 0.9,
        "max_tokens": 50,
    }


def test_open_webui_request_is_honoured_field_by_field():
    r = parse_request(_open_webui_request(), "chat", L)
    assert (r.stream, r.include_usage, r.seed, r.stop, r.max_tokens, r.temperature, r.top_p) == (
        True,
        True,
        42,
        ("<|im_end|>",),
        50,
        0.8,
        0.9,
    )
    assert (r.top_k, r.min_p, r.repetition_penalty, r.frequency_penalty, r.presence_penalty) == (40, 0.05, 1.1, 0, 0)
    assert [m["role"] for m in r.messages] == ["system", "user"]
    assert len(r.tools) == 36 and r.tools[0]["function"]["name"] == "tool_0" and r.tool_choice == "auto"


def test_coding_agent_fields_reach_the_request():
    history = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 2}'}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "1", "reasoning_content": "x"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {
        "model": "m",
        "messages": history,
        "reasoning_effort": "low",
        "response_format": {"type": "text"},
        "logit_bias": {"50": -100},
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": True,
        "logprobs": True,
        "top_logprobs": 3,
        "max_completion_tokens": 7,
        "n": 1,
    }
    r = parse_request(body, "chat", L)
    assert r.max_tokens == 7 and r.logit_bias == {50: -100.0} and (r.logprobs, r.top_logprobs) == (True, 3)
    assert r.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 2}}}],
    }
    assert r.messages[2] == {"role": "tool", "content": "42", "tool_call_id": "1"}
    assert r.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert r.template_kwargs == {"reasoning_effort": "low"} and r.think is True
    old = parse_request(
        {"model": "m", "messages": MSG, "functions": [{"name": "g"}], "function_call": {"name": "g"}}, "chat", L
    )
    assert old.tools == [{"type": "function", "function": {"name": "g"}}]
    assert old.tool_choice == {"type": "function", "function": {"name": "g"}}
    r = parse_request(
        {"model": "m", "prompt": "x", "echo": False, "suffix": None, "best_of": 1, "logprobs": 2}, "completion", L
    )
    assert r.prompt == "x" and (r.logprobs, r.top_logprobs) == (True, 2)
    for field, value in (("echo", True), ("suffix", "tail"), ("best_of", 2)):
        with pytest.raises(ApiError) as e:
            parse_request({"model": "m", "prompt": "x", field: value}, "completion", L)
        assert e.value.param == field


def test_the_honoured_fields_and_the_harmless_ones_do_not_overlap():
    harmless = {n for n, _ in HARMLESS}
    assert not harmless & {"model", "messages", "tools", "logprobs", "top_k", "logit_bias"}
    assert harmless <= set(validation.ChatRequest.model_fields)


class _Detok:
    """Trims the first text's leading space, as mlx-lm's streaming detokenizers do."""

    def __init__(self, table):
        self.table, self.last_segment, self.tokens = table, "", []

    def add_token(self, t):
        self.last_segment = self.table[t]
        if not self.tokens:
            self.last_segment = self.last_segment.removeprefix(" ")
        self.tokens.append(t)

    def finalize(self):
        self.last_segment = ""


class _Tok:
    eos_token_ids = {0}

    def __init__(self, table):
        self.table = table

    @property
    def detokenizer(self):
        return _Detok(self.table)

    def decode(self, ids):
        return "".join(self.table.get(t, "") for t in ids)


class _Source:
    def __init__(self, tokens):
        self._tokens = tokens

    async def tokens(self, prompt, params):
        for t in self._tokens:
            yield t


def run(tokens, table, stop=(), max_tokens=50, shape=None):
    engine = Engine("m", _Tok(table), _Source(tokens), max_context=100, vocab_size=10)

    async def go():
        return [d async for d in engine.stream([1], SamplingParams(max_tokens=max_tokens), stop, shape)]

    return asyncio.run(go())


TABLE = {1: "Hel", 2: "lo ", 3: "wor", 4: "ld", 5: "!"}


def test_eos_and_length():
    out = run([1, 2, 0, 3], TABLE)
    assert "".join(d.text for d in out) == "Hello " and out[-1].finish_reason == "stop"
    out = run([1, 2, 3, 4], TABLE, max_tokens=3)
    assert "".join(d.text for d in out) == "Hello wor" and out[-1].finish_reason == "length"
    assert out[-1].completion_tokens == 3


def test_stop_string_split_across_tokens_is_cut_and_never_leaked():
    out = run([1, 2, 3, 4, 5], TABLE, stop=["o wo"])
    assert "".join(d.text for d in out) == "Hell" and out[-1].finish_reason == "stop"


def test_stop_string_not_hit_emits_everything():
    out = run([1, 2, 3, 4, 5], TABLE, stop=["xyz"])
    assert "".join(d.text for d in out) == "Hello world!" and out[-1].finish_reason == "length"


def test_a_completion_keeps_its_first_space_and_a_chat_answer_does_not():
    spaced = {1: "The sky is", 2: " a", 3: " canvas", 4: " of"}
    out = run([2, 3, 4], spaced, max_tokens=3)
    assert "".join(d.text for d in out) == " a canvas of"  # "The sky is" + it: the prompt and answer decoded
    out = run([2, 3, 4], spaced, max_tokens=3, shape=AnswerShape())
    assert "".join(d.text for d in out) == "a canvas of"
    out = run([2, 3], spaced, stop=["a c"], max_tokens=3)
    assert "".join(d.text for d in out) == " " and out[-1].stop_sequence == "a c"
