"""A quantized KV cache (setting ``kv_bits``, meshnode.weights.kvquant): the plan counts mlx-lm's
QuantizedKVCache byte for byte and fits a longer context in the same memory; every stage builds it;
greedy tokens of one node (HTTP, the ``openai`` client) and of two stages equal mlx-lm's own on the
whole model with the same cache; a chat's second turn through the prompt cache answers as without it.
"""

from __future__ import annotations

import json
import urllib.request

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load_model
from openai import OpenAI

from meshnode.config import ConfigError, load_settings
from meshnode.control.messages import plan_from_pb, plan_to_pb
from meshnode.model.build import build_model
from meshnode.model.shard import Shard
from meshnode.planner import NodeSpec, Plan
from meshnode.planner import plan as make_plan
from meshnode.planner.context import plan_longest_context
from meshnode.serving.batching import batchable
from meshnode.serving.generation import PipelineModel, SamplingParams, generate_tokens
from meshnode.serving.local_stage import LocalStage
from meshnode.weights.kvquant import KV_GROUP_SIZE, kv_quant_problem, quantized_kv_bytes
from meshnode.weights.profile import ModelProfile, profile_model
from tests.helpers import prompt_cache_reuse, running_node, tensor_group

MAX_TOKENS = 16
PROMPT = [3, 17, 42, 99, 7, 250, 31, 64, 128, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 77, 78, 79]


# --------------------------------------------------------------------------- what it costs (pure)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_the_bytes_counted_are_the_bytes_quantized_kv_cache_holds(bits, dtype):
    kv_heads, head_dim, tokens = 2, 128, 512  # a multiple of the cache's step: no spare room
    cache = QuantizedKVCache(group_size=KV_GROUP_SIZE, bits=bits)
    x = mx.random.normal((1, kv_heads, tokens, head_dim)).astype(dtype)
    cache.update_and_fetch(x, x)
    item = dtype.size
    plain = 2 * kv_heads * head_dim * item  # keys and values, per token
    assert cache.nbytes == quantized_kv_bytes(plain, item, bits) * tokens
    assert quantized_kv_bytes(plain, item, 0) == plain


def _profile(**kw) -> ModelProfile:
    n = kw.pop("num_layers", 8)
    base = dict(
        name="m",
        model_type="llama",
        num_layers=n,
        layer_bytes=(10 * 2**20,) * n,
        embed_bytes=20 * 2**20,
        head_bytes=20 * 2**20,
        norm_bytes=4096,
        tied_embeddings=False,
        kv_bytes_per_token=(2 * 8 * 128 * 2,) * n,
        sliding_window=(None,) * n,
        hidden_size=2048,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=8192,
        num_experts=0,
        vocab_size=32000,
        dtype="bfloat16",
        trained_context=131072,
    )
    base.update(kw)
    return ModelProfile(**base)


def test_the_plan_counts_the_quantized_kv_and_fits_a_longer_context():
    profile = _profile()
    nodes = [NodeSpec("a", 420 * 2**20)]  # 120 MiB of weights; KV per token: 64 KiB, 8 bits 34, 4 bits 18

    def longest(bits):
        return plan_longest_context(
            lambda ctx: make_plan(profile, nodes, max_context=ctx, requests=2, kv_bits=bits), profile.trained_context, 0
        )

    plain, four, eight = longest(0), longest(4), longest(8)
    assert plain.kv_bits == 0 and four.kv_bits == 4 and eight.kv_bits == 8
    assert (plain.max_context, eight.max_context, four.max_context) == (4096, 8192, 16384)
    assert "KV cache quantized to 4 bits" in four.reason and "4-bit KV cache" in four.reason
    assert "quantized" not in plain.reason
    assert "4096 tokens of context for each" in plain.reason
    assert "16384 tokens of context in a 4-bit KV" in four.reason
    # Per token and layer: 4096 bytes plain, 2048 elements; at 4 bits 1024 bytes of data plus
    # 32 groups x (a scale and a bias) x 2 bytes = 1152.
    q = profile.for_requests(2).for_kv_bits(4)
    assert q.kv_bytes(0, 1000) == 1152 * 1000 * 2
    assert q.total_bytes(1000) == profile.for_requests(2).total_bytes(1000) - 8 * (4096 - 1152) * 1000 * 2


