"""The prompt cache (issue 12): a chat's next turn prefills only its new tokens, on every stage.

The store and the index are tested on their own with mlx-lm's real caches; then a real node
(one process, HTTP) and a real 2-stage mesh (``meshnode run`` processes on namespace hosts, the
``openai`` client) hold a multi-turn chat whose every answer must equal ``mlx_lm.generate`` on
the whole conversation, while every stage reports the positions it did not compute again.
"""

from __future__ import annotations

import json
import sys
import urllib.request

import mlx.core as mx
import pytest
from mlx_lm import generate, load
from mlx_lm.models.cache import ArraysCache, KVCache

from harness.cluster import HTTP, Cluster, in_ns
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.model.prefixes import CANNOT_CUT, PrefixStore, prefix_key
from meshnode.serving.promptcache import MIN_REUSE, PrefixIndex
from meshnode.weights.profile import profile_model
from tests.helpers import node_metrics, prompt_cache_reuse, running_node

MAX_TOKENS = 10
TURNS = [f"Turn {i}: tell me about rivers, tides and the sea, and why the water is salty. " * 3 for i in range(4)]


def _kv(positions: int, value: float = 1.0) -> list[KVCache]:
    c = KVCache()
    x = mx.full((1, 2, positions, 4), value)
    c.update_and_fetch(x, x)
    return [c]


def test_a_kept_prefix_is_resumed_as_a_copy_cut_to_what_is_asked():
    store = PrefixStore(capacity=1000)
    layers = (0, 2)
    assert store.keep(layers, "k", _kv(40), 38)  # held 40 (a step built ahead, say): cut to 38
    cache, why = store.resume(layers, "k", 30)
    assert why == "" and cache[0].offset == 30
    cache[0].update_and_fetch(mx.zeros((1, 2, 5, 4)), mx.zeros((1, 2, 5, 4)))  # the request goes on
    again, _ = store.resume(layers, "k", 38)  # the kept one is untouched
    assert again[0].offset == 38 and mx.all(again[0].keys[:, :, :38] == 1.0).item()
    assert store.resume(layers, "k", 39) == (None, "not kept here")  # more than it holds
    assert store.resume((2, 4), "k", 10)[0] is None  # other layers
    assert store.hits == 2 and store.reused_positions == 68


def test_a_prefix_kept_by_one_kind_of_shard_is_not_resumed_by_another():
    """A re-plan can run the same layers another way (a plain shard's layer caches, a tensor
    group's workers): a prefix kept one way is a miss the other way, not a cache it cannot use."""

    class Plain:
        owned = (0, 2)

    class Group:  # a tensor group's shard: its prefixes live in its workers
        keeps_prefixes = True

    store = PrefixStore(capacity=1000)
    assert store.keep((0, 2), "k", _kv(20), 20)
    assert store.resume((0, 2), "k", 10, Group())[0] is None
    assert store.resume((0, 2), "k", 10, Plain())[1] == ""


def test_kept_prefixes_give_way_to_requests_running():
    store = PrefixStore(capacity=100)
    layers = (0, 4)
    store.keep(layers, "old", _kv(40), 40)
    store.keep(layers, "new", _kv(40), 40)
    assert store.held(layers) == 80
    store.grow(layers, 30)  # a request open here took 30 positions: 80 + 30 > 100
    assert store.keys(layers) == ["new"]  # the least recently used went first
    store.grow(layers, -30)
    assert not store.keep(layers, "huge", _kv(120), 120)  # never more than the reservation
    store.grow(layers, 90)
    assert store.keys(layers) == []


def test_a_cache_that_cannot_be_cut_back_is_resumed_whole_only():
    store = PrefixStore(capacity=1000)
    state = ArraysCache(1)  # a recurrent layer's state (Qwen3-Next, Mamba): no way back
    state[0] = mx.ones((1, 4))
    kv = _kv(20)[0]
    cache = [kv, state]
    assert store.keep((0, 2), "k", cache, 20)
    assert store.resume((0, 2), "k", 10) == (None, CANNOT_CUT)
    whole, why = store.resume((0, 2), "k", 20)
    assert why == "" and whole[0].offset == 20
    assert not store.keep((0, 2), "j", [_kv(21)[0], state], 20)  # held one more than asked: cannot cut


