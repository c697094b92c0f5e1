"""The Ollama API of one real node, through the ``ollama`` client: listing, show, ps, chat and
generate (streamed and not), options, errors in Ollama's shape. Greedy answers equal the same
request through the OpenAI route and ``mlx_lm.generate``; two families and weight formats (llama
4-bit, qwen3 bf16). The framing of reasoning, tool calls and logprobs is tested on constructed
deltas (the tiny models make none)."""

from __future__ import annotations

import asyncio
import json

import gguf
import httpx
import ollama
import pytest
from aiohttp.test_utils import TestClient, TestServer
from mlx_lm import generate as mlx_generate
from mlx_lm import load as mlx_load

from meshnode.api import core, ollama_schema
from meshnode.api import ollama as surface
from meshnode.api.app import ApiSettings, make_app
from meshnode.api.validation import Limits
from meshnode.errors import ApiError
from meshnode.model.build import build_model
from meshnode.serving.engine import Delta, TokenLogprob, ToolCall
from meshnode.weights.gguf_source import resolve_gguf
from meshnode.weights.profile import profile_model
from tests.ggufwrite import write_gguf
from tests.helpers import running_node

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0, "num_predict": 12}
KEY = "ollama-test-key"
FAMILIES = {"llama": dict(quantize="4bit", dtype="bfloat16"), "qwen3": dict(quantize=None, dtype="bfloat16")}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama")
    return {
        family: build_model(root / family, family, num_layers=2, hidden_size=64, intermediate_size=128, **kw)
        for family, kw in FAMILIES.items()
    }


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, models, tmp_path_factory):
    """(family, model path, node, base URL, headers); the qwen3 node asks for an API key."""
    family = request.param
    key = KEY if family == "qwen3" else None
    with running_node(models[family], tmp_path_factory.mktemp(f"node-{family}"), max_context=512, api_key=key) as (
        node,
        base,
    ):
        yield family, models[family], node, base, ({"Authorization": f"Bearer {key}"} if key else {})


def client(served) -> ollama.Client:
    *_, base, headers = served
    return ollama.Client(host=base, headers=headers, timeout=60)


def post(served, path: str, body: dict) -> httpx.Response:
    *_, base, headers = served
    return httpx.post(base + path, json=body, headers=headers, timeout=60)


def reference(path, messages=MESSAGES, max_tokens=12) -> str:
    model, tokenizer = mlx_load(str(path))
    return mlx_generate(
        model,
        tokenizer,
        prompt=tokenizer.apply_chat_template(messages, add_generation_prompt=True),
        max_tokens=max_tokens,
    )


def test_version_list_show_ps(served):
    family, path, node, base, headers = served
    assert httpx.get(f"{base}/api/version", headers=headers, timeout=10).json() == {"version": surface.OLLAMA_VERSION}
    c = client(served)
    listed = c.list().models
    assert [m.model for m in listed] == [node.model_id]
    assert listed[0].details.format == "mlx" and listed[0].digest and listed[0].modified_at is not None
    shown = c.show(node.model_id)
    assert "completion" in shown.capabilities
    assert shown.modelinfo["general.basename"] == node.model_id
    assert shown.template and "temperature 0.8" in shown.parameters
    running = c.ps().models
    assert [m.model for m in running] == [node.model_id] and running[0].context_length == 512
    assert c.show(f"{node.model_id}:latest").capabilities == shown.capabilities


def test_greedy_chat_equals_openai_route_and_mlx_lm(served):
    family, path, node, base, headers = served
    out = client(served).chat(model=node.model_id, messages=MESSAGES, options=GREEDY, stream=False)
    openai = post(
        served,
        "/v1/chat/completions",
        {"model": node.model_id, "messages": MESSAGES, "max_tokens": 12, "temperature": 0},
    ).json()
    assert out.message.content == openai["choices"][0]["message"]["content"] == reference(path)
    assert out.message.role == "assistant" and out.done and out.done_reason in ("stop", "length")
    assert out.eval_count == openai["usage"]["completion_tokens"]
    assert out.prompt_eval_count == openai["usage"]["prompt_tokens"]
    assert out.total_duration >= out.prompt_eval_duration + out.eval_duration >= 0 and out.load_duration == 0


def test_streamed_chat_is_ndjson_ending_in_done(served):
    family, path, node, base, headers = served
    whole = client(served).chat(model=node.model_id, messages=MESSAGES, options=GREEDY, stream=False)
    parts = list(client(served).chat(model=node.model_id, messages=MESSAGES, options=GREEDY, stream=True))
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert (parts[-1].done_reason, parts[-1].eval_count) == (whole.done_reason, whole.eval_count)
    # stream is Ollama's default: a body without it gets NDJSON
    with httpx.stream(
        "POST",
        f"{base}/api/chat",
        headers=headers,
        timeout=60,
        json={"model": node.model_id, "messages": MESSAGES, "options": GREEDY},
    ) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(o["message"]["content"] for o in lines) == whole.message.content
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == whole.eval_count


