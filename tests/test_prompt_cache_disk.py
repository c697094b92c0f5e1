"""The prompt cache on disk (issue 17): kept prefixes survive a restart, a re-plan and eviction.

Real mlx-lm models run as stages in this process (meshnode.serving.generation), each node's
prompt cache with a :class:`PrefixDisk`; "a restart" is a fresh store, index and disk object on
the same folder. Every answer is compared with mlx-lm's own greedy decoding of the whole prompt.
"""

from __future__ import annotations

import asyncio
import contextlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model

from meshnode.model.build import build_model
from meshnode.model.prefix_disk import PrefixDisk
from meshnode.model.prefixes import PrefixStore, prefix_key
from meshnode.model.scheduler import TokenScheduler
from meshnode.model.shard import Shard
from meshnode.serving.batching import BatchedSource
from meshnode.serving.generation import PipelineSource, PrefillOptions
from meshnode.serving.local_stage import LocalStage
from meshnode.serving.promptcache import PrefixIndex
from meshnode.serving.sampling import SamplingParams

MODEL = "m"
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 250, 120)]
NEXT = [int(t) for t in np.random.default_rng(8).integers(3, 250, 30)]


@pytest.fixture(
    scope="module",
    params=[("llama", "4bit", "bfloat16"), ("qwen3", None, "float32")],
    ids=lambda p: f"{p[0]}-{p[1] or p[2]}",
)
def model(request, tmp_path_factory):
    family, quantize, dtype = request.param
    return build_model(
        tmp_path_factory.mktemp("pcd") / family,
        family,
        num_layers=4,
        hidden_size=64,
        intermediate_size=128,
        dtype=dtype,
        quantize=quantize,
    )


def reference(path, prompt: list[int], n: int) -> list[int]:
    m, _ = load_model(path)
    return [int(t) for t, _ in generate_step(mx.array(prompt), m, max_tokens=n, prefill_step_size=32)]


class Node:
    """One process's prompt cache over ``root``, serving ``split`` as local stages."""

    def __init__(self, path, root, split, limit=1 << 30, written=None, batched=False):
        self.disk = PrefixDisk(root, MODEL, limit, on_write=written)
        self.resumed: list[tuple[int, str]] = []
        self.store = PrefixStore(4096, on_resume=lambda n, source: self.resumed.append((n, source)), disk=self.disk)
        self.index = PrefixIndex(disk=self.disk)
        self.scheduler = TokenScheduler("test-prompt-disk")
        stages = [LocalStage(Shard(path, a, b), self.store) for a, b in split]
        if batched:  # one node holding the whole model batches its requests (meshnode.serving.batching)
            self.source = BatchedSource(self.scheduler, stages[0], prefixes=self.index)
        else:
            self.source = PipelineSource(
                self.scheduler, lambda: stages, prefill=PrefillOptions(max_chunk=32), prefixes=self.index
            )

    def answer(self, prompt: list[int], n: int) -> list[int]:
        async def run() -> list[int]:
            out = []
            async with contextlib.aclosing(self.source.tokens(prompt, SamplingParams(max_tokens=n))) as tokens:
                async for token in tokens:
                    out.append(int(token))
            return out

        out = asyncio.run(run())
        assert self.disk.flush(30)
        return out

    def close(self) -> None:
        self.scheduler.stop()
        self.disk.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "after", [[(0, 2), (2, 4)], [(0, 3), (3, 4)], [(0, 4)]], ids=["same-split", "re-planned", "one-stage"]
)
def test_a_restarted_node_resumes_the_next_turn_from_disk(model, tmp_path, after):
    """Turn 1 on stages [0, 2) and [2, 4); every node restarts (nothing in memory), maybe with
    another split; turn 2 reads the kept prefix back (composed from the entries whose layer
    ranges cover each stage's now) and answers as mlx-lm does on the whole conversation."""
    written: list[int] = []
    first = Node(model, tmp_path, [(0, 2), (2, 4)], written=written.append)
    try:
        answer1 = first.answer(PROMPT, 8)
    finally:
        first.close()
    assert answer1 == reference(model, PROMPT, 8)
    assert len(written) == 2 and all(n > 0 for n in written)  # one entry per stage

    conversation = PROMPT + answer1 + NEXT
    again = Node(model, tmp_path, after)
    try:
        assert len(again.index) == 1  # the head's index, rebuilt from disk
        answer2 = again.answer(conversation, 8)
        resumed = list(again.resumed)
    finally:
        again.close()
    assert answer2 == reference(model, conversation, 8)
    kept = len(PROMPT) + len(answer1) - 1  # every token but the last went through every stage
    assert resumed == [(kept, "disk")] * len(after), resumed
    assert again.store.disk_hits == len(after)


