"""The models people run, split as pipelines: every family build_model builds, in float32, quantized
(4-bit, 8-bit, mixed, mxfp4) and in bfloat16, splits into stages whose chained greedy tokens are
exactly mlx-lm's on the whole model; a model that cannot be split says why."""

from __future__ import annotations

import json
import threading

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from meshnode.model.build import FAMILIES, SPLIT_FAMILIES, build_model
from meshnode.model.shard import Shard, split_boundaries, split_support
from meshnode.serving.generation import PipelineModel, SamplingParams, generate_tokens
from meshnode.serving.local_stage import LocalStage

LAYERS = 4
TOKENS = 10
# 20 positions: past every tiny sliding window and attention chunk (8), prefilled in steps of 8.
PROMPT = [3, 17, 42, 99, 7, 250, 31, 64, 128, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
NEW_FAMILIES = [f for f in SPLIT_FAMILIES if f not in FAMILIES]  # beyond the nine of tests/test_shard.py


class Models:
    """Each model built once per module, on first use."""

    def __init__(self, root):
        self.root, self.paths = root, {}

    def __call__(self, family, **kwargs):
        key = (family, *sorted(kwargs.items()))
        if key not in self.paths:
            name = "-".join([family] + [f"{k}={v}" for k, v in sorted(kwargs.items())])
            kwargs.setdefault("num_layers", LAYERS)
            self.paths[key] = build_model(self.root / name, family, **kwargs)
        return self.paths[key]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return Models(tmp_path_factory.mktemp("families"))


def reference(path, prompt=PROMPT, max_tokens=TOKENS):
    model, _ = load_model(path)
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=8)]


def pipeline(path, cuts, prompt=PROMPT, max_tokens=TOKENS):
    stages = [LocalStage(Shard(path, a, b)) for a, b in cuts]
    return list(
        generate_tokens(PipelineModel(stages, "t"), prompt, SamplingParams(max_tokens=max_tokens), prefill_step_size=8)
    )


def on_thread(fn, errors: list) -> None:
    """Run ``fn`` on a thread of its own (as a node's data connection does) and wait; what it raises
    goes into ``errors``."""

    def guarded():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    t = threading.Thread(target=guarded)
    t.start()
    t.join()


