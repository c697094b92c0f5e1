"""The OpenAI-compatible API of one real node: answers equal mlx_lm.generate; bad input gets a 4xx."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import aiohttp
import anthropic
import openai
import pytest
from mlx_lm import generate as mlx_generate
from mlx_lm import load as mlx_load
from openai import OpenAI

from meshnode.model.build import build_model
from tests.helpers import running_node

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("api") / "llama", "llama", num_layers=4, dtype="float32")


@pytest.fixture(scope="module")
def node(model_path, tmp_path_factory):
    with running_node(
        model_path,
        tmp_path_factory.mktemp("node"),
        max_context=512,
        max_body_bytes=64 * 1024,
        max_concurrent_requests=3,
    ) as (node, base):
        yield node, base


@pytest.fixture(scope="module")
def reference(model_path):
    model, tokenizer = mlx_load(str(model_path))

    def ref(messages=MESSAGES, max_tokens=20, prompt=None):
        if prompt is None:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return mlx_generate(model, tokenizer, prompt=prompt, max_tokens=max_tokens)

    return ref


def client(base):
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(node):
    n, base = node
    c = client(base)
    assert [m.id for m in c.models.list().data] == [n.model_id]


def test_a_model_by_id_through_both_sdks_strictly(node):
    """/v1/models and /v1/models/{id} as the openai and anthropic packages read them, each
    validating the whole answer against its own types; an unknown id is each SDK's 404."""
    n, base = node
    strict = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, _strict_response_validation=True)
    got = strict.models.retrieve(n.model_id)
    assert (got.id, got.object, got.created, got.owned_by) == (n.model_id, "model", 0, "meshnode")
    assert (got.model_extra["state"], got.model_extra["context_length"]) == ("ready", 512)
    assert [m.model_dump() for m in strict.models.list().data] == [got.model_dump()]
    with pytest.raises(openai.NotFoundError) as missing:
        strict.models.retrieve("no-such-model")
    assert (missing.value.body["code"], missing.value.body["param"]) == ("model_not_found", "model")
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, _strict_response_validation=True)
    [info] = list(claude.models.list())
    assert (info.id, info.type, info.display_name, info.lifecycle) == (n.model_id, "model", n.model_id, "active")
    assert info.created_at == datetime(1970, 1, 1, tzinfo=UTC)
    assert (info.max_input_tokens, info.max_tokens) == (512, 512)  # the context served; max_tokens_limit is above
    assert claude.models.retrieve(n.model_id) == info
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude.models.retrieve("no-such-model")
    assert unknown.value.body["type"] == "error" and unknown.value.body["error"]["type"] == "not_found_error"


def test_chat_matches_mlx_lm(node, reference):
    n, base = node
    out = client(base).chat.completions.create(model=n.model_id, messages=MESSAGES, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == reference()
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens <= 20 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream_matches_mlx_lm(node, reference):
    n, base = node
    stream = client(base).chat.completions.create(
        model=n.model_id,
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == reference()
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0


def test_completions_match_mlx_lm(node, reference):
    n, base = node
    c = client(base)
    out = c.completions.create(model=n.model_id, prompt="Once upon a time", max_tokens=16, temperature=0)
    assert out.choices[0].text == reference(prompt="Once upon a time", max_tokens=16)
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=n.model_id, prompt="Once upon a time", max_tokens=16, temperature=0, stream=True
        )
        if ch.choices
    )
    assert streamed == out.choices[0].text