def test_the_head_resumes_from_the_longest_shared_start():
    index = PrefixIndex()
    short = list(range(100, 140))
    long = short + list(range(200, 260))
    k1, k2 = index.add(short), index.add(long)
    assert k2 == prefix_key(long)
    assert index.match(long + [7, 8]) == (k2, len(long))
    assert index.match(short + [9] * 30) == (k1, len(short))
    assert index.match(long) == (k2, len(long) - 1)  # the last prompt token is always computed
    assert index.match(short[:MIN_REUSE - 1] + [5] * 50) is None  # too short a shared start
    assert index.match(long[:50] + [1, 2, 3]) == (k2, 50)  # part of a kept prefix
    index.forget(k2, f"prefix {k2} of layers [0, 2): {CANNOT_CUT}")
    assert not index.partial  # whole kept prefixes only from now on:
    assert index.match(long[:50] + [1, 2, 3]) == (k1, len(short))  # not 50 of a longer one
    assert index.match(short + [1, 2]) == (k1, len(short))


# --------------------------------------------------------------------------- real nodes

@pytest.fixture(scope="module", params=[("llama", "4bit", "bfloat16"), ("qwen3_moe", None, "float32"),
                                        ("qwen3", None, "bfloat16")], ids=lambda p: "-".join(str(x) for x in p))
def model(request, tmp_path_factory):
    family, quantize, dtype = request.param
    return build_model(tmp_path_factory.mktemp("pc") / f"{family}-{quantize or dtype}", family, num_layers=4,
                       hidden_size=64, intermediate_size=128, dtype=dtype, quantize=quantize)


def _references(model, answers: list[str]) -> list[str]:
    """mlx_lm.generate's answer to each turn, the conversation so far holding ``answers``."""
    m, tok = load(str(model))
    messages, out = [], []
    for turn, answer in zip(TURNS, answers):
        messages.append({"role": "user", "content": turn})
        out.append(generate(m, tok, prompt=tok.apply_chat_template(messages, add_generation_prompt=True),
                            max_tokens=MAX_TOKENS))
        messages.append({"role": "assistant", "content": answer})
    return out


# A chat client: each turn re-sends the whole conversation (openai package); prints the answers.
CHAT = r'''
import json, sys
from openai import OpenAI
base, model, turns = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
messages, answers = [], []
for i, turn in enumerate(turns):
    messages.append({"role": "user", "content": turn})
    if i % 2:  # streamed, as chat UIs do
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True) if ch.choices)
    else:
        text = c.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                         temperature=0).choices[0].message.content
    answers.append(text)
    messages.append({"role": "assistant", "content": text})
print(json.dumps(answers))
'''.replace("MAX_TOKENS", str(MAX_TOKENS))


@pytest.mark.timeout(300)
def test_one_node_a_chat_resumes_every_turn_and_answers_as_mlx_lm(model, tmp_path):
    import subprocess

    with running_node(model, tmp_path, max_context=1024) as (node, base):
        out = subprocess.run([sys.executable, "-c", CHAT, base, model.name, json.dumps(TURNS)], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        answers = json.loads(out.stdout)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            hits, reused = prompt_cache_reuse(r.read().decode())
    assert answers == _references(model, answers)
    assert hits == len(TURNS) - 1, (hits, reused)  # every turn after the first
    assert reused > 100 * (len(TURNS) - 1), reused


@pytest.mark.netns
@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_two_stages_every_stage_resumes_and_a_miss_costs_nothing(tmp_path, transport):
    """``tcp``: activations (and the keep and resume) over the data port; ``grpc``: over gRPC
    streams (fast_hops = false, as in encrypted clusters)."""
    model = build_model(tmp_path / "llama-8bit", "llama", num_layers=6, hidden_size=64, intermediate_size=128,
                        dtype="bfloat16", quantize="8bit")
    total = profile_model(model).total_bytes(1024)
    env = {"MESHNODE_STRATEGY": "pipeline", "MESHNODE_FAST_HOPS": "true" if transport == "tcp" else "false"}
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=1024)
        for h in cluster.hosts:  # neither holds it alone: two stages
            cluster.start(h, int(total * 0.6), env=env)
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, 2), 90, "convergence")
        assert len(views[0]["plan"]["stages"]) == 2, views[0]["plan"]
        head = cluster.host(views[0]["plan"]["stages"][-1]["nodes"][0])
        other = next(h for h in cluster.hosts if h is not head)
        # through the node that is not the head: it relays to the head, as any node does
        answers = in_ns(cluster.client, CHAT, f"http://{other.ip}:{HTTP}", model.name, json.dumps(TURNS),
                        timeout=300)
        assert answers == _references(model, answers), cluster.logs()
        for h in cluster.hosts:  # the head's own layers and the other stage: each resumed every later turn
            hits, reused = prompt_cache_reuse(node_metrics(cluster, h))
            assert hits == len(TURNS) - 1 and reused > 100 * (len(TURNS) - 1), (h.name, hits, reused)
        if transport != "tcp":
            return
        # The stage that is not the head forgets what it kept (restarted): the head's next turn
        # misses there, runs the whole prompt, and answers all the same.
        cluster.mesh.stop(cluster.procs.pop(other.name))
        cluster.start(other, int(total * 0.6), env=env)
        cluster.wait(lambda: cluster.converged(cluster.hosts, 2), 90, "the restarted node back")
        again = in_ns(cluster.client, CHAT, f"http://{head.ip}:{HTTP}", model.name, json.dumps(TURNS[:2]),
                      timeout=300)
        assert again == _references(model, again)[:2], cluster.logs()


