"""What chat clients and coding agents ask of an answer beyond plain text (issue 12): sampling
filters and penalties, logit_bias, logprobs, tools and tool calls, reasoning split from the
answer, and max_tokens defaulting to the room left.

The answer splitter is tested on its own with a real tokenizer's ids (a scripted token source:
what a model would say is the input); every other path runs a real node through the ``openai``
package, and where it changes tokens the answer must equal mlx-lm's own generate_step with the same
sampler and logits processors on the whole prompt.
"""

from __future__ import annotations

import asyncio
import json

import mlx.core as mx
import openai
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from meshnode.api import core
from meshnode.logonce import Once
from meshnode.model.build import build_model
from meshnode.serving.answer import AnswerShape
from meshnode.serving.engine import Engine
from meshnode.serving.placements import generate_request, received_params
from meshnode.serving.sampling import Sampled, SamplingParams
from tests.helpers import running_node

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HI = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """qwen3 in bf16 with a tool-calling, thinking chat template (build_model chat="agent")."""
    return build_model(
        tmp_path_factory.mktemp("agent") / "qwen3", "qwen3", num_layers=2, dtype="bfloat16", chat="agent"
    )


@pytest.fixture(scope="module")
def plain4(tmp_path_factory):
    """llama, 4-bit, with the plain template (no tool calling)."""
    return build_model(
        tmp_path_factory.mktemp("plain") / "llama", "llama", num_layers=2, dtype="bfloat16", quantize="4bit"
    )


# --- the answer splitter (pure: scripted token ids of a real tokenizer) ---------------------------


class _Script:
    def __init__(self, ids):
        self.ids = ids

    async def tokens(self, prompt, params):
        for t in self.ids:
            yield t


def _split(model_dir, said: str, prompt_text: str, tools=TOOLS, stop=(), forced=False):
    _, tok = load(str(model_dir))
    ids = tok.encode(said, add_special_tokens=False) + [tok.eos_token_ids and sorted(tok.eos_token_ids)[0]]
    engine = Engine("m", tok, _Script(ids), max_context=4096, vocab_size=len(tok))
    prompt = tok.encode(prompt_text, add_special_tokens=False)

    async def run():
        shape = AnswerShape(tools=tools, forced_tool=forced)
        return [d async for d in engine.stream(prompt, SamplingParams(max_tokens=500), stop, shape)]

    deltas = asyncio.run(run())
    return (
        "".join(d.text for d in deltas),
        "".join(d.reasoning for d in deltas),
        [c for d in deltas for c in d.tool_calls],
        deltas[-1],
    )


def test_thinking_content_and_a_tool_call_are_told_apart(agent):
    said = (
        "I should look it up.</think>Let me check."
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    text, reasoning, calls, last = _split(agent, said, "<|assistant|><think>")
    assert (text, reasoning) == ("Let me check.", "I should look it up.")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert last.finish_reason == "tool_calls" and calls[0].id.startswith("call_")


def test_without_tools_the_markup_is_content_and_a_closed_think_starts_normal(agent):
    said = 'Sure <tool_call>{"name": "x"}</tool_call> done'
    text, reasoning, calls, last = _split(agent, said, "<|assistant|><think></think>", tools=None)
    assert (text, reasoning, calls, last.finish_reason) == (said, "", [], "stop")


def test_a_stop_string_ends_the_content_not_the_reasoning(agent):
    text, reasoning, _, last = _split(agent, "a STOP b</think>c STOP d", "<think>", stop=["STOP"])
    assert (reasoning, text, last.finish_reason, last.stop_sequence) == ("a STOP b", "c ", "stop", "STOP")


def test_a_forced_call_and_a_broken_one(agent, caplog):
    said = '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    _, _, calls, last = _split(agent, said, "<think></think><tool_call>", forced=True)
    assert [c.name for c in calls] == ["get_weather"] and last.finish_reason == "tool_calls"
    _, _, calls, last = _split(agent, '{"name": "get_wea', "<think></think><tool_call>", forced=True)
    assert calls == [] and last.finish_reason == "stop" and "could not be parsed" in caplog.text


def test_sampling_params_cross_to_a_remote_head_unchanged():
    params = SamplingParams(
        max_tokens=9,
        temperature=0.5,
        top_p=0.75,
        seed=-3,
        offset=2,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        repetition_penalty=1.25,
        logit_bias=((3, -100.0), (7, 2.5)),
        top_logprobs=4,
    )
    assert received_params(generate_request("r", 1, [1, 2], params)) == params
    plain = SamplingParams(max_tokens=3)
    assert received_params(generate_request("r", 1, [1], plain)) == plain


# --- a real node through the openai package ------------------------------------------------------


def _reasoning(completion):
    """The answer's reasoning_content (an extra field to the openai package: absent when not sent)."""
    return getattr(completion.choices[0].message, "reasoning_content", None)


def _reference(model_dir, messages, max_tokens, *, temp=0.0, processors=None, **template):
    """mlx-lm's own generate_step on the whole templated prompt: token ids and logprob vectors."""
    m, tok = load(str(model_dir))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, **template)
    out = []
    for token, logprobs in generate_step(mx.array(prompt), m, max_tokens=max_tokens, logits_processors=processors):
        if token in tok.eos_token_ids:
            break
        out.append((int(token), logprobs))
    return tok, prompt, out


