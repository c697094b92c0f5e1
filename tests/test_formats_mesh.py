"""The models people run, on real nodes: each family and weight format as a 2-stage pipeline of two
`meshnode run` processes on network-namespace hosts, answering exactly as mlx_lm.generate does on
the whole model (greedy). Random tiny models built locally (meshnode.model.build), quantized with
mlx-lm's own quantization. Every node times its own layers at start-up (the layer timing runs on
each format too). Also: a family that cannot be split is served whole by one node, and refused
with its reason (no restart loop) where no single node holds it.
"""

from __future__ import annotations

import pytest

from harness.cluster import Cluster, mlx_reference
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model

pytestmark = [pytest.mark.netns, pytest.mark.timeout(900)]

MESSAGES = [{"role": "user", "content": "Where do rivers go?"}]
MAX_TOKENS = 12
CTX = 256

# float32: every family whose tiny build splits in-process (tests/test_families.py) also splits
# between real nodes.
FLOAT32 = (
    "llama",
    "qwen3",
    "qwen3_moe",
    "gemma3",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "qwen3_next",
    "minimax",
    "llama4",
    "hunyuan",
)
# (family, quantize, dtype): affine 4 and 8 bits for a dense, an MoE and an MLA family, mixed
# precision, gpt-oss's mxfp4; bf16 for dense families.
FORMATS = (
    ("llama", "4bit", "bfloat16"),
    ("llama", "8bit", "bfloat16"),
    ("qwen3_moe", "4bit", "bfloat16"),
    ("qwen3_moe", "8bit", "bfloat16"),
    ("deepseek_v3", "4bit", "bfloat16"),
    ("deepseek_v3", "8bit", "bfloat16"),
    ("qwen3", "mixed", "bfloat16"),
    ("gpt_oss", "mxfp4", "bfloat16"),
    ("llama", None, "bfloat16"),
    ("qwen3", None, "bfloat16"),
    ("gemma3", None, "bfloat16"),
    ("llama", None, "float16"),
)
# MLX's CPU build has no bf16 / fp16 gather_mm: an MoE layer in bf16 fails even in plain mlx-lm
# ("[GatherMM::eval] Currently only supports float32"); quantized MoE (gather_qmm) runs.
CPU_CANNOT = {("qwen3_moe", None, "bfloat16"): "MLX's CPU build runs MoE layers (gather_mm) in float32 only"}


@pytest.fixture(scope="module")
def mesh():
    with netns_mesh(2) as m:
        yield m


@pytest.fixture(scope="module")
def cluster(mesh, tmp_path_factory):
    return Cluster(mesh, None, tmp_path_factory.mktemp("formats"), max_context=CTX)


def _build(root, family, quantize=None, dtype="float32", **kw):
    name = f"{family}-{quantize or dtype}"
    return build_model(
        root / name, family, num_layers=4, hidden_size=64, intermediate_size=128, dtype=dtype, quantize=quantize, **kw
    )


def _serve(cluster, model, tmp, fractions, env=None):
    """Start one node per host on ``model`` with budgets of ``fractions`` x what it needs; returns when
    every node has joined and the mesh is healthy, with the plan."""
    tmp.mkdir(parents=True, exist_ok=True)
    cluster.model, cluster.tmp = model, tmp
    total = profile_model(model).total_bytes(CTX)
    for h, f in zip(cluster.hosts, fractions):
        cluster.start(h, int(total * f), env={"MESHNODE_STRATEGY": "pipeline", **(env or {})})
    return cluster.wait(lambda: cluster.converged(cluster.hosts, len(cluster.hosts)), 120, "convergence")[0]["plan"]


def _stop(cluster):
    for proc in cluster.procs.values():
        cluster.mesh.stop(proc)
    cluster.procs.clear()


def _two_stages_answer_like_mlx_lm(cluster, model, tmp):
    want = mlx_reference(model, MESSAGES, MAX_TOKENS)
    try:
        plan = _serve(cluster, model, tmp, (0.6, 0.6))
        assert plan["strategy"] == "pipeline" and len(plan["stages"]) == 2, plan
        for h in cluster.hosts:  # through the first stage's node and through the last's
            assert cluster.chat(h, MESSAGES, MAX_TOKENS) == want, (h.name, cluster.logs())
        for h in cluster.hosts:
            assert "Traceback" not in cluster.log(h), cluster.log(h)
    finally:
        _stop(cluster)


# hunyuan shares KV across pairs of layers by default in these builds (cross-layer attention): the
# planner serves that whole (see the last test); without it, hunyuan splits like the others.
OVERRIDES = {"hunyuan": {"use_cla": False}}


@pytest.mark.parametrize("family", FLOAT32)
def test_float32_family_splits_between_nodes(cluster, family, tmp_path):
    _two_stages_answer_like_mlx_lm(cluster, _build(tmp_path, family, **OVERRIDES.get(family, {})), tmp_path)


@pytest.mark.parametrize("family,quantize,dtype", FORMATS, ids=lambda v: str(v))
def test_weight_format_splits_between_nodes(cluster, family, quantize, dtype, tmp_path):
    _two_stages_answer_like_mlx_lm(cluster, _build(tmp_path, family, quantize, dtype), tmp_path)


@pytest.mark.parametrize("cell", sorted(CPU_CANNOT), ids=lambda v: str(v))
def test_formats_this_cpu_build_cannot_run(cell, tmp_path):
    """Says which cell cannot run here and proves why: plain mlx-lm fails on it the same way."""
    family, quantize, dtype = cell
    model = _build(tmp_path, family, quantize, dtype)
    with pytest.raises(RuntimeError, match="GatherMM"):
        mlx_reference(model, MESSAGES, 2)
    pytest.skip(f"{family} {dtype}: {CPU_CANNOT[cell]}")


def test_a_family_that_cannot_split_is_served_whole_or_refused_clearly(cluster, tmp_path):
    """gemma4_text with KV-shared layers: a later stage would lack the keys and values it reuses."""
    model = _build(tmp_path, "gemma4_text", num_kv_shared_layers=2)
    reason = profile_model(model).split_problem
    assert "num_kv_shared_layers" in reason
    want = mlx_reference(model, MESSAGES, MAX_TOKENS)
    try:  # one node holds it: served whole, by that node, for requests to either
        plan = _serve(cluster, model, tmp_path / "whole", (0.6, 1.5), env={"MESHNODE_STRATEGY": "auto"})
        assert plan["strategy"] == "single" and plan["stages"][0]["nodes"] == [cluster.hosts[1].name], plan
        for h in cluster.hosts:
            assert cluster.chat(h, MESSAGES, MAX_TOKENS) == want
    finally:
        _stop(cluster)
    try:  # no node holds it: every node stays up, says why, and refuses requests with a 503
        cluster.model, cluster.tmp = model, tmp_path / "none"
        cluster.tmp.mkdir()
        total = profile_model(model).total_bytes(CTX)
        for h in cluster.hosts:
            cluster.start(h, int(total * 0.6))
        h = cluster.hosts[0]  # the coordinator (either host) logs why it has no plan
        cluster.wait(lambda: any(reason in cluster.log(x) for x in cluster.hosts), 60, "the planner's reason in a log")
        status, _, body = cluster.fetch(
            f"http://{h.ip}:8470/v1/chat/completions", {"model": model.name, "messages": MESSAGES, "max_tokens": 4}
        )
        assert status == 503, body
        assert all(p.poll() is None for p in cluster.procs.values()), "a node exited"
    finally:
        _stop(cluster)