def test_a_corrupt_or_truncated_entry_is_deleted_and_never_used(model, tmp_path):
    node = Node(model, tmp_path, [(0, 2), (2, 4)])
    try:
        answer1 = node.answer(PROMPT, 6)
    finally:
        node.close()
    entries = sorted((tmp_path / MODEL).glob("*/layers-*.safetensors"))
    assert [p.name for p in entries] == ["layers-0-2.safetensors", "layers-2-4.safetensors"]
    truncated, garbage = entries
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    garbage.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json" + bytes(100))

    conversation = PROMPT + answer1 + NEXT
    again = Node(model, tmp_path, [(0, 2), (2, 4)])
    try:
        answer2 = again.answer(conversation, 6)  # the first stage misses, the whole prompt runs
        assert again.resumed == []
        assert not truncated.exists()
        key = truncated.parent.name
        templates = Shard(model, 2, 4).owned(Shard(model, 2, 4).cache_template())
        assert again.disk.load(key, (2, 4), 10, templates) == (None, "layers-2-4.safetensors could not be read")
        assert not garbage.exists()
    finally:
        again.close()
    assert answer2 == reference(model, conversation, 6)
    assert not any(p.name.startswith(".") for p in (tmp_path / MODEL).rglob("*"))  # no partial writes left


def test_an_entry_whose_metadata_names_another_prefix_is_not_used(tmp_path):
    disk = PrefixDisk(tmp_path, MODEL, 1 << 20)
    cache = KVCache()
    x = mx.ones((1, 2, 20, 8))
    cache.update_and_fetch(x, x)
    mx.eval(cache.state)
    disk.keep("a" * 24, (0, 1), [cache], 20)
    assert disk.flush(10)
    moved = tmp_path / MODEL / ("b" * 24)
    (tmp_path / MODEL / ("a" * 24)).rename(moved)
    why = "layers-0-1.safetensors is not the entry its name says"
    assert disk.load("b" * 24, (0, 1), 20, [KVCache()]) == (None, why)
    assert not (moved / "layers-0-1.safetensors").exists()
    disk.close()


def test_the_disk_holds_its_limit_least_recently_used_out_first(tmp_path):
    def kv(positions: int) -> list[KVCache]:
        c = KVCache()
        x = mx.ones((1, 4, positions, 64))
        c.update_and_fetch(x, x)
        mx.eval(c.state)
        return [c]

    one = sum(c.nbytes for c in kv(256))
    disk = PrefixDisk(tmp_path, MODEL, int(3.5 * one))
    keys = [f"{i:024d}" for i in range(5)]
    for key in keys[:3]:
        disk.keep(key, (0, 1), kv(256), 256)
    assert disk.flush(10)
    assert disk.load(keys[0], (0, 1), 256, [KVCache()])[0] is not None  # used: now the most recent
    for key in keys[3:]:
        disk.keep(key, (0, 1), kv(256), 256)
    assert disk.flush(10)
    held = sorted(p.name for p in (tmp_path / MODEL).iterdir())
    assert held == [keys[0], keys[3], keys[4]], held
    total = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert total <= 3.5 * one * 1.01, (total, one)
    disk.close()


def test_the_head_index_is_rebuilt_from_disk_and_skips_tokens_that_do_not_hash_to_their_name(tmp_path):
    disk = PrefixDisk(tmp_path, MODEL, 1 << 20)
    index = PrefixIndex(disk=disk)
    good, bad = list(range(100, 180)), list(range(300, 380))
    key = index.add(good)
    index.add(bad)
    assert disk.flush(10)
    np.save(tmp_path / MODEL / prefix_key(bad) / "tokens.npy", np.arange(5, dtype=np.int32))
    rebuilt = PrefixIndex(disk=disk)
    assert len(rebuilt) == 1 and rebuilt.match(good + [1, 2]) == (key, len(good))
    assert not (tmp_path / MODEL / prefix_key(bad)).exists()
    disk.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("split", [[(0, 2), (2, 4)], [(0, 4)]], ids=["2-stages", "batched"])
def test_a_turn_that_resumed_writes_only_its_new_positions_and_reads_back_whole(model, tmp_path, split):
    """Turn 2 resumes turn 1's prefix, so its entry holds only the positions after it and names
    turn 1's as its parent; after a restart turn 3 reads both back, joined, and answers as mlx-lm."""
    written: list[int] = []
    node = Node(model, tmp_path, split, written=written.append, batched=len(split) == 1)
    try:
        answer1 = node.answer(PROMPT, 6)
        second = PROMPT + answer1 + NEXT
        answer2 = node.answer(second, 6)
        assert [source for _, source in node.resumed] == ["memory"] * len(split)
    finally:
        node.close()
    assert answer2 == reference(model, second, 6)
    turns = len(split)  # entries a turn writes
    assert len(written) == 2 * turns and max(written[turns:]) < min(written[:turns]) / 2, written

    third = second + answer2 + NEXT[:10]
    again = Node(model, tmp_path, [(0, 1), (1, 4)])  # restarted, re-planned
    try:
        answer3 = again.answer(third, 6)
        resumed = list(again.resumed)
    finally:
        again.close()
    assert answer3 == reference(model, third, 6)
    fed = len(second) + len(answer2) - (len(split) > 1)  # a pipeline never ran the last token
    assert resumed == [(fed, "disk")] * 2, resumed