def test_generate_streamed_and_not(served):
    family, path, node, base, headers = served
    c = client(served)
    chat = c.chat(model=node.model_id, messages=MESSAGES, options=GREEDY, stream=False)
    out = c.generate(model=node.model_id, system=MESSAGES[0]["content"], prompt=MESSAGES[1]["content"], options=GREEDY)
    assert out.response == chat.message.content and out.done and out.eval_count == chat.eval_count
    parts = list(
        c.generate(
            model=node.model_id,
            system=MESSAGES[0]["content"],
            prompt=MESSAGES[1]["content"],
            options=GREEDY,
            stream=True,
        )
    )
    assert "".join(p.response for p in parts) == out.response and parts[-1].done
    raw = c.generate(model=node.model_id, prompt="The sea is", raw=True, options=GREEDY)
    completion = post(
        served, "/v1/completions", {"model": node.model_id, "prompt": "The sea is", "max_tokens": 12, "temperature": 0}
    ).json()
    assert raw.response == completion["choices"][0]["text"]


def test_options(served):
    family, path, node, base, headers = served
    c = client(served)
    short = c.chat(model=node.model_id, messages=MESSAGES, options={"temperature": 0, "num_predict": 3})
    assert short.eval_count <= 3 and short.done_reason == ("length" if short.eval_count == 3 else "stop")
    seeded = [
        c.chat(model=node.model_id, messages=MESSAGES, options={"seed": 7, "num_predict": 8}).message.content
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    greedy = c.chat(model=node.model_id, messages=MESSAGES, options={**GREEDY, "num_predict": 20}).message.content
    if len(greedy) >= 6:
        stop = greedy[3:6]
        cut = c.chat(model=node.model_id, messages=MESSAGES, options={**GREEDY, "num_predict": 20, "stop": [stop]})
        assert cut.message.content == greedy[: greedy.index(stop)] and cut.done_reason == "stop"
    # options that cannot change the answer are accepted and ignored
    same = c.chat(
        model=node.model_id,
        messages=MESSAGES,
        keep_alive="5m",
        options={**GREEDY, "num_predict": 20, "num_ctx": 8192, "num_thread": 2, "mirostat": 0},
    )
    assert same.message.content == greedy


def test_format_constrains_the_answer_to_json(served):
    family, path, node, base, headers = served
    c = client(served)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    for seed in (1, 2):
        r = c.chat(
            model=node.model_id,
            messages=MESSAGES,
            format=schema,
            options={"temperature": 1.0, "seed": seed, "num_predict": 60},
        )
        answer = json.loads(r.message.content)
        assert set(answer) == {"ok", "n"} and answer["n"] in (1, 2, 3) and r.done_reason == "stop"
    r = c.generate(model=node.model_id, prompt="hi", format="json", options={**GREEDY, "num_predict": 8})
    assert r.response.startswith("{")


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(messages=[{"role": "user", "content": "hi", "images": [b"\x89PNG"]}]), "messages[0].images"),
        (dict(messages=MESSAGES, options={"mirostat": 2}), "options.mirostat"),
        (dict(messages=MESSAGES, options={"num_predict": 0}), "options.num_predict"),
        (dict(messages=MESSAGES, think="high"), "think"),
    ],
)
def test_refused_input_names_the_field(served, kwargs, field):
    family, path, node, base, headers = served
    with pytest.raises(ollama.ResponseError) as err:
        client(served).chat(model=node.model_id, **kwargs)
    assert err.value.status_code == 400 and f"'{field}'" in err.value.error


def test_refused_generate_input_and_ollama_error_shape(served):
    family, path, node, base, headers = served
    for body, field in [
        ({"images": ["aGk="]}, "images"),
        ({"suffix": "end"}, "suffix"),
        ({"context": [1, 2]}, "context"),
        ({"options": {"bogus": 1}}, "options.bogus"),
        ({"format": "yaml"}, "format"),
    ]:  # (the ollama package refuses it before sending)
        r = post(served, "/api/generate", {"model": node.model_id, "prompt": "hi", **body})
        assert r.status_code == 400 and list(r.json()) == ["error"] and f"'{field}'" in r.json()["error"], r.text
    with pytest.raises(ollama.ResponseError) as err:
        client(served).chat(model="no-such-model", messages=MESSAGES)
    assert err.value.status_code == 404 and "no-such-model" in err.value.error
    r = post(served, "/api/show", {"model": "no-such-model"})
    assert r.status_code == 404 and "error" in r.json()


