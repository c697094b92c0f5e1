"""Request parsing (pure) and the engine's stop-string handling."""

import asyncio

import pytest

from meshnode.api.validation import ApiError, Limits, parse_request
from meshnode.serving.engine import Engine
from meshnode.serving.generation import SamplingParams

L = Limits(max_tokens_limit=100, default_max_tokens=10)
MSG = [{"role": "user", "content": "hi"}]


def test_chat_defaults_follow_openai():
    r = parse_request({"model": "m", "messages": MSG}, "chat", L)
    assert (r.temperature, r.top_p, r.max_tokens, r.stream, r.stop) == (1.0, 1.0, None, False, ())


def test_content_parts_are_joined():
    r = parse_request({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, "chat", L)
    assert r.messages[0]["content"] == "ab"


def test_completion_prompt_forms():
    assert parse_request({"model": "m", "prompt": ["x"]}, "completion", L).prompt == "x"
    assert parse_request({"model": "m", "prompt": [1, 2]}, "completion", L).prompt == [1, 2]


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": MSG, "max_tokens": 0},
    {"model": "m", "messages": MSG, "max_tokens": 101},
    {"model": "m", "messages": MSG, "max_tokens": True},
    {"model": "m", "messages": MSG, "temperature": float("nan")},
    {"model": "m", "messages": MSG, "top_p": 1.5},
    {"model": "m", "messages": MSG, "seed": "x"},
    {"model": "m", "messages": MSG, "stop": ["a", "b", "c", "d", "e"]},
    {"model": "m", "messages": MSG, "stream_options": 3},
    {"model": 3, "messages": MSG},
])
def test_rejected(body):
    with pytest.raises(ApiError) as e:
        parse_request(body, "chat", L)
    assert e.value.status == 400 and e.value.message


class _Detok:
    def __init__(self, table):
        self.table, self.last_segment = table, ""

    def add_token(self, t):
        self.last_segment = self.table[t]

    def finalize(self):
        self.last_segment = ""


class _Tok:
    eos_token_ids = {0}

    def __init__(self, table):
        self.table = table

    @property
    def detokenizer(self):
        return _Detok(self.table)


class _Source:
    def __init__(self, tokens):
        self._tokens = tokens

    async def tokens(self, prompt, params):
        for t in self._tokens:
            yield t


def run(tokens, table, stop=(), max_tokens=50):
    engine = Engine("m", _Tok(table), _Source(tokens), max_context=100, vocab_size=10)

    async def go():
        return [d async for d in engine.stream([1], SamplingParams(max_tokens=max_tokens), stop)]

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