@pytest.mark.slow
@pytest.mark.parametrize("which", ["agent", "plain4"])
def test_penalties_and_logit_bias_match_mlx_lm(which, request, tmp_path):
    model_dir = request.getfixturevalue(which)
    fields = dict(presence_penalty=0.8, frequency_penalty=0.4, logit_bias={"40": 3.0, "41": -100})
    extra = {"repetition_penalty": 1.3}
    processors = make_logits_processors(
        logit_bias={40: 3.0, 41: -100.0}, repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.4
    )
    tok, _, ref = _reference(model_dir, HI, 24, processors=processors)
    with running_node(model_dir, tmp_path) as (node, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model, messages=HI, max_tokens=24, temperature=0, logprobs=True, extra_body=extra, **fields
        )
        # With the penalties off the answer differs: they took effect.
        plain = client.chat.completions.create(model=model, messages=HI, max_tokens=24, temperature=0)
    got = [tok.encode(e.token, add_special_tokens=False) for e in r.choices[0].logprobs.content]
    assert sum(got, []) == [t for t, _ in ref] or "".join(e.token for e in r.choices[0].logprobs.content) == tok.decode(
        [t for t, _ in ref]
    )
    text = (_reasoning(r) or "") + (r.choices[0].message.content or "")
    assert text.replace("</think>", "") == tok.decode([t for t, _ in ref]).replace("</think>", "")
    assert 41 not in [t for t, _ in ref]
    assert (plain.choices[0].message.content, _reasoning(plain)) != (r.choices[0].message.content, _reasoning(r))


@pytest.mark.slow
def test_logprobs_are_mlx_lms_and_top_k_one_is_greedy(plain4, tmp_path):
    tok, _, ref = _reference(plain4, HI, 8)
    with running_node(plain4, tmp_path) as (node, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model, messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
        )
        entries = r.choices[0].logprobs.content
        assert len(entries) == len(ref) == r.usage.completion_tokens
        for entry, (token, logprobs) in zip(entries, ref):
            assert entry.token == tok.decode([token])
            assert entry.logprob == pytest.approx(logprobs[token].item(), abs=0.05)
            assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the best
            assert [t.logprob for t in entry.top_logprobs] == sorted(
                (t.logprob for t in entry.top_logprobs), reverse=True
            )
        # top_k=1 leaves only the most likely token: greedy whatever the temperature.
        one = client.chat.completions.create(
            model=model, messages=HI, max_tokens=8, temperature=1.5, extra_body={"top_k": 1}
        )
        assert one.choices[0].message.content == r.choices[0].message.content
        # min_p and a seed: reproducible.
        a, b = (
            client.chat.completions.create(
                model=model, messages=HI, max_tokens=8, temperature=1.0, seed=7, extra_body={"min_p": 0.1}
            )
            .choices[0]
            .message.content
            for _ in "ab"
        )
        assert a == b
        # Streamed: the same logprobs, piece by piece.
        stream = client.chat.completions.create(
            model=model, messages=HI, max_tokens=8, temperature=0, stream=True, logprobs=True
        )
        streamed = [
            e.token
            for chunk in stream
            if chunk.choices and chunk.choices[0].logprobs
            for e in chunk.choices[0].logprobs.content
        ]
        assert streamed == [e.token for e in entries]
        # The legacy completions form.
        c = client.completions.create(model=model, prompt="The sea was", max_tokens=4, temperature=0, logprobs=2)
        legacy = c.choices[0].logprobs
        assert len(legacy.tokens) == len(legacy.token_logprobs) == 4
        # {text: logprob}: two alternatives, fewer where both decode alike (a partial UTF-8 byte is "\ufffd")
        assert all(
            1 <= len(top) <= 2 and max(top.values()) >= lp - 1e-6
            for top, lp in zip(legacy.top_logprobs, legacy.token_logprobs)
        )


