"""What a plan counts in memory: KV for every request a node runs at once, real quantized bytes,
and no more than the GPU's recommended working set."""

from __future__ import annotations

import pytest

from meshnode import sysinfo
from meshnode.config import Settings
from meshnode.model.build import build_model
from meshnode.planner import NodeSpec, PlanError, plan
from meshnode.weights.profile import ModelProfile, profile_model


def _profile(layers=8, layer_bytes=1000, kv_per_token=10) -> ModelProfile:
    return ModelProfile(
        name="m",
        model_type="llama",
        num_layers=layers,
        layer_bytes=(layer_bytes,) * layers,
        embed_bytes=500,
        head_bytes=500,
        norm_bytes=10,
        tied_embeddings=False,
        kv_bytes_per_token=(kv_per_token,) * layers,
        sliding_window=(None,) * layers,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_experts=0,
        vocab_size=512,
        dtype="float32",
    )


def test_kv_counts_every_request_at_once():
    p = _profile()
    one, three = p.total_bytes(100), p.for_requests(3).total_bytes(100)
    kv = sum(p.kv_bytes(i, 100) for i in range(p.num_layers))
    assert kv == 8 * 10 * 100
    assert three - one == 2 * kv
    assert p.total_bytes(100, requests=3) == three
    with pytest.raises(ValueError):
        p.for_requests(0)


def test_a_profile_from_an_older_peer_has_one_request():
    d = _profile().to_dict()
    d.pop("kv_requests")
    assert ModelProfile.from_dict(d).kv_requests == 1
    assert ModelProfile.from_dict(_profile().for_requests(4).to_dict()).kv_requests == 4


def test_plan_holds_kv_for_concurrent_requests_and_says_so():
    p = _profile()
    budget = p.total_bytes(100) + 100  # one request's cache fits one node; two do not
    nodes = [NodeSpec("a", budget), NodeSpec("b", budget)]
    alone = plan(p, nodes, max_context=100)
    assert len(alone.stages) == 1
    both = plan(p, nodes, max_context=100, requests=2)
    assert len(both.stages) == 2
    assert "for each of 2 requests at once" in both.reason
    assert all(s.bytes <= budget for s in both.stages)
    with pytest.raises(PlanError) as err:
        plan(p, nodes[:1], max_context=100, requests=2)
    assert "for each of 2 requests at once" in str(err.value)


def test_a_node_reserves_two_requests_by_default():
    assert Settings().kv_requests == 2


def test_budget_stays_inside_the_recommended_working_set():
    assert sysinfo.capped_budget(48 << 30, 36 << 30) == 36 << 30
    assert sysinfo.capped_budget(20 << 30, 36 << 30) == 20 << 30
    assert sysinfo.capped_budget(20 << 30, None) == 20 << 30
    # MLX's CPU build reports no working set: the budget is memory_fraction x available memory.
    assert sysinfo.working_set_limit() is None
    s = Settings(memory_fraction=0.5)
    assert abs(sysinfo.memory_budget(s) - 0.5 * sysinfo.available_memory()) < 64 << 20


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_layer_bytes_are_what_mlx_lm_loads(tmp_path, bits):
    """Packed weights, scales and biases: the profile's bytes per layer are the loaded model's."""
    from mlx.utils import tree_flatten
    from mlx_lm import convert
    from mlx_lm.utils import load_model

    src = build_model(tmp_path / "src", "llama", num_layers=3, hidden_size=64, intermediate_size=128, dtype="bfloat16")
    out = tmp_path / f"q{bits}"
    convert(str(src), str(out), quantize=True, q_bits=bits, q_group_size=32)
    prof = profile_model(out)
    model, _ = load_model(out)
    params = dict(tree_flatten(model.parameters()))
    for i in range(3):
        loaded = sum(v.nbytes for k, v in params.items() if f"layers.{i}." in k)
        assert prof.layer_bytes[i] == loaded
    assert prof.hidden_size == 64 and prof.dtype == "bfloat16"
    assert sum(prof.layer_bytes) < sum(profile_model(src).layer_bytes) * (bits + 1) / 12


def test_a_model_that_cannot_be_split_is_planned_whole_or_refused_with_its_reason():
    why = "gemma4_text: its last 2 layers reuse the keys and values computed by earlier layers"
    p = _profile().__class__(**{**_profile().__dict__, "split_problem": why})
    need = p.total_bytes(100)
    whole = plan(p, [NodeSpec("a", need // 2), NodeSpec("b", need + 1)], max_context=100)
    assert whole.strategy == "single" and whole.stages[0].nodes == ("b",)
    with pytest.raises(PlanError) as err:
        plan(p, [NodeSpec("a", need // 2 + 200), NodeSpec("b", need // 2 + 200)], max_context=100)
    assert why in str(err.value) and "no single node holds" in str(err.value)
    with pytest.raises(PlanError) as err:
        plan(p, [NodeSpec("a", need + 1), NodeSpec("b", need + 1)], max_context=100, strategy="pipeline")
    assert why in str(err.value)
    # The same model that splits needs both nodes.
    assert (
        len(plan(_profile(), [NodeSpec("a", need // 2 + 200), NodeSpec("b", need // 2 + 200)], max_context=100).stages)
        == 2
    )
