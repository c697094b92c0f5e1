"""The context a plan gives its model (issue 12b): the one it was trained for, lowered only as far
as memory requires; a configured max_context still decides. Pure planning on profiles, then one
real node serving a long prompt with default settings."""

from __future__ import annotations

import openai
import pytest

from meshnode.model.build import build_model
from meshnode.planner import NodeSpec, PlanError
from meshnode.planner import plan as make_plan
from meshnode.planner.context import ENOUGH, SLOWER, contexts_to_try, plan_longest_context
from meshnode.weights.profile import ModelProfile, profile_model, trained_context
from tests.helpers import running_node


def _profile(trained: int, kv_per_token: int = 100, layers: int = 4) -> ModelProfile:
    return ModelProfile(
        name="m",
        model_type="llama",
        num_layers=layers,
        layer_bytes=(1000,) * layers,
        embed_bytes=100,
        head_bytes=100,
        norm_bytes=1,
        tied_embeddings=False,
        kv_bytes_per_token=(kv_per_token,) * layers,
        sliding_window=(None,) * layers,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_experts=0,
        vocab_size=100,
        dtype="float32",
        trained_context=trained,
    )


def test_the_trained_context_is_read_from_the_config():
    assert trained_context({"max_position_embeddings": 40960}) == 40960
    assert (
        trained_context(
            {
                "max_position_embeddings": 32768,
                "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            }
        )
        == 131072
    )
    assert trained_context({"n_positions": 1024}) == 1024 and trained_context({}) == 0


def test_contexts_longest_first_and_a_setting_decides():
    assert contexts_to_try(131072, 0) == [131072, 65536, 32768, 16384, 8192, 4096]
    assert contexts_to_try(40960, 0) == [40960, 20480, 10240, 5120, 4096]
    assert contexts_to_try(2048, 0) == [2048] and contexts_to_try(0, 0) == [4096]
    assert contexts_to_try(131072, 8192) == [8192]


def test_the_longest_context_that_fits_and_the_plan_says_so():
    p = _profile(trained=40960)  # 4 layers x 100 B/token: 400 B per token of context
    make = lambda nodes: lambda ctx: make_plan(p, nodes, max_context=ctx)  # noqa: E731
    roomy = plan_longest_context(make([NodeSpec("a", 10**8)]), p.trained_context, 0)
    assert roomy.max_context == 40960 and "as the model was trained for" in roomy.reason
    small = plan_longest_context(make([NodeSpec("a", 3_000_000)]), p.trained_context, 0)
    assert small.max_context == 5120 and "of the 40960 the model was trained for" in small.reason
    # Two nodes hold a longer context than one: the mesh's memory decides, not one node's.
    two = plan_longest_context(make([NodeSpec("a", 3_000_000), NodeSpec("b", 3_000_000)]), p.trained_context, 0)
    assert two.max_context == 10240
    with pytest.raises(PlanError):  # not even the floor fits
        plan_longest_context(make([NodeSpec("a", 100_000)]), p.trained_context, 0)
    fixed = plan_longest_context(make([NodeSpec("a", 10**8)]), p.trained_context, 8192)
    assert fixed.max_context == 8192 and "trained" not in fixed.reason


def test_one_more_node_for_more_than_enough_context_is_the_cost_models_call():
    p = _profile(trained=131072)  # 400 B per token of context: 131072 tokens need 52 MB, 65536 need 26 MB
    make = lambda nodes: lambda ctx: make_plan(p, nodes, max_context=ctx)  # noqa: E731
    two = [NodeSpec("a", 40_000_000), NodeSpec("b", 40_000_000)]
    # The whole trained context needs both nodes (a hop per token); 65536 tokens, enough for an
    # agent, fit on one: the faster plan wins and says what the longer context would have cost.
    chosen = plan_longest_context(make(two), p.trained_context, 0)
    longer = make_plan(p, two, max_context=131072)
    assert len(longer.node_ids()) == 2 and longer.estimate_s > chosen.estimate_s * SLOWER
    assert chosen.max_context == ENOUGH and chosen.node_ids() == ["a"], chosen
    assert "131072 would take 2 node(s) instead of 1" in chosen.reason, chosen.reason
    # Where the longer context costs no extra node, it is taken.
    roomy = plan_longest_context(make([NodeSpec("a", 10**8), NodeSpec("b", 40_000_000)]), p.trained_context, 0)
    assert roomy.max_context == 131072 and roomy.node_ids() == ["a"]
    # Below ENOUGH the longest context that fits always wins, one more node or not.
    small = _profile(trained=32768)
    pair = [NodeSpec("a", 8_000_000), NodeSpec("b", 8_000_000)]  # 32768 tokens (13 MB) need both
    assert plan_longest_context(lambda ctx: make_plan(small, pair, max_context=ctx), 32768, 0).max_context == 32768
    # The setting still decides.
    assert plan_longest_context(make(two), p.trained_context, 131072).max_context == 131072


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_long_context_model_serves_a_long_prompt_with_default_settings(tmp_path):
    model = build_model(
        tmp_path / "llama-40k", "llama", num_layers=2, hidden_size=64, dtype="float32", max_position_embeddings=40960
    )
    assert profile_model(model).trained_context == 40960
    long_text = "The sea was calm that morning, and the lighthouse keeper climbed the stairs. " * 360
    with running_node(model, tmp_path) as (node, base):
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=240)
        listed = c.models.list().data[0]
        assert listed.context_length == 40960  # what a client (OpenCode, Open WebUI) sizes its prompts by
        r = c.chat.completions.create(
            model=node.model_id, messages=[{"role": "user", "content": long_text}], max_tokens=8, temperature=0
        )
        assert r.usage.prompt_tokens > 12000 and r.usage.completion_tokens >= 1
        # (a max_tokens beyond the room left ends with "length": tests/test_openai_fields.py)
        assert node.models[node.model_id].plan.max_context == 40960