def test_latest_tag_and_load_calls(served):
    family, path, node, base, headers = served
    c = client(served)
    tagged = c.chat(model=f"{node.model_id}:latest", messages=MESSAGES, options=GREEDY)
    assert tagged.message.content == c.chat(model=node.model_id, messages=MESSAGES, options=GREEDY).message.content
    assert c.generate(model=f"{node.model_id}:latest").done_reason == "load"  # Ollama's "load the model"
    loaded = c.chat(model=node.model_id, messages=[])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""


def test_api_key_applies_to_ollama_routes(served):
    family, path, node, base, headers = served
    bare = ollama.Client(host=base, timeout=10)  # no Authorization header
    if not headers:  # a node without an API key answers anyone
        assert bare.list().models
        return
    with pytest.raises(ollama.ResponseError) as err:
        bare.list()
    assert err.value.status_code == 401 and "API key" in err.value.error


# --------------------------------------------------------------------------- in-process


class _Forming:
    """A backend whose mesh is still forming: the model is listed, but not ready."""

    def __init__(self, profile=None):
        self.profile = profile

    def model_profile(self, model):  # the optional hook that fills in a model's details
        return self.profile if model == "m" else None

    def models(self):
        return [{"id": "m", "state": "loading"}]

    def engine(self, model):
        if model != "m":
            raise ApiError(404, f"model '{model}' is not served here")
        raise ApiError(503, "the mesh is still forming; no plan yet", headers={"Retry-After": "2"})

    async def ready_engine(self, model):
        return self.engine(model)

    def health(self):
        return False, {}

    def mesh_status(self):
        return {}


def test_while_the_mesh_forms_models_are_listed_and_requests_get_503(models):
    profile = profile_model(models["llama"], "llama")

    async def main():
        async with TestClient(TestServer(make_app(_Forming(profile), ApiSettings(access_log=False)))) as http:
            [listed] = (await (await http.get("/api/tags")).json())["models"]
            assert listed["name"] == "m" and listed["size"] == profile.weight_bytes()
            assert listed["details"]["family"] == "llama" and listed["details"]["quantization_level"] == "Q4"
            assert (await (await http.get("/api/ps")).json()) == {"models": []}
            r = await http.post("/api/chat", json={"model": "m:latest", "messages": MESSAGES})
            assert r.status == 503 and r.headers["Retry-After"] == "2"
            assert (await r.json()) == {"error": "the mesh is still forming; no plan yet"}
            r = await http.post("/api/generate", json={"model": "x"})
            assert r.status == 404 and "'x'" in (await r.json())["error"]
            r = await http.post("/api/chat", data=b"{not json")
            assert r.status == 400 and "invalid JSON" in (await r.json())["error"]

    asyncio.run(asyncio.wait_for(main(), 30))


