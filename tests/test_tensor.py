"""Tensor-parallel groups (meshnode.model.tensor): real worker processes over mx.distributed's ring
backend on loopback. Multi-host groups inside real meshes are in test_tensor_mesh.py."""

from __future__ import annotations

import functools
import gc
import os
import signal
import time

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from harness.cluster import wait_until
from meshnode.model.build import build_model
from meshnode.model.compute import free_ports
from meshnode.model.prefixes import PrefixStore
from meshnode.model.shard import Shard
from meshnode.model.tensor import TensorGroupError, TensorShard
from meshnode.proto import mesh_pb2
from tests.helpers import tensor_group

pytestmark = pytest.mark.timeout(180)

PROMPT = [1, 5, 9, 22, 7, 3, 100, 45]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tp") / "llama", "llama", num_layers=6, hidden_size=128, dtype="float32")


def _greedy(step, n: int) -> list[int]:
    x, out = mx.array([PROMPT]), []
    for _ in range(n):
        token = int(mx.argmax(step(x)[:, -1, :], axis=-1).item())
        out.append(token)
        x = mx.array([[token]])
    return out


@pytest.mark.slow
def test_whole_model_group_matches_mlx_lm(model):
    members = tensor_group(model, 0, 6)
    try:
        lead = members[0]
        assert lead.hidden_size == 128 and lead.dtype == mx.float32 and lead.alive()
        cache = lead.make_cache()
        got = _greedy(functools.partial(lead.forward, cache=cache), 16)
        m, _ = load(str(model))
        want = [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(PROMPT), m, max_tokens=16)), range(16))]
        assert got == want
        # A second request gets its own KV cache in the worker; the first one's is freed.
        del cache
        again = lead.make_cache()
        assert _greedy(lambda x: lead.forward(x, again), 16) == want
        with pytest.raises(TensorGroupError, match="only rank 0"):
            members[1].forward(mx.array([PROMPT]), members[1].make_cache())
    finally:
        for m in members:
            m.close()


@pytest.mark.slow
def test_prompt_cache_prefixes_are_kept_and_resumed_in_the_workers(model):
    """The prompt cache on a tensor group: rank 0's node keeps a request's KV as a prefix inside the
    workers (every rank its share) and resumes a later request from a copy cut to what it shares;
    the answer equals a fresh request's, and the kept prefix is untouched by what resumes from it."""
    members = tensor_group(model, 0, 6)
    try:
        lead, layers = members[0], (0, 6)
        assert lead.keeps_prefixes and not members[1].keeps_prefixes
        store = PrefixStore(capacity=1000)
        turn1 = PROMPT + [11, 12, 13, 14]
        cache = lead.make_cache()
        lead.forward(mx.array([turn1]), cache)
        assert store.keep(layers, "k", cache, len(turn1) - 1)  # held 12: cut to 11 in the workers
        fresh = lambda tokens: lead.forward(mx.array([tokens]), lead.make_cache())  # noqa: E731

        turn2 = turn1[:9] + [40, 41, 42]  # shares 9 positions with the prefix
        resumed, why = store.resume(layers, "k", 9)
        assert why == "" and resumed is not None
        got = lead.forward(mx.array([turn2[9:]]), resumed)
        assert mx.allclose(got, fresh(turn2), atol=1e-4).item() and int(mx.argmax(got)) == int(mx.argmax(fresh(turn2)))
        whole, why = store.resume(layers, "k", 11)  # the kept prefix did not grow with turn2
        got = lead.forward(mx.array([[50]]), whole)
        assert why == "" and mx.allclose(got, fresh(turn1[:11] + [50]), atol=1e-4).item()
        assert store.resume(layers, "k", 12) == (None, "not kept here")  # more than it holds
        assert store.hits == 2 and store.reused_positions == 20
        # A slot that is gone cannot be kept; the worker says so and the group goes on serving.
        gone = lead.make_cache()
        assert lead.keep(gone, 3)[0] is None and lead.alive()
        # Forgetting the prefix frees it in the workers with the next command.
        del resumed, whole
        store.forget()
        gc.collect()
        assert any(op == mesh_pb2.WorkerCommand.FORGET for op, _ in lead._closed)
        fresh(PROMPT)  # (its own slot, dropped after, is told to the worker with the command after it)
        assert not any(op == mesh_pb2.WorkerCommand.FORGET for op, _ in lead._closed) and lead.alive()
    finally:
        for m in members:
            m.close()


@pytest.mark.slow
def test_a_member_without_the_key_is_refused(model):
    with pytest.raises(TensorGroupError):
        tensor_group(model, 0, 6, secrets=[b"k" * 32, b"x" * 32], ready_timeout_s=8)


@pytest.mark.slow
def test_an_idle_follower_does_not_spin(model):
    members = tensor_group(model, 0, 6)
    try:
        follower = members[1]._proc.pid
        ticks = lambda: sum(int(x) for x in open(f"/proc/{follower}/stat").read().rsplit(")", 1)[1].split()[11:13])  # noqa: E731
        before = ticks()
        time.sleep(2)
        assert ticks() - before < 0.25 * 2 * os.sysconf("SC_CLK_TCK")  # under a quarter of a core
    finally:
        for m in members:
            m.close()