def test_only_growing_caches_are_quantized():
    window = (None, 512, 0, None)  # a full layer, a sliding one; kv 0 below: a recurrent layer
    p = _profile(num_layers=4, sliding_window=(None, 512, None, None), kv_bytes_per_token=(4096, 4096, 0, 4096))
    q = p.for_kv_bits(4)
    assert [q.kv_token_bytes(i) for i in range(4)] == [1152, 4096, 0, 1152], window
    assert q.kv_bytes(1, 10_000) == p.kv_bytes(1, 10_000) == 4096 * 512


def test_a_model_that_cannot_quantize_its_kv_is_planned_unquantized_and_says_why():
    config = {"model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64, "head_dim": 64}
    problem = kv_quant_problem(config)
    assert "sinks" in problem
    assert "head dimension" in kv_quant_problem({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
    assert kv_quant_problem({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32}) == ""
    profile = _profile(model_type="gpt_oss", kv_quant_problem=problem)
    result = make_plan(profile, [NodeSpec("a", 2**30)], max_context=4096, kv_bits=4)
    assert result.kv_bits == 0 and f"KV cache not quantized: {problem}" in result.reason


def test_tensor_groups_are_planned_with_a_quantized_kv():
    profile = _profile()
    nodes = [NodeSpec("a", 2**30), NodeSpec("b", 2**30)]
    result = make_plan(profile, nodes, max_context=4096, strategy="tensor", kv_bits=4)
    assert result.strategy == "tensor" and result.kv_bits == 4 and "4 bits" in result.reason


def test_the_plan_carries_kv_bits_to_every_node():
    result = make_plan(_profile(), [NodeSpec("a", 2**30)], max_context=4096, kv_bits=8)
    assert plan_from_pb(plan_to_pb(result, "a"), 8).kv_bits == 8
    assert Plan.from_dict(json.loads(json.dumps(result.to_dict()))).kv_bits == 8
    bad = plan_to_pb(result, "a")
    bad.kv_bits = 3
    with pytest.raises(ValueError, match="kv_bits"):
        plan_from_pb(bad, 8)
    again = ModelProfile.from_dict(json.loads(json.dumps(_profile(kv_quant_problem="x").to_dict())))
    assert again.kv_quant_problem == "x" and again.kv_bits == 0


def test_the_setting():
    assert load_settings(None, env={}, flags={}).kv_bits == 0
    assert load_settings(None, env={"MESHNODE_KV_BITS": "4"}, flags={}).kv_bits == 4
    assert load_settings(None, env={}, flags={"kv_bits": "8"}).kv_bits == 8
    for bad in ("3", "16", "-4", "four"):
        with pytest.raises(ConfigError, match="KV_BITS"):
            load_settings(None, env={"MESHNODE_KV_BITS": bad}, flags={})


def test_meshnode_plan_and_run_take_kv_bits(tmp_path, capsys):
    from meshnode import cli

    path = build_model(tmp_path / "llama", "llama", num_layers=4, hidden_size=128, num_heads=2, num_kv_heads=1)
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('[[node]]\nid = "a"\nmemory = "1GiB"\n[[node]]\nid = "b"\nmemory = "1GiB"\n')
    assert cli.main(["plan", "--model", str(path), "--cluster", str(cluster), "--kv-bits", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bits"] == 4 and data["strategy"] in ("single", "pipeline") and "4-bit KV" in data["reason"]
    args = cli.build_parser().parse_args(["run", "--kv-bits", "8"])
    assert cli.settings_from_args(args, env={}).kv_bits == 8


# --------------------------------------------------------------------------- real models


@pytest.fixture(
    scope="module",
    params=[
        ("llama", "4bit", "bfloat16"),
        ("qwen3", None, "bfloat16"),
        ("qwen3", "4bit", "bfloat16"),
        ("llama", None, "bfloat16"),
    ],
    ids=lambda p: "-".join(str(x) for x in p if x),
)
def model(request, tmp_path_factory):
    family, quantize, dtype = request.param
    # head_dim 64: a multiple of the KV quantization group.
    return build_model(
        tmp_path_factory.mktemp("kvq") / f"{family}-{quantize or dtype}",
        family,
        num_layers=4,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=256,
        dtype=dtype,
        quantize=quantize,
    )


def quantized_cache(model, bits: int) -> list:
    """mlx-lm's caches for ``model``, every plain KVCache a QuantizedKVCache from the start."""
    return [
        QuantizedKVCache(group_size=KV_GROUP_SIZE, bits=bits) if type(c) is KVCache else c
        for c in make_prompt_cache(model)
    ]


def reference(path, prompt, bits: int, step: int = 512, max_tokens: int = MAX_TOKENS) -> list[int]:
    """mlx-lm's greedy tokens on the whole model with a quantized KV cache (0: a plain one)."""
    m, _ = load_model(path)
    cache = quantized_cache(m, bits) if bits else None
    return [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt), m, max_tokens=max_tokens, prefill_step_size=step, prompt_cache=cache
        )
    ]


def as_text(tok, tokens: list[int]) -> str:
    """What mlx_lm.generate (and the node) make of ``tokens``: up to an end-of-sequence token, through
    the tokenizer's streaming detokenizer."""
    detok = tok.detokenizer
    detok.reset()
    for t in tokens:
        if t in tok.eos_token_ids:
            break
        detok.add_token(t)
    detok.finalize()
    return detok.text


@pytest.mark.slow
def test_prefill_chunks_do_not_change_mlx_lms_tokens(model):
    """A key is quantized on its own (groups run along its head dimension), so where a prefill's
    chunks end does not change what the cache holds: any chunking is the reference."""
    tokens = reference(model, PROMPT, 4)
    assert reference(model, PROMPT, 4, step=8) == tokens
    assert reference(model, PROMPT, 4, step=3) == tokens
    # and the quantized cache does change the tokens, so equal tokens below say the stages quantized alike
    assert reference(model, PROMPT, 4, max_tokens=32) != reference(model, PROMPT, 0, max_tokens=32)


@pytest.mark.parametrize("bits", [4, 8])
def test_two_stages_match_mlx_lm_with_the_same_quantized_cache(model, bits):
    shards = [Shard(model, 0, 2), Shard(model, 2, 4)]
    for shard in shards:
        shard.kv_bits = bits
    stages = [LocalStage(s) for s in shards]
    out = list(
        generate_tokens(PipelineModel(stages, "t"), PROMPT, SamplingParams(max_tokens=MAX_TOKENS), prefill_step_size=8)
    )
    assert out == reference(model, PROMPT, bits)
    for shard in shards:  # the owned layers' caches are quantized, and so are the aliases mlx-lm reads masks from
        cache = shard.make_cache()
        assert all(isinstance(c, QuantizedKVCache) and c.bits == bits for c in cache)
    assert profile_model(model).kv_quant_problem == ""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_tensor_group_matches_mlx_lm_with_the_same_quantized_cache(tmp_path, bits):
    """Two worker processes share every layer (float32: the split changes rounding); each rank
    quantizes its share of the heads in groups along head_dim, as mlx-lm's cache does the whole.
    Its prompt cache cuts such caches back and resumes from them too."""
    path = build_model(
        tmp_path / "llama",
        "llama",
        num_layers=4,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=256,
        dtype="float32",
    )
    members = tensor_group(path, 0, 4, num_layers=4, kv_bits=bits)

    def greedy(lead, cache, x):
        out = []
        for _ in range(MAX_TOKENS):
            token = int(mx.argmax(lead.forward(mx.array([x]), cache)[:, -1, :], axis=-1).item())
            out.append(token)
            x = [token]
        return out

    try:
        lead = members[0]
        cache = lead.make_cache()
        out = greedy(lead, cache, PROMPT)
        kept, why = cache.keep_as_prefix(len(PROMPT) + MAX_TOKENS - 1)
        assert why == ""
        resumed, why = kept.resume(len(PROMPT) - 1)  # cut back into the prompt: its last token again
        assert why == "" and greedy(lead, resumed, PROMPT[-1:]) == out
    finally:
        for m in members:
            m.close()
    assert out == reference(path, PROMPT, bits)
    if bits == 4:  # the test can tell: a plain cache gives other tokens on this model
        assert out != reference(path, PROMPT, 0)


@pytest.mark.slow
def test_one_node_over_http_matches_mlx_lm_and_is_not_batched(model, tmp_path):
    _, tok = load(str(model))
    messages = [{"role": "user", "content": "Tell me about rivers, tides and the sea, and why it is salty."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    with running_node(model, tmp_path, max_context=1024, kv_bits=4) as (node, base):
        served = node.models[model.name]
        assert served.plan.kv_bits == 4 and "KV cache quantized to 4 bits" in served.plan.reason
        shard = next(iter(served.shards.values()))
        assert shard.kv_quant_bits == 4 and not batchable([LocalStage(shard)])
        c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        text = (
            c.chat.completions.create(model=model.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
            .choices[0]
            .message.content
        )
        assert not any(type(p._source).__name__ == "BatchedSource" for p in served._placements.values())
    assert text == as_text(tok, reference(model, prompt, 4))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_turn_through_the_prompt_cache_answers_as_without_it(tmp_path):
    model = build_model(
        tmp_path / "qwen3",
        "qwen3",
        num_layers=4,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=256,
        dtype="bfloat16",
    )
    _, tok = load(str(model))
    turns = [
        "Tell me about rivers, tides and the sea, and why the water is salty. " * 3,
        "And now about mountains, glaciers and why the snow stays on top. " * 2,
    ]
    answers = []
    with running_node(model, tmp_path / "cached", max_context=1024, kv_bits=8) as (node, base):
        c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            answers.append(
                c.chat.completions.create(model=model.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
                .choices[0]
                .message.content
            )
            messages.append({"role": "assistant", "content": answers[-1]})
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            hits, reused = prompt_cache_reuse(r.read().decode())
    assert hits == 1 and reused > 50, (hits, reused)  # the second turn resumed the first's KV
    with running_node(model, tmp_path / "uncached", max_context=1024, kv_bits=8, prompt_cache=False) as (_, base):
        c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        again = (
            c.chat.completions.create(model=model.name, messages=messages[:3], max_tokens=MAX_TOKENS, temperature=0)
            .choices[0]
            .message.content
        )
    assert answers[1] == again
    second = tok.apply_chat_template(messages[:3], add_generation_prompt=True)
    assert again == as_text(tok, reference(model, second, 8))


def test_sliding_window_layers_keep_their_rotating_cache(tmp_path):
    """Gemma 3: every third layer global (quantized), the others a 16-token window (as they were); two
    stages still give mlx-lm's tokens with the same caches (the prompt is longer than the window)."""
    path = build_model(
        tmp_path / "gemma3",
        "gemma3",
        num_layers=4,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=256,
        dtype="bfloat16",
    )
    shards = [Shard(path, 0, 3), Shard(path, 3, 4)]
    for shard in shards:
        shard.kv_bits = 4
    kinds = [type(c) for c in shards[0].make_cache()]
    assert kinds == [RotatingKVCache, RotatingKVCache, QuantizedKVCache, RotatingKVCache]
    out = list(
        generate_tokens(
            PipelineModel([LocalStage(s) for s in shards], "t"),
            PROMPT,
            SamplingParams(max_tokens=MAX_TOKENS),
            prefill_step_size=8,
        )
    )
    assert out == reference(path, PROMPT, 4, step=8)
    profile = profile_model(path).for_kv_bits(4)
    assert [profile.kv_token_bytes(i) < profile.kv_bytes_per_token[i] for i in range(4)] == [False, False, True, False]