def test_completion_text_continues_the_prompt(node, model_path):
    """A completion's text is what follows the prompt when both are decoded together: the first
    token's leading space is kept (logit_bias makes every token one that starts with a space)."""
    n, base = node
    _, tokenizer = mlx_load(str(model_path))
    prompt = "The sky is"
    spaced = next(t for t in range(len(tokenizer)) if (w := tokenizer.decode([t]))[:1] == " " and w[1:].isalpha())
    said = [spaced] * 3
    kw = dict(model=n.model_id, prompt=prompt, max_tokens=3, temperature=0, logit_bias={str(spaced): 100})
    c = client(base)
    out = c.completions.create(**kw, logprobs=1).choices[0]
    ids = tokenizer.encode(prompt)
    assert tokenizer.decode(ids) + out.text == tokenizer.decode(ids + said) and out.text.startswith(" ")
    assert "".join(out.logprobs.tokens) == out.text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True) if ch.choices)
    assert streamed == out.text
    chat = c.chat.completions.create(**{k: v for k, v in kw.items() if k != "prompt"}, messages=MESSAGES)
    assert chat.choices[0].message.content == tokenizer.decode(said).removeprefix(" ")  # an answer, not a continuation


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_a_required_tool_call_from_a_model_that_cannot_make_one_is_a_400(node):
    """This model's template has no tool-call format: tool_choice "required" or a named function,
    which promise a call, are refused; "auto" answers without the tools."""
    n, base = node
    c = client(base)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(
                model=n.model_id, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=2
            )
        err = refused.value.body
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "tool_choice", "unsupported_value")
        assert "no tool-call format" in err["message"] and n.model_id in err["message"]
    auto = c.chat.completions.create(model=n.model_id, messages=MESSAGES, tools=TOOLS, max_tokens=2, temperature=0)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content is not None


async def test_raw_sse_format(node):
    n, base = node
    async with aiohttp.ClientSession() as s:
        body = {"model": n.model_id, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "stream": True}
        async with s.post(f"{base}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
    events = [e for e in raw.split("\n\n") if e and not e.startswith(":")]  # keep-alives
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_stop_strings(node, reference):
    n, base = node
    full = reference(max_tokens=30)
    cut = full[len(full) // 2 : len(full) // 2 + 2]
    if not cut.strip():
        pytest.skip("no usable stop string in this output")
    out = client(base).chat.completions.create(
        model=n.model_id, messages=MESSAGES, max_tokens=30, temperature=0, stop=[cut]
    )
    assert out.choices[0].message.content == full[: full.index(cut)]
    assert out.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(node):
    n, base = node
    c = client(base)
    kw = dict(model=n.model_id, messages=MESSAGES, max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    assert (
        c.chat.completions.create(**kw).choices[0].message.content
        == c.chat.completions.create(**kw).choices[0].message.content
    )


def test_concurrent_requests_each_correct(node, reference):
    n, base = node
    want = reference()
    c = client(base)
    with ThreadPoolExecutor(3) as pool:
        outs = list(
            pool.map(
                lambda _: (
                    c.chat.completions.create(model=n.model_id, messages=MESSAGES, max_tokens=20, temperature=0)
                    .choices[0]
                    .message.content
                ),
                range(3),
            )
        )
    assert outs == [want] * 3


async def test_client_disconnect_stops_generation(node):
    n, base = node
    async with aiohttp.ClientSession() as s:
        body = {"model": n.model_id, "prompt": "hello", "max_tokens": 400, "temperature": 0, "stream": True}
        async with s.post(f"{base}/v1/completions", json=body) as r:
            await r.content.readline()
            assert n.scheduler.active == 1
    deadline = time.monotonic() + 10
    while n.scheduler.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert n.scheduler.active == 0


BAD = [
    ("not json", 400),
    (json.dumps([1, 2]), 400),
    (json.dumps({"messages": MESSAGES}), 400),  # no model
    (json.dumps({"model": "MODEL", "messages": []}), 400),
    (json.dumps({"model": "MODEL", "messages": "hi"}), 400),
    (json.dumps({"model": "MODEL", "messages": [{"role": "wizard", "content": "x"}]}), 400),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": 5}]}), 400),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user"}]}), 400),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400),
    (json.dumps({"model": "MODEL", "messages": MESSAGES, "max_tokens": -1}), 400),
    (json.dumps({"model": "MODEL", "messages": MESSAGES, "max_tokens": "ten"}), 400),
    (json.dumps({"model": "MODEL", "messages": MESSAGES, "temperature": 3}), 400),
    (json.dumps({"model": "MODEL", "messages": MESSAGES, "temperature": -0.5}), 400),
    (json.dumps({"model": "MODEL", "messages": MESSAGES, "top_p": 0}), 400),
    (json.dumps({"model": "MODEL", "messages": MESSAGES, "stream": "yes"}), 400),
    (json.dumps({"model": "MODEL", "messages": MESSAGES, "stop": [1, 2]}), 400),
    (json.dumps({"model": "MODEL", "messages": MESSAGES, "n": 3}), 400),
    (json.dumps({"model": "no-such-model", "messages": MESSAGES}), 404),
    (json.dumps({"model": "MODEL", "messages": [{"role": "user", "content": "word " * 2000}]}), 400),
]


