"""Batched decode steps over a real data port (meshnode.transport.lockstep_hop): a node serving two
stages answers steps of several requests at once with each request's own logits, while requests
join, leave, change order and run a step on their own stream; bad steps are refused and the node
keeps serving."""

from __future__ import annotations

import time
from unittest import mock

import mlx.core as mx
import pytest

from meshnode.model.build import build_model
from meshnode.model.scheduler import TokenScheduler
from meshnode.model.shard import Shard
from meshnode.transport.dataport import DataServer
from meshnode.transport.hop import HopSession, serve_forward
from meshnode.transport.lockstep_hop import LockstepHop, serve_lockstep
from meshnode.transport.refusals import StageError
from meshnode.transport.remote_stage import RemoteStage
from meshnode.transport.stage_server import StageServer
from meshnode.trust.auth import ClusterAuth

pytestmark = pytest.mark.timeout(120)

LAYERS, SPLIT, EPOCH = 4, 2, 3
KEY = "batch hop key"
PROMPTS = {"r1": [3, 17, 42, 99, 7, 250, 31], "r2": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], "r3": [21, 22, 23]}
# (the requests of the batched step in order, a request that steps on its own stream beside it)
SCHEDULE = [
    (["r1", "r2"], None),
    (["r2", "r1", "r3"], None),
    (["r3", "r1"], "r2"),
    (["r1", "r2", "r3"], None),
    (["r3"], None),
    (["r2", "r3", "r1"], None),
]


@pytest.fixture(
    params=[("llama", "float32", None), ("qwen3_moe", "float32", None), ("llama", "bfloat16", "4bit")],
    ids=["llama", "qwen3_moe", "llama-4bit"],
)
def served(request, tmp_path):
    family, dtype, quantize = request.param
    path = build_model(tmp_path / family, family, num_layers=LAYERS, dtype=dtype, quantize=quantize, seed=11)
    shards = {(0, SPLIT): Shard(path, 0, SPLIT), (SPLIT, LAYERS): Shard(path, SPLIT, LAYERS)}
    scheduler = TokenScheduler("test-batch-hop")
    server = StageServer(scheduler, vocab_size=512, max_chunk=512, max_context=4096)
    server.serve(EPOCH, shards)
    auth = ClusterAuth(KEY)
    data = DataServer(
        "127.0.0.1",
        0,
        auth=auth,
        verify=True,
        forward=lambda conn, opening, host: (serve_lockstep if opening.forward.lockstep else serve_forward)(
            server, scheduler.run_here, conn, opening, host
        ),
    )
    first = next(iter(shards.values()))
    stages = [
        RemoteStage(
            node_id="peer",
            channel=mock.MagicMock(),
            loop=None,
            start=a,
            end=b,
            epoch=EPOCH,
            hidden_size=first.hidden_size if b < LAYERS else 512,
            hop_timeout=5.0,
        )
        for a, b in shards
    ]
    yield path, server, data, auth, stages
    data.close()
    scheduler.stop()


def _reference(path, prompt):
    shards = [Shard(path, 0, SPLIT), Shard(path, SPLIT, LAYERS)]
    caches = [s.make_cache() for s in shards]

    def step(tokens):
        h = mx.array([tokens])
        for s, c in zip(shards, caches):
            h = s.forward(h, c)
        return h[0, -1]

    step(prompt[:-1])
    return step


def _open(stages, data, auth, rid, prompt):
    sessions = [HopSession(s, rid, "127.0.0.1", data.port, auth=auth, node_id="head") for s in stages]
    h = mx.array([prompt[:-1]])
    for s in sessions:
        h = s.forward(h)
    return sessions


def _close(sessions):
    for s in sessions:
        s.close()