@pytest.mark.slow
def test_tools_reach_the_template_and_the_reasoning_is_split(agent, tmp_path):
    history = HI + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]
    tok, prompt, ref = _reference(
        agent,
        [
            {
                **m,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ],
            }
            if m.get("tool_calls")
            else m
            for m in history
        ],
        16,
        tools=TOOLS,
    )
    with running_node(agent, tmp_path) as (node, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=16, temperature=0)
        assert r.usage.prompt_tokens == len(prompt)  # the tools and the call history went through the template
        # The template opened <think>: what the model says up to </think> is reasoning.
        said = tok.decode([t for t, _ in ref])
        thought, _, answer = said.partition("</think>")
        assert _reasoning(r) == (thought or None)
        assert (r.choices[0].message.content or "") == answer
        # Thinking off: the template closes the think block, and the answer is content.
        off = client.chat.completions.create(
            model=model, messages=HI, max_tokens=6, temperature=0, reasoning_effort="none"
        )
        assert _reasoning(off) is None and off.choices[0].message.content
        # tool_choice "none": the tools stay out of the prompt.
        none = client.chat.completions.create(
            model=model, messages=HI, tools=TOOLS, tool_choice="none", max_tokens=1, temperature=0
        )
        with_tools = client.chat.completions.create(model=model, messages=HI, tools=TOOLS, max_tokens=1, temperature=0)
        assert none.usage.prompt_tokens < with_tools.usage.prompt_tokens
        # Streamed reasoning arrives as reasoning_content deltas.
        stream = client.chat.completions.create(
            model=model, messages=history, tools=TOOLS, max_tokens=16, temperature=0, stream=True
        )
        parts = [c.choices[0].delta for c in stream if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in parts) == thought


@pytest.mark.slow
def test_tools_are_always_accepted_and_max_tokens_is_the_room_left(plain4, tmp_path, caplog, monkeypatch):
    """A model whose template has no tool-call format answers without the tools (Open WebUI sends
    its built-in tools with every chat) and says so once; max_tokens left out, or more than the
    context holds (agents ask for 32000), is the room left: the answer ends with "length"."""
    never_ends = {str(t): -100 for t in load(str(plain4))[1].eos_token_ids}
    monkeypatch.setattr(core, "_TOOLLESS", Once())  # said once per model and process: this test's process
    with running_node(plain4, tmp_path, max_context=48) as (node, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        plain = client.chat.completions.create(model=model, messages=HI, max_tokens=6, temperature=0)
        for _ in range(2):
            r = client.chat.completions.create(model=model, messages=HI, tools=TOOLS, max_tokens=6, temperature=0)
            assert r.choices[0].message.content == plain.choices[0].message.content
            assert r.usage.prompt_tokens == plain.usage.prompt_tokens
        assert caplog.text.count("answered without them") == 1
        for asked in (None, 100000):
            r = client.chat.completions.create(
                model=model,
                messages=HI,
                temperature=0,
                logit_bias=never_ends,
                **({"max_tokens": asked} if asked else {}),
            )
            assert r.choices[0].finish_reason == "length"
            assert r.usage.prompt_tokens + r.usage.completion_tokens == 48


SCHEMA = {
    "type": "object",
    "properties": {"sunny": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
    "required": ["sunny", "level"],
    "additionalProperties": False,
}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["agent", "plain4"])
def test_structured_output_follows_the_schema(which, request, tmp_path):
    model_dir = request.getfixturevalue(which)
    with running_node(model_dir, tmp_path) as (node, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
        for seed in (1, 2, 3):  # sampled, not greedy: whatever the model draws, the answer is valid
            r = client.chat.completions.create(
                model=model, messages=HI, response_format=fmt, temperature=1.0, seed=seed, max_tokens=60
            )
            answer = json.loads(r.choices[0].message.content)
            assert r.choices[0].finish_reason == "stop" and set(answer) == {"sunny", "level"}
            assert isinstance(answer["sunny"], bool) and answer["level"] in (1, 2, 3)
        # Streamed as well.
        stream = client.chat.completions.create(
            model=model, messages=HI, response_format=fmt, temperature=0, max_tokens=60, stream=True
        )
        assert json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)).keys() == {
            "sunny",
            "level",
        }
        # json_object: a JSON object, whatever is in it.
        r = client.chat.completions.create(
            model=model, messages=HI, response_format={"type": "json_object"}, temperature=0, max_tokens=12
        )
        assert r.choices[0].message.content.startswith("{")
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=model,
                messages=HI,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}},
            )
        assert e.value.body["param"] == "response_format" and "frob" in e.value.body["message"]


@pytest.mark.slow
def test_the_last_piece_is_streamed_once(plain4, tmp_path):
    """A stop string that never comes holds the answer's tail back until the last piece (as does a
    token cut mid-character); the stream sends that piece once, as the whole answer has it."""
    with running_node(plain4, tmp_path) as (node, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        args = dict(model=model, messages=HI, max_tokens=12, temperature=0, stop=["never said"])
        whole = client.chat.completions.create(**args).choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True) if c.choices
        )
        assert streamed == whole and len(whole) > len("never said")


def test_a_logprob_travels_as_an_int():
    token = Sampled(5, -0.25, ((5, -0.25), (9, -2.0)))
    assert token == 5 and [1, 2] + [token] == [1, 2, 5] and (token.logprob, token.top[1]) == (-0.25, (9, -2.0))
