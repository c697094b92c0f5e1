"""A stage's decoding requests run as one batched forward (meshnode.model.decode_batch): every
request's next-token logits equal its own unbatched step at every stage, while requests join,
leave, change order and step alone in between; dense and MoE, float32, bf16 and 4-bit."""

from __future__ import annotations

import mlx.core as mx
import pytest

from meshnode.model.build import build_model
from meshnode.model.decode_batch import DecodeBatch, batchable_cache
from meshnode.model.shard import Shard

LAYERS = 4
PROMPTS = {
    "a": [3, 17, 42, 99, 7, 250, 31, 64, 128],
    "b": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
    "c": [21, 22, 23, 24, 25],
    "d": [
        40,
        41,
        42,
        43,
        44,
        45,
        46,
        47,
        48,
        49,
        50,
        51,
        52,
        53,
        54,
        55,
        56,
        57,
        58,
        59,
        60,
        61,
        62,
        63,
        64,
        65,
        66,
        67,
        68,
        69,
    ],
}
# Each step: the requests batched, in the order the head names them; "alone": a request that steps
# on its own beside the batch (a failover replay, a prefill chunk: it leaves the batch first).
SCHEDULE = [
    (["a", "b"], None),
    (["a", "b"], None),
    (["b", "a", "c"], None),
    (["c", "a"], "b"),
    (["c", "a"], "b"),
    (["a", "b", "c", "d"], None),
    (["d", "b"], "a"),
    (["a", "b", "c", "d"], None),
    (["c"], None),
    (["d", "c", "b", "a"], None),
]

CASES = [
    ("llama", "float32", None, 1e-4),
    ("qwen3_moe", "float32", None, 1e-4),
    ("gemma3", "float32", None, 1e-4),
    ("llama", "bfloat16", None, 0.1),
    ("llama", "bfloat16", "4bit", 0.1),
    ("mixtral", "float32", "8bit", 1e-3),
    ("qwen3_next", "float32", None, 1e-4),
    ("deepseek_v3", "float32", None, 1e-4),
    ("gpt_oss", "float32", None, 1e-4),
]


class Member:
    def __init__(self, cache):
        self.cache, self.batch = cache, None


@pytest.mark.parametrize("family,dtype,quantize,tol", CASES, ids=[f"{c[0]}-{c[2] or c[1]}" for c in CASES])
def test_batched_steps_equal_each_requests_own_steps(family, dtype, quantize, tol, tmp_path):
    window = {"sliding_window": 4} if family == "gemma3" else {}  # windows that wrap within the test
    path = build_model(tmp_path / family, family, num_layers=LAYERS, dtype=dtype, quantize=quantize, seed=7, **window)
    shards = [Shard(path, 0, 1), Shard(path, 1, LAYERS)]
    assert all(batchable_cache(s.make_cache()) for s in shards)
    batches = [DecodeBatch(s.make_cache) for s in shards]

    def prefill(prompt):
        caches = [s.make_cache() for s in shards]
        h = mx.array([prompt[:-1]])
        for s, c in zip(shards, caches):
            h = s.forward(h, c)
        mx.eval([x.state for c in caches for x in c if x is not None])
        return caches

    # Each request twice: members of the batches, and a reference stepping alone all along.
    batched = {r: [Member(c) for c in prefill(p)] for r, p in PROMPTS.items()}
    alone = {r: prefill(p) for r, p in PROMPTS.items()}
    last = {r: p[-1] for r, p in PROMPTS.items()}

    def step_alone(caches, token):
        h = mx.array([[token]])
        for s, c in zip(shards, caches):
            h = s.forward(h, c)
        return h[0, -1]

    for names, solo in SCHEDULE:
        h = mx.array([[last[r]] for r in names])
        for k, (shard, batch) in enumerate(zip(shards, batches)):
            h = shard.forward(h, batch.follow([batched[r][k] for r in names]))
        got = {r: h[i, -1] for i, r in enumerate(names)}
        if solo is not None:
            for k, batch in enumerate(batches):
                batch.release(batched[solo][k])
            got[solo] = step_alone([m.cache for m in batched[solo]], last[solo])
        for r, logits in got.items():
            want = step_alone(alone[r], last[r])
            assert mx.allclose(logits.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item(), (
                family,
                names,
                r,
                mx.abs(logits - want).max().item(),
            )
            assert int(mx.argmax(logits).item()) == int(mx.argmax(want).item()) or tol > 1e-3
            last[r] = int(mx.argmax(want).item())
        for _k, batch in enumerate(batches):
            assert len(batch) == len(names)

    for batch in batches:
        batch.release_all()
        assert len(batch) == 0 and batch.cache is None
    # Out of the batch, each request's own cache is whole again: its next step equals the reference's.
    for r, members in batched.items():
        got, want = step_alone([m.cache for m in members], last[r]), step_alone(alone[r], last[r])
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item(), r


def test_a_request_named_twice_or_without_its_cache_is_refused_and_one_named_elsewhere_moves(tmp_path):
    path = build_model(tmp_path / "llama", "llama", num_layers=2, dtype="float32")
    shard = Shard(path, 0, 2)
    batch, other = DecodeBatch(shard.make_cache), DecodeBatch(shard.make_cache)
    m = Member(shard.make_cache())
    shard.forward(mx.array([[1, 2, 3]]), m.cache)
    with pytest.raises(ValueError, match="twice"):
        batch.follow([m, m])
    batch.follow([m])
    # Named by another batch, it moves there: out of the first (its cache extracted), into the other.
    other.follow([m])
    assert len(batch) == 0 and len(other) == 1 and m.batch is other and m.cache is None
    lost = Member(None)  # a cache no batch holds and no request has
    with pytest.raises(ValueError, match="without its cache"):
        other.follow([m, lost])


def test_quantized_and_chunked_caches_are_not_batchable():
    from mlx_lm.models.cache import ChunkedKVCache, KVCache, QuantizedKVCache

    assert batchable_cache([KVCache(), KVCache()])
    assert not batchable_cache([KVCache(), QuantizedKVCache(group_size=64, bits=4)])
    assert not batchable_cache([ChunkedKVCache(8)])
