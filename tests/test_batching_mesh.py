"""Continuous batching across stages on real nodes (namespace hosts): concurrent chats on a 2-stage
mesh decode together through both stages (the head's /metrics counts the batched steps and their
rows) and each answers exactly as mlx_lm.generate alone; dense and MoE, float32 and 4-bit, asked
through the openai package, streamed and not."""

from __future__ import annotations

import json
import re

import pytest

from harness.cluster import HTTP, Cluster, in_ns, mlx_reference
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model
from tests.helpers import CONCURRENT_CHATS, node_metrics

pytestmark = [pytest.mark.netns, pytest.mark.timeout(400)]

# Long enough that the first answers still decode when the last join: a prompt waits behind
# decoders up to meshnode.model.scheduler.AGE_S at each stage, and with two stages the batched
# requests are dealt into two groups, so a round carries two rows only where three decode at once.
MAX_TOKENS = 128
PROMPTS = [
    "Tell me about the sea.",
    "Why is the sky blue?",
    "Write a poem about autumn leaves.",
    "How do rivers reach the ocean?",
]


def _counter(metrics: str, name: str) -> float:
    found = re.search(rf"^{name}_total (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


# Seeds whose random weights answer every prompt to MAX_TOKENS (mlx-lm, greedy): answers that end
# early (end of sequence) can leave fewer than three decoding at a time, so that no round carries two
# rows, or none is batched at all.
@pytest.mark.parametrize(
    "family,quantize,seed",
    [("llama", None, 6), ("qwen3_moe", None, 5), ("llama", "4bit", 5)],
    ids=["llama", "qwen3_moe", "llama-4bit"],
)
def test_concurrent_chats_on_two_stages_decode_together_and_answer_as_mlx_lm(family, quantize, seed, tmp_path):
    model = build_model(
        tmp_path / family,
        family,
        num_layers=6,
        hidden_size=64,
        intermediate_size=128,
        dtype="float32",
        quantize=quantize,
        seed=seed,
    )
    references = [mlx_reference(model, [{"role": "user", "content": p}], MAX_TOKENS) for p in PROMPTS]
    total = profile_model(model).total_bytes(1024)
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=1024)
        for h in cluster.hosts:  # neither holds it alone: two stages
            cluster.start(h, int(total * 0.6), env={"MESHNODE_STRATEGY": "pipeline", "MESHNODE_LOCKSTEP": "true"})
        view = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 90, "convergence")[0]
        assert len(view["plan"]["stages"]) == 2, view["plan"]
        head = cluster.host(view["plan"]["stages"][-1]["nodes"][0])
        answers = in_ns(
            cluster.client,
            CONCURRENT_CHATS,
            f"http://{head.ip}:{HTTP}",
            json.dumps([[model.name, p] for p in PROMPTS]),
            MAX_TOKENS,
            timeout=300,
        )["answers"]
        assert answers == references, cluster.logs()
        metrics = node_metrics(cluster, head)
        steps = _counter(metrics, "meshnode_lockstep_rounds")
        rows = _counter(metrics, "meshnode_lockstep_rows")
        print(f"batched decode steps {steps:.0f}, rows {rows:.0f}")
        assert steps > 0 and rows > steps, (steps, rows)  # steps that carried several requests
        # Alone again: one chat steps on its own (no batch), and still answers the same.
        assert cluster.chat(head, [{"role": "user", "content": PROMPTS[0]}], MAX_TOKENS) == references[0]
        assert _counter(node_metrics(cluster, head), "meshnode_lockstep_rounds") == steps