@pytest.mark.parametrize("body,status", BAD)
async def test_bad_chat_input(node, body, status):
    n, base = node
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{base}/v1/chat/completions",
            data=body.replace("MODEL", n.model_id),
            headers={"Content-Type": "application/json"},
        ) as r:
            assert r.status == status, await r.text()
            err = (await r.json())["error"]
            assert err["message"] and err["type"]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ""},
        {"prompt": 5},
        {"prompt": [1, -3]},
        {"prompt": [10**9]},
        {"prompt": None},
    ],
)
async def test_bad_completion_input(node, body):
    n, base = node
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base}/v1/completions", json={"model": n.model_id, **body}) as r:
            assert r.status == 400, await r.text()


async def test_body_too_large_and_unknown_route(node):
    n, base = node
    async with aiohttp.ClientSession() as s:
        big = {"model": n.model_id, "messages": [{"role": "user", "content": "x" * 100_000}]}
        async with s.post(f"{base}/v1/chat/completions", json=big) as r:
            assert r.status == 413
            assert "too large" in (await r.json())["error"]["message"]
        async with s.get(f"{base}/v1/nothing") as r:
            assert r.status == 404
            assert (await r.json())["error"]
        async with s.get(f"{base}/v1/chat/completions") as r:
            assert r.status == 405
    # and the node still serves
    out = client(base).chat.completions.create(model=n.model_id, messages=MESSAGES, max_tokens=3, temperature=0)
    assert out.choices[0].message.content is not None


async def test_too_many_concurrent_requests_get_429(node):
    n, base = node
    # Streams that run their full 400 tokens: greedy, this test model ends "hello" after a few tokens
    # (EOS), which frees the slots before the fourth request; this seed samples no EOS in 400.
    body = {"model": n.model_id, "prompt": "hello", "max_tokens": 400, "temperature": 2, "seed": 1, "stream": True}
    async with aiohttp.ClientSession() as s:
        streams = [await s.post(f"{base}/v1/completions", json=body) for _ in range(3)]  # the fixture's limit
        try:
            for r in streams:
                assert r.status == 200
                await r.content.readline()
            async with s.post(f"{base}/v1/completions", json=body) as r:
                assert r.status == 429
                assert int(r.headers["Retry-After"]) >= 1
                assert (await r.json())["error"]["type"] == "rate_limit_error"
        finally:
            for r in streams:
                r.close()
    deadline = time.monotonic() + 10
    while n.scheduler.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert n.scheduler.active == 0


def test_models_are_listed_while_the_mesh_cannot_serve_and_an_unknown_model_is_404(model_path, tmp_path):
    """GET /v1/models answers 200 with the model and its state even when no plan can serve it
    (here: a budget too small for the model), so a client lists what it can ask for; a request for
    it gets 503 with Retry-After, and one for another model 404 (not a 503 that a client retries)."""
    import openai

    with running_node(model_path, tmp_path, ready=False, memory_budget=4096) as (n, base):
        c = client(base)
        listed = c.models.list().data
        # "loading" until the coordinator has found that nothing fits, a moment later
        [(model_id, state)] = [(m.id, m.model_extra.get("state")) for m in listed]
        assert model_id == n.model_id and state in ("loading", "does not fit"), state
        with pytest.raises(openai.APIStatusError) as err:
            c.chat.completions.create(model=n.model_id, messages=MESSAGES, max_tokens=2)
        assert err.value.status_code == 503 and "Retry-After" in err.value.response.headers
        with pytest.raises(openai.NotFoundError) as err:
            c.chat.completions.create(model="other", messages=MESSAGES, max_tokens=2)
        assert err.value.body["code"] == "model_not_found"
