"""Shards [0,a) [a,b) [b,L) chained give exactly mlx_lm's greedy tokens, for every family."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from meshnode.model.build import FAMILIES, build_model
from meshnode.model.shard import Shard
from meshnode.serving.generation import PipelineModel, SamplingParams, generate_tokens
from meshnode.serving.local_stage import LocalStage

LAYERS = 6
PROMPT = [
    3,
    17,
    42,
    99,
    7,
    250,
    31,
    64,
    128,
    5,
    6,
    7,
    8,
    9,
    10,
    11,
    12,
    13,
    14,
    15,
    16,
    17,
    18,
    19,
    20,
    21,
    22,
    23,
    24,
    25,
    26,
    27,
    28,
    29,
    30,
    31,
    32,
    33,
    34,
    35,
]  # longer than gemma's sliding window


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {f: build_model(root / f, f, num_layers=LAYERS, dtype="float32", max_file_size_mb=1) for f in FAMILIES}


def reference(path, prompt, max_tokens, step):
    model, _ = load_model(path)
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=step)]


@pytest.mark.parametrize("family", FAMILIES)
def test_chained_logits_are_bit_identical(models, family):
    path = models[family]
    full, _ = load_model(path)
    x = mx.array([PROMPT])
    want = full(x, cache=None)
    shards = [Shard(path, a, b) for a, b in [(0, 2), (2, 4), (4, LAYERS)]]
    h = x
    for s in shards:
        h = s.forward(h, s.make_cache())
    assert h.shape == want.shape and mx.array_equal(h, want).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_chained_shards_match_mlx_lm(models, family):
    path = models[family]
    want = reference(path, PROMPT, 24, step=8)
    stages = [LocalStage(Shard(path, a, b)) for a, b in [(0, 2), (2, 4), (4, LAYERS)]]
    got = list(generate_tokens(PipelineModel(stages, "t"), PROMPT, SamplingParams(max_tokens=24), prefill_step_size=8))
    assert got == want


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe"])
def test_single_layer_stages_and_uneven_split(models, family):
    path = models[family]
    want = reference(path, PROMPT[:12], 10, step=5)
    stages = [LocalStage(Shard(path, a, b)) for a, b in [(0, 1), (1, 5), (5, 6)]]
    got = list(
        generate_tokens(PipelineModel(stages, "t"), PROMPT[:12], SamplingParams(max_tokens=10), prefill_step_size=5)
    )
    assert got == want


@pytest.mark.parametrize("family", FAMILIES)
def test_shard_holds_only_its_layers(models, family):
    path = models[family]
    full, _ = load_model(path)
    from mlx.utils import tree_flatten

    all_names = {k for k, _ in tree_flatten(full.parameters())}

    def layer_names(i):
        return {k for k in all_names if f"layers.{i}." in k}

    for start, end in [(0, 2), (2, 4), (4, LAYERS)]:
        shard = Shard(path, start, end)
        names = set(shard.parameter_names())
        owned = set().union(*(layer_names(i) for i in range(start, end)))
        assert owned <= names
        others = set().union(*(layer_names(i) for i in range(LAYERS) if not start <= i < end))
        assert not (names & others), f"[{start},{end}) holds other layers' weights"
        extra = {k for k in names - owned}
        if start > 0 and end < LAYERS:
            assert extra == set(), extra
        if start == 0:
            assert any("embed_tokens" in k for k in extra)
        if end == LAYERS:
            assert any("norm" in k for k in extra)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def test_middle_shard_reads_only_its_bytes(tmp_path):
    path = build_model(
        tmp_path / "big", "llama", num_layers=8, hidden_size=256, intermediate_size=512, max_file_size_mb=2
    )
    total = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    before = _rchar()
    shard = Shard(path, 3, 5)
    read = _rchar() - before
    assert shard.nbytes < total / 3
    # The two layers' bytes, plus headers and config: far below the whole model.
    assert read < shard.nbytes * 1.2 + 200_000, (read, shard.nbytes, total)


@pytest.mark.parametrize("family", FAMILIES)
def test_steps_built_ahead_equal_steps_built_on_their_input(models, family):
    """A stage that builds its next decode step on a placeholder before the input arrives (the data
    port's next_single; the head's local stage behind a remote one) computes exactly what it would
    have computed building the step on the input itself, step after step, for every family."""
    path = models[family]
    for a, b in [(0, 3), (3, LAYERS)]:
        shard = Shard(path, a, b)
        plain, ahead = shard.make_cache(), shard.make_cache()
        if a == 0:
            prompt, steps = mx.array([PROMPT[:12]]), [mx.array([[t]]) for t in PROMPT[12:20]]
        else:
            hidden = Shard(path, 0, a).forward(mx.array([PROMPT[:20]]), Shard(path, 0, a).make_cache())
            prompt, steps = hidden[:, :12], [hidden[:, i : i + 1] for i in range(12, 20)]
        mx.eval(prompt, *steps)
        mx.eval(shard.forward(prompt, plain), shard.forward(prompt, ahead))
        for x in steps:
            want = shard.forward(x, plain)
            placeholder, got = shard.build_ahead(ahead)
            placeholder.fill_from(x.astype(mx.int32) if a == 0 else x)
            assert mx.array_equal(got, want).item(), (family, a, b)