def test_a_new_chat_with_the_same_system_prompt_resumes_from_a_prefix_still_kept():
    """An agent's next task: the same long system prompt, a new first message. Every kept prefix
    shares that start; the head must offer one the stages still hold (found with benchmarks.chat
    --sessions: the oldest was offered, the stage had given it up for room, and the whole 6000-token
    prompt was prefilled again)."""
    from types import SimpleNamespace

    from meshnode.serving.served import prompt_cache

    store, index = prompt_cache(SimpleNamespace(prompt_cache=True, kv_requests=1),
                                SimpleNamespace(prompt_cache_resumed=lambda n: None), 100)
    layers, system = (0, 4), list(range(1000, 1030))
    turns = [system + list(range(k * 100, k * 100 + 10 * (k + 1))) for k in range(3)]  # 40, 50, 60 positions
    for tokens in turns:
        assert store.keep(layers, index.add(tokens), _kv(len(tokens)), len(tokens))
    assert store.keys(layers) == [prefix_key(turns[2])] and len(index) == 1  # the index forgot what was given up
    new_chat = system + [7] * 20
    key, positions = index.match(new_chat)
    assert (key, positions) == (prefix_key(turns[2]), len(system))
    assert store.resume(layers, key, positions)[1] == ""
    # Between prefixes the index still holds, a tie goes to the most recently kept.
    fresh = PrefixIndex()
    for tokens in turns:
        fresh.add(tokens)
    assert fresh.match(new_chat) == (prefix_key(turns[2]), len(system))


def test_the_next_turn_waits_for_the_last_one_to_be_kept():
    """A client that has its last token (EOS, a stop string, a relay counting max_tokens) sends
    the next turn at once, while the generation may still be asking its stages to keep its
    prefix: the next turn waits for that (briefly) instead of missing it and prefilling the whole
    conversation again. A request that only shares a start with a running one does not wait."""
    import asyncio
    import threading
    import time

    index = PrefixIndex()
    turn1 = list(range(300, 340))
    fed = turn1 + [7, 8, 9]
    ended = threading.Event()
    index.running(turn1, ended)

    def keep_later():
        time.sleep(0.3)
        index.add(fed)
        ended.set()

    def waited(prompt) -> float:
        t0 = time.monotonic()
        asyncio.run(index.settled(prompt))
        return time.monotonic() - t0

    assert waited(turn1[:30] + [1, 2, 3]) < 0.1  # shares a start only: an agent's parallel call
    assert waited(turn1) < 0.1  # the same prompt again, in parallel
    threading.Thread(target=keep_later).start()
    assert 0.2 < waited(fed + [10, 11]) < 1.5  # the next turn: it holds turn 1's prompt whole
    assert index.match(fed + [10, 11]) == (prefix_key(fed), len(fed))
    assert waited(fed + [10, 11]) < 0.1  # nothing running any more


@pytest.mark.netns
@pytest.mark.timeout(400)
def test_a_tensor_pair_keeps_prefixes_in_its_workers(tmp_path):
    """Two hosts sharing every layer (a tensor group, float32 where the split changes rounding): the
    group's workers keep each turn's KV and resume the next turn from it, every answer still equal
    to mlx_lm.generate on the whole conversation."""
    model = build_model(tmp_path / "qwen3-f32", "qwen3", num_layers=4, hidden_size=64, intermediate_size=128,
                        dtype="float32")
    total = profile_model(model).total_bytes(1024)
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=1024)
        for h in cluster.hosts:
            cluster.start(h, int(total * 0.8), env={"MESHNODE_STRATEGY": "tensor"})
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, 2), 120, "convergence")
        stages = views[0]["plan"]["stages"]
        assert len(stages) == 1 and len(stages[0]["nodes"]) == 2, views[0]["plan"]
        lead = cluster.host(stages[0]["nodes"][0])  # rank 0 drives the group and keeps its prefixes
        other = next(h for h in cluster.hosts if h is not lead)
        answers = in_ns(cluster.client, CHAT, f"http://{other.ip}:{HTTP}", model.name, json.dumps(TURNS),
                        timeout=300)
        assert answers == _references(model, answers), cluster.logs()
        hits, reused = prompt_cache_reuse(node_metrics(cluster, lead))
        assert hits == len(TURNS) - 1 and reused > 100 * (len(TURNS) - 1), (hits, reused, cluster.logs())