def test_deltas_map_to_ollama_messages():
    call = ToolCall("call_1", "get_weather", '{"city": "Oslo"}')
    lp = TokenLogprob("Hi", -0.5, (("Hi", -0.5), ("Yo", -1.5)))
    obj = surface.piece("chat", "m", Delta("Hi", 1, reasoning="hmm", tool_calls=(call,), logprobs=(lp,)))
    assert obj["message"] == {
        "role": "assistant",
        "content": "Hi",
        "thinking": "hmm",
        "tool_calls": [{"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
    }
    assert obj["logprobs"] == [
        {
            "token": "Hi",
            "logprob": -0.5,
            "top_logprobs": [{"token": "Hi", "logprob": -0.5}, {"token": "Yo", "logprob": -1.5}],
        }
    ]
    assert obj["done"] is False and obj["model"] == "m"
    gen = surface.piece("generate", "m", Delta("x", 1, reasoning="r"))
    assert (gen["response"], gen["thinking"]) == ("x", "r") and "message" not in gen
    assert [surface.done_reason(f) for f in ("stop", "length", "tool_calls")] == ["stop", "length", "stop"]
    # the ollama client reads them back
    parsed = ollama.ChatResponse(**obj)
    assert parsed.message.tool_calls[0].function.arguments == {"city": "Oslo"} and parsed.message.thinking == "hmm"

    class _Gen:
        model, prompt_tokens = "m", 7

    clock = surface.Clock(0)
    clock.tick()
    answer = core.Answer("Hello", "thought", [call], [], Delta("", 2, "tool_calls"))
    body = surface.whole("chat", _Gen(), answer, clock)
    assert body["done"] and body["done_reason"] == "stop" and body["eval_count"] == 2
    assert body["prompt_eval_count"] == 7 and body["message"]["thinking"] == "thought"
    assert body["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert all(
        isinstance(body[k], int) and body[k] >= 0
        for k in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")
    )


def test_messages_become_template_messages():
    req = ollama_schema.parse(
        {
            "model": "m",
            "think": True,
            "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "thinking": "call it",
                    "tool_calls": [
                        {"function": {"name": "get", "arguments": {"city": "Oslo"}}},
                        {"function": {"name": "time", "arguments": {}}},
                    ],
                },
                {"role": "tool", "content": "12:00", "tool_name": "time"},
                {"role": "tool", "content": "sunny"},
            ],
        },
        "chat",
        Limits(),
        ["m"],
    )
    assert req.think is True and req.tools == [
        {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
    ]
    assert req.messages == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "call it",
            "tool_calls": [
                {"id": "call_1_0", "type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}},
                {"id": "call_1_1", "type": "function", "function": {"name": "time", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "12:00", "name": "time", "tool_call_id": "call_1_1"},
        {"role": "tool", "content": "sunny", "name": "get", "tool_call_id": "call_1_0"},
    ]


def test_options_map_with_ollamas_defaults():
    limits = Limits(max_tokens_limit=100)
    plain = ollama_schema.parse({"model": "m", "prompt": "hi"}, "generate", limits, ["m"])
    assert (plain.temperature, plain.top_k, plain.top_p, plain.max_tokens, plain.stream) == (0.8, 40, 0.9, None, True)
    assert plain.messages == [{"role": "user", "content": "hi"}] and plain.kind == "chat"
    req = ollama_schema.parse(
        {
            "model": "m",
            "prompt": "hi",
            "stream": False,
            "options": {
                "temperature": 0.2,
                "top_p": 0.5,
                "top_k": 0,
                "min_p": 0.1,
                "seed": 3,
                "num_predict": 9,
                "stop": ["x", ""],
                "repeat_penalty": 1.3,
                "presence_penalty": 0.5,
                "frequency_penalty": 0,
                "num_ctx": 4096,
            },
        },
        "generate",
        limits,
        ["m"],
    )
    assert (req.temperature, req.top_p, req.top_k, req.min_p, req.seed, req.max_tokens, req.stop) == (
        0.2,
        0.5,
        None,
        0.1,
        3,
        9,
        ("x",),
    )
    assert (req.repetition_penalty, req.presence_penalty, req.frequency_penalty, req.stream) == (1.3, 0.5, None, False)
    raw = ollama_schema.parse(
        {
            "model": "m:latest",
            "prompt": "hi",
            "raw": True,
            "logprobs": True,
            "top_logprobs": 3,
            "options": {"num_predict": -1},
        },
        "generate",
        limits,
        ["m"],
    )
    assert (raw.kind, raw.prompt, raw.model, raw.logprobs, raw.top_logprobs, raw.max_tokens) == (
        "completion",
        "hi",
        "m",
        True,
        3,
        None,
    )
    with pytest.raises(ApiError) as err:
        ollama_schema.parse({"model": "m", "prompt": "hi", "options": {"num_predict": 0}}, "generate", limits, ["m"])
    assert err.value.param == "options.num_predict"
    # More than the server's limit: capped at the room left when served, not refused.
    assert (
        ollama_schema.parse(
            {"model": "m", "prompt": "hi", "options": {"num_predict": 10**6}}, "generate", limits, ["m"]
        ).max_tokens
        == 10**6
    )


def test_details_from_the_model_profile(models):
    llama, qwen = (profile_model(models[f], f) for f in ("llama", "qwen3"))
    assert surface.details(llama)["quantization_level"] == "Q4" and surface.details(llama)["family"] == "llama"
    assert surface.details(qwen)["quantization_level"] == "BF16"
    assert surface.details(qwen)["parameter_size"].endswith(("K", "M"))


def test_a_gguf_files_quantization_level_is_its_type(tmp_path):
    """A Q4_1 file keeps its embedding at Q8_0, as llama.cpp writes it (SmolLM2's does): the level
    is the file's type, not a width averaged over all weights (which read 5 bits)."""
    q = gguf.GGMLQuantizationType
    source = build_model(tmp_path / "f32", "llama", num_layers=2, hidden_size=64, intermediate_size=128)
    for file_type in (gguf.LlamaFileType.MOSTLY_Q4_1, None):  # None: the blocks' commonest type
        path = write_gguf(source, tmp_path / f"{file_type}.gguf", q.Q4_1, {"token_embd": q.Q8_0}, file_type)
        _, folder = resolve_gguf(str(path), tmp_path / f"cache-{file_type}")
        assert surface.details(profile_model(folder))["quantization_level"] == "Q4_1"
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["model.embed_tokens"]["bits"] == 8
    # an MLX folder of those weights without the file's name: its modules' common width
    del config["gguf"]
    (folder / "config.json").write_text(json.dumps(config))
    assert surface.details(profile_model(folder))["quantization_level"] == "Q4"