def two_stages(path):
    config = json.loads((path / "config.json").read_text())
    bounds = split_boundaries(config)
    cut = min(bounds, key=lambda i: abs(i - LAYERS // 2))
    return [(0, cut), (cut, LAYERS)]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_two_stages_match_mlx_lm(models, family):
    path = models(family)
    config = json.loads((path / "config.json").read_text())
    assert split_support(config) is None
    want = reference(path)
    assert len(set(want)) >= 4, want  # a varied random model, not one token forever
    assert pipeline(path, two_stages(path)) == want


# MLA, shared experts, hybrid linear attention, chunked / rotating caches, attention sinks, layers
# returning tuples, nested text configs, layer flags read off sub-modules: also as three stages.
@pytest.mark.parametrize(
    "family",
    ["deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_next", "llama4", "gemma4_text", "exaone4", "minimax", "cohere2"],
)
def test_three_stages_match_mlx_lm(models, family):
    path = models(family)
    assert pipeline(path, [(0, 1), (1, 3), (3, LAYERS)]) == reference(path)


def test_cross_layer_attention_splits_only_between_groups(models):
    path = models("hunyuan")  # use_cla, cla_share_factor 2: layer 1 reuses layer 0's keys and values
    config = json.loads((path / "config.json").read_text())
    assert config["use_cla"] and split_support(config) is None and split_boundaries(config) == [2]
    with pytest.raises(ValueError, match="hunyuan: a stage cannot start or end at layer 1"):
        Shard(path, 1, LAYERS)
    assert pipeline(path, [(0, 2), (2, LAYERS)]) == reference(path)


QUANTIZED = [(q, f) for q in ("4bit", "8bit") for f in ("llama", "qwen3_moe", "glm4_moe", "deepseek_v3")] + [
    ("mixed", "qwen3"),
    ("mxfp4", "gpt_oss"),
]


@pytest.mark.parametrize("quantize,family", QUANTIZED)
def test_quantized_models_split(models, quantize, family):
    path = models(family, quantize=quantize)
    config = json.loads((path / "config.json").read_text())
    q = config["quantization"]
    assert config["quantization_config"] == q  # both, as mlx-lm writes them
    expected = {"4bit": (4, "affine"), "8bit": (8, "affine"), "mixed": (4, "affine"), "mxfp4": (4, "mxfp4")}
    assert (q["bits"], q["mode"]) == expected[quantize] and q["group_size"] == 32
    if quantize == "mixed":  # mixed_4_6: some layers' down / v projections get 6 bits, the rest 4
        per_layer = {k: v["bits"] for k, v in q.items() if isinstance(v, dict)}
        assert per_layer["model.layers.3.mlp.down_proj"] == 6 and per_layer["model.layers.1.mlp.down_proj"] == 4
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.endswith(".scales") for k in names)
    want = reference(path)
    assert len(set(want)) >= 3, want
    assert pipeline(path, two_stages(path)) == want


DENSE_BF16 = ["llama", "qwen3", "gemma3", "olmo2", "glm4", "exaone4"]


@pytest.mark.parametrize("family", DENSE_BF16)
def test_bfloat16_dense_models_split(models, family):
    path = models(family, dtype="bfloat16")
    assert pipeline(path, two_stages(path)) == reference(path)


def test_float16_splits(models):
    path = models("qwen3", dtype="float16")
    assert pipeline(path, two_stages(path)) == reference(path)


def test_quantized_moe_in_bfloat16_splits(models):
    path = models("qwen3_moe", dtype="bfloat16", quantize="4bit")  # gather_qmm runs in bfloat16 on the CPU
    assert pipeline(path, two_stages(path)) == reference(path)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bfloat16_moe(models, family):
    path = models(family, dtype="bfloat16")
    try:
        want = reference(path, max_tokens=3)
    except RuntimeError as exc:  # plain mlx-lm fails too: nothing to compare a split with
        if "GatherMM" in str(exc) and mx.default_device() == mx.cpu:
            pytest.skip(f"MLX on the CPU cannot run a bfloat16 MoE layer, even unsplit: {exc}")
        raise
    assert pipeline(path, two_stages(path), max_tokens=3) == want


def test_unsplittable_family_says_why_and_runs_whole(models):
    path = models("gemma4_text", num_kv_shared_layers=2)  # layers 2, 3 reuse the keys of layers 0, 1
    config = json.loads((path / "config.json").read_text())
    reason = split_support(config)
    assert reason and "gemma4_text" in reason and "num_kv_shared_layers" in reason
    with pytest.raises(ValueError, match="gemma4_text.*num_kv_shared_layers"):
        Shard(path, 0, 2)
    assert pipeline(path, [(0, LAYERS)]) == reference(path)  # one node serves it whole


def test_split_support_is_pure_on_configs():
    assert split_support({"model_type": "llama", "num_hidden_layers": 8}) is None
    reason = split_support(
        {"model_type": "gemma4", "text_config": {"num_hidden_layers": 8, "hidden_size_per_layer_input": 256}}
    )
    assert reason.startswith("gemma4:") and "hidden_size_per_layer_input" in reason
    assert "at least two layers" in split_support({"model_type": "llama", "num_hidden_layers": 1})
    assert split_boundaries({"num_hidden_layers": 4}) == [1, 2, 3]
    assert split_boundaries({"num_hidden_layers": 6, "use_cla": True, "cla_share_factor": 3}) == [3]


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next"])
def test_step_built_ahead_in_one_thread_evaluates_in_another(models, family):
    """A node builds the next step ahead on its MLX thread and evaluates it on the data connection's
    thread; MLX streams are per thread, so that graph must be on a stream any thread may use."""
    path = models(family)
    head, tail = Shard(path, 0, 2), Shard(path, 2, LAYERS)
    hc, tc, plain = head.make_cache(), tail.make_cache(), tail.make_cache()
    hidden = head.forward(mx.array([PROMPT]), hc)
    mx.eval(hidden)
    mx.eval(tail.forward(hidden, tc), tail.forward(hidden, plain))
    step = head.forward(mx.array([[PROMPT[0]]]), hc)
    mx.eval(step)
    built, errors = {}, []
    on_thread(lambda: built.update(zip(("placeholder", "out"), tail.build_ahead(tc))), errors)
    on_thread(lambda: (built["placeholder"].fill_from(step), mx.eval(built["out"])), errors)
    assert not errors, errors
    assert mx.array_equal(built["out"], tail.forward(step, plain)).item()


@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_a_shard_loaded_on_one_thread_runs_on_another(models, family):
    """A node loads a stage on its MLX thread and a data connection's thread runs it. Arrays a family
    keeps outside its parameters (hunyuan's rope frequencies) must not stay lazy graphs on the loading
    thread's stream: the first request would fail with 'There is no Stream(cpu, 0) in current thread'."""
    path = models(family)
    loaded: dict = {}
    errors: list = []
    cut = two_stages(path)[0][1]
    on_thread(lambda: loaded.update(head=Shard(path, 0, cut), tail=Shard(path, cut, LAYERS)), errors)
    assert not errors, errors

    def run():
        hidden = loaded["head"].forward(mx.array([PROMPT]), loaded["head"].make_cache())
        loaded["out"] = loaded["tail"].forward(hidden, loaded["tail"].make_cache())
        mx.eval(loaded["out"])

    on_thread(run, errors)
    assert not errors, errors
    whole, _ = load_model(path)
    assert mx.array_equal(loaded["out"], whole(mx.array([PROMPT]))).item()


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "phi"])
def test_other_layouts_run_whole_and_say_why_they_do_not_split(models, family):
    """Families without embed_tokens / layers / norm: a whole-model shard is mlx-lm's model; a
    stage of one is refused with the reason the planner also reads (it then serves them whole)."""
    path = models(family)
    config = json.loads((path / "config.json").read_text())
    reason = split_support(config)
    assert reason and family in reason and "not laid out" in reason
    assert pipeline(path, [(0, LAYERS)]) == reference(path)
    with pytest.raises(ValueError, match="not laid out|unsupported model layout"):
        Shard(path, 0, 2)