@pytest.mark.slow
def test_middle_stage_group_matches_a_plain_shard(model):
    first = Shard(model, 0, 2)
    plain = Shard(model, 2, 5)
    members = tensor_group(model, 2, 5)
    try:
        hidden = first.forward(mx.array([PROMPT]), first.make_cache())
        mx.eval(hidden)
        want = plain.forward(hidden, plain.make_cache())
        got = members[0].forward(hidden, members[0].make_cache())
        assert got.shape == want.shape == (1, len(PROMPT), 128)
        assert mx.allclose(got, want, atol=1e-4).item()
    finally:
        for m in members:
            m.close()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_failed_member_fails_the_step_within_the_deadline(model, fault):
    members = tensor_group(model, 0, 6, hop_timeout=2.0, members_alive=None)  # the deadline alone
    lead, other = members
    pid = other._proc.pid
    try:
        cache = lead.make_cache()
        lead.forward(mx.array([PROMPT]), cache)
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorGroupError):
            lead.forward(mx.array([[7]]), cache)
        assert time.monotonic() - t0 < 6
        assert not lead.alive()
        with pytest.raises(TensorGroupError, match="down"):
            lead.forward(mx.array([[7]]), cache)
    finally:
        if fault == "freeze":
            os.kill(pid, signal.SIGCONT)
        for m in members:
            m.close()
    assert lead._proc is None and other._proc is None


@pytest.mark.slow
def test_a_member_that_leaves_an_idle_group_stops_the_leader_so_the_group_forms_again(model):
    """A member's node replaces its worker (a newer plan came while it loaded) while the leader's
    node keeps its own, with no request running: the leader must notice by itself, or the new
    worker finds nobody listening and the group never forms again."""
    members = tensor_group(model, 0, 6)
    lead, other = members
    try:
        want = _greedy(functools.partial(lead.forward, cache=lead.make_cache()), 4)
        other.close()
        wait_until(lambda: not lead.alive(), 10, "the leader's worker to stop")
        lead.close()
        again = tensor_group(model, 0, 6)
        members += again
        assert _greedy(functools.partial(again[0].forward, cache=again[0].make_cache()), 4) == want
    finally:
        for m in members:
            m.close()


@pytest.mark.slow
def test_a_group_that_cannot_form_gives_up(model):
    *ring, control = free_ports(3)
    lonely = TensorShard(
        model, 0, 6, 6, rank=0, endpoints=[f"127.0.0.1:{p}" for p in ring], control=f"127.0.0.1:{control}"
    )
    t0 = time.monotonic()
    with pytest.raises(TensorGroupError, match="no answer"):
        lonely.launch(3)
    assert time.monotonic() - t0 < 10 and not lonely.alive()


# Every family the planner forms tensor groups for (planner.TENSOR_FAMILIES), and quantized
# weights: a whole-model group of two gives mlx-lm's greedy tokens. 4-bit models are quantized from
# float32 (float32 scales, so activations stay float32: tensor parallelism changes bf16 rounding).
GROUP_CASES = [
    ("llama", "4bit"),
    ("qwen3_moe", "4bit"),
    ("qwen3_moe", "8bit"),
    ("qwen2", None),
    ("qwen3", None),
    ("deepseek_v3", None),
    ("deepseek_v3", "4bit"),
    ("glm4_moe", None),
    ("gpt_oss", None),
    ("deepseek_v32", None),
    ("glm4_moe_lite", None),
    ("kimi_k25", None),
]


def test_every_tensor_family_is_checked_here():
    from meshnode.planner import TENSOR_FAMILIES

    assert set(TENSOR_FAMILIES) <= {f for f, _ in GROUP_CASES}


@pytest.mark.slow
@pytest.mark.parametrize("family,quantize", GROUP_CASES, ids=lambda v: str(v))
def test_tensor_family_group_matches_mlx_lm(tmp_path, family, quantize):
    path = build_model(
        tmp_path / family,
        family,
        num_layers=6,
        hidden_size=64,
        intermediate_size=128,
        dtype="float32",
        quantize=quantize,
    )
    members = tensor_group(path, 0, 6)
    try:
        lead = members[0]
        cache = lead.make_cache()
        got = _greedy(lambda x: lead.forward(x, cache), 12)
        m, _ = load(str(path))
        want = [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(PROMPT), m, max_tokens=12)), range(12))]
        assert got == want
    finally:
        for member in members:
            member.close()


@pytest.mark.slow
def test_a_slow_step_is_waited_for_while_every_member_heartbeats(model):
    """Liveness from the control plane: a step far slower than the group's per-step deadline (every
    collective delayed) completes while ``members_alive`` holds; once it does not, the step fails at once."""
    heartbeats = [True]
    members = tensor_group(model, 0, 6, hop_timeout=0.05, inject_latency=0.05, members_alive=lambda: heartbeats[0])
    try:
        lead = members[0]
        cache = lead.make_cache()
        t0 = time.monotonic()
        got = _greedy(lambda x: lead.forward(x, cache), 3)
        assert time.monotonic() - t0 > 3 * 0.05 * 12  # 12 delayed collectives a step: far past 0.05 s
        m, _ = load(str(model))
        assert got == [
            int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(PROMPT), m, max_tokens=3)), range(3))
        ]
        heartbeats[0] = False
        with pytest.raises(TensorGroupError, match="stopped heartbeating"):
            _greedy(lambda x: lead.forward(x, cache), 1)
    finally:
        for member in members:
            member.close()