def test_batched_steps_over_the_data_port_equal_each_requests_own(served):
    path, server, data, auth, stages = served
    tol = 0.1 if "4bit" in str(path) else 1e-4
    own = {r: _open(stages, data, auth, r, p) for r, p in PROMPTS.items()}
    reference = {r: _reference(path, p) for r, p in PROMPTS.items()}
    last = {r: p[-1] for r, p in PROMPTS.items()}
    hops = [LockstepHop(s, "127.0.0.1", data.port, auth=auth, node_id="head") for s in stages]
    try:
        for names, solo in SCHEDULE:
            h = mx.array([[last[r]] for r in names])
            for hop in hops:
                h = hop.step(names, h)
            got = {r: h[i, -1] for i, r in enumerate(names)}
            if solo is not None:  # its own stream: the stage takes its cache out of the batch first
                x = mx.array([[last[solo]]])
                for s in own[solo]:
                    x = s.forward(x)
                got[solo] = x[0, -1]
            for r, logits in got.items():
                want = reference[r]([last[r]])
                assert mx.allclose(logits.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item(), r
                last[r] = int(mx.argmax(want).item())
            assert [len(b) for b in server.batches.values()] == [len(names)] * 2
    finally:
        for hop in hops:
            hop.close()
        for sessions in own.values():
            _close(sessions)
    deadline = time.monotonic() + 10
    while (server.streams or any(len(b) for b in server.batches.values())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.streams and not any(len(b) for b in server.batches.values())


def test_a_bad_batched_step_is_refused_and_the_stage_keeps_serving(served):
    path, server, data, auth, stages = served
    own = _open(stages[:1], data, auth, "r1", PROMPTS["r1"])
    try:
        hop = LockstepHop(stages[0], "127.0.0.1", data.port, auth=auth, node_id="head")
        with pytest.raises(StageError, match="no open stream"):
            hop.step(["r1", "nobody"], mx.array([[1], [2]]))
        hop.close()
        hop = LockstepHop(stages[0], "127.0.0.1", data.port, auth=auth, node_id="head")
        with pytest.raises(StageError, match="vocabulary"):
            hop.step(["r1"], mx.array([[100000]]))
        hop.close()
        # A request that promised its next step on its own stream (built ahead there) cannot join.
        own[0].finish(own[0].submit(mx.array([[PROMPTS["r1"][-1]]]), next_single=True))
        hop = LockstepHop(stages[0], "127.0.0.1", data.port, auth=auth, node_id="head")
        opened = server.streams[("r1", 0, SPLIT)]
        deadline = time.monotonic() + 20
        while opened.prepared is None:  # the stage builds that step after its reply went out
            assert time.monotonic() < deadline, "the stage never built the promised step"
            time.sleep(0.01)
        with pytest.raises(StageError, match="promised"):
            hop.step(["r1"], mx.array([[5]]))
        hop.close()
        # The request's own stream still works, and a good step on a new batch stream too.
        own[0].forward(mx.array([[7]]))
        hop = LockstepHop(stages[0], "127.0.0.1", data.port, auth=auth, node_id="head")
        out = hop.step(["r1"], mx.array([[9]]))
        assert out.shape == (1, 1, stages[0].hidden_size)
        hop.close()
    finally:
        _close(own)


def test_decode_steps_go_as_raw_requests_once_the_stage_says_it_takes_them(served):
    """After the first (protobuf) message's raw reply says TAKES_RAW, each decode step travels as a
    raw request: token ids to the first stage, an activation to the second, with the promise and a
    cut of the KV (rewind) carried in its header; the logits are the whole model's. A raw step with
    a token outside the vocabulary is refused, and the stage serves the next stream."""
    path, server, data, auth, stages = served
    tol = 0.1 if "4bit" in str(path) else 1e-4
    prompt = PROMPTS["r2"]
    sessions = [HopSession(s, "raw", "127.0.0.1", data.port, auth=auth, node_id="head") for s in stages]
    reference = _reference(path, prompt)
    sent: list = []
    try:
        h = mx.array([prompt[:-1]])
        for s in sessions:
            assert not s._takes_raw
            h = s.forward(h)
        assert all(s._takes_raw for s in sessions)
        token = prompt[-1]
        with mock.patch("meshnode.transport.hop.raw_request_into", wraps=hop_raw_request_into(sent)):
            for step in range(3):
                last = token
                x = mx.array([[token]], dtype=mx.uint32)
                for s in sessions:
                    x = s.finish(s.submit(x, next_single=step < 2))
                want = reference([token])
                assert mx.allclose(x[0, -1].astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item()
                token = int(mx.argmax(want).item())
            # A cut of the KV goes in the raw header too: drop the last step and run it again.
            for s in sessions:
                s.rewind(1)
            x = mx.array([[last]], dtype=mx.uint32)
            for s in sessions:
                x = s.forward(x)
        assert len(sent) == 2 * 4 and sent[-1][1] == 1  # every decode step raw; the last carried the cut
        assert mx.allclose(x[0, -1].astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item()
    finally:
        _close(sessions)
    bad = HopSession(stages[0], "bad", "127.0.0.1", data.port, auth=auth, node_id="head")
    try:
        bad.forward(mx.array([prompt[:3]]))
        with pytest.raises(StageError, match="vocabulary"):
            bad.forward(mx.array([[100000]], dtype=mx.uint32))
    finally:
        bad.close()
    again = _open(stages, data, auth, "after", PROMPTS["r3"])
    _close(again)


def hop_raw_request_into(sent: list):
    from meshnode.model.wire import raw_request_into

    def record(buf, offset, x, next_single, rewind):
        sent.append((x.shape, rewind))
        return raw_request_into(buf, offset, x, next_single, rewind)

    return record
