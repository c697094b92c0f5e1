"""The prompt cache (issue 12): a chat's next turn prefills only its new tokens, on every stage.

The store and the index are tested on their own with mlx-lm's real caches; then a real node
(one process, HTTP) and a real 2-stage mesh (``meshnode run`` processes on namespace hosts, the
``openai`` client) hold a multi-turn chat whose every answer must equal ``mlx_lm.generate`` on
the whole conversation, while every stage reports the positions it did not compute again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
import urllib.request

import mlx.core as mx
import pytest
from mlx_lm import generate, load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache

from harness.cluster import HTTP, Cluster, in_ns, wait_mesh
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.model.prefixes import CANNOT_CUT, PrefixStore, prefix_key
from meshnode.model.scheduler import Baton, TokenScheduler
from meshnode.model.shard import Shard
from meshnode.serving.batching import BatchedSource
from meshnode.serving.generation import PipelineSource, PrefillOptions
from meshnode.serving.local_stage import LocalStage
from meshnode.serving.promptcache import MIN_REUSE, PrefixIndex
from meshnode.serving.sampling import SamplingParams
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
        def owned(self, cache):
            return cache

    class Group:  # a tensor group's shard: its prefixes live in its workers
        keeps_prefixes = True

        def owned(self, cache):
            return None

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
    assert index.match(short[: MIN_REUSE - 1] + [5] * 50) is None  # too short a shared start
    assert index.match(long[:50] + [1, 2, 3]) == (k2, 50)  # part of a kept prefix
    index.forget(k2, f"prefix {k2} of layers [0, 2): {CANNOT_CUT}")
    assert not index.partial  # whole kept prefixes only from now on:
    assert index.match(long[:50] + [1, 2, 3]) == (k1, len(short))  # not 50 of a longer one
    assert index.match(short + [1, 2]) == (k1, len(short))


# --------------------------------------------------------------------------- real nodes


@pytest.fixture(
    scope="module",
    params=[("llama", "4bit", "bfloat16"), ("qwen3_moe", None, "float32"), ("qwen3", None, "bfloat16")],
    ids=lambda p: "-".join(str(x) for x in p),
)
def model(request, tmp_path_factory):
    family, quantize, dtype = request.param
    return build_model(
        tmp_path_factory.mktemp("pc") / f"{family}-{quantize or dtype}",
        family,
        num_layers=4,
        hidden_size=64,
        intermediate_size=128,
        dtype=dtype,
        quantize=quantize,
    )


def _references(model, answers: list[str]) -> list[str]:
    """mlx_lm.generate's answer to each turn, the conversation so far holding ``answers``."""
    m, tok = load(str(model))
    messages, out = [], []
    for turn, answer in zip(TURNS, answers):
        messages.append({"role": "user", "content": turn})
        out.append(
            generate(
                m, tok, prompt=tok.apply_chat_template(messages, add_generation_prompt=True), max_tokens=MAX_TOKENS
            )
        )
        messages.append({"role": "assistant", "content": answer})
    return out


# A chat client: each turn re-sends the whole conversation (openai package); prints the answers.
CHAT = r"""
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
""".replace("MAX_TOKENS", str(MAX_TOKENS))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_node_a_chat_resumes_every_turn_and_answers_as_mlx_lm(model, tmp_path):
    import subprocess

    with running_node(model, tmp_path, max_context=1024) as (node, base):
        out = subprocess.run(
            [sys.executable, "-c", CHAT, base, model.name, json.dumps(TURNS)],
            capture_output=True,
            text=True,
            timeout=300,
        )
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
    model = build_model(
        tmp_path / "llama-8bit",
        "llama",
        num_layers=6,
        hidden_size=64,
        intermediate_size=128,
        dtype="bfloat16",
        quantize="8bit",
    )
    total = profile_model(model).total_bytes(1024)
    env = {"MESHNODE_STRATEGY": "pipeline", "MESHNODE_FAST_HOPS": "true" if transport == "tcp" else "false"}
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=1024)
        for h in cluster.hosts:  # neither holds it alone: two stages
            cluster.start(h, int(total * 0.6), env=env)
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 90, "convergence")
        assert len(views[0]["plan"]["stages"]) == 2, views[0]["plan"]
        head = cluster.host(views[0]["plan"]["stages"][-1]["nodes"][0])
        other = next(h for h in cluster.hosts if h is not head)
        # through the node that is not the head: it relays to the head, as any node does
        answers = in_ns(cluster.client, CHAT, f"http://{other.ip}:{HTTP}", model.name, json.dumps(TURNS), timeout=300)
        assert answers == _references(model, answers), cluster.logs()
        for h in cluster.hosts:  # the head's own layers and the other stage: each resumed every later turn
            hits, reused = prompt_cache_reuse(node_metrics(cluster, h))
            assert hits == len(TURNS) - 1 and reused > 100 * (len(TURNS) - 1), (h.name, hits, reused)
        if transport != "tcp":
            return
        # The stage that is not the head forgets what it kept (restarted, its disk cache off): the
        # head's next turn misses there, runs the whole prompt, and answers all the same.
        cluster.mesh.stop(cluster.procs.pop(other.name))
        cluster.start(other, int(total * 0.6), env={**env, "MESHNODE_PROMPT_CACHE_DISK": "0"})
        cluster.wait(lambda: cluster.converged(cluster.hosts, 2), 90, "the restarted node back")
        again = in_ns(cluster.client, CHAT, f"http://{head.ip}:{HTTP}", model.name, json.dumps(TURNS[:2]), timeout=300)
        assert again == _references(model, again)[:2], cluster.logs()


def test_a_new_chat_with_the_same_system_prompt_resumes_from_a_prefix_still_kept():
    """An agent's next task: the same long system prompt, a new first message. Every kept prefix
    shares that start; the head must offer one the stages still hold (the oldest may have been given
    up for room, and offering it would prefill the whole prompt again)."""
    from types import SimpleNamespace

    from meshnode.config import Settings
    from meshnode.serving.served import prompt_cache
    from meshnode.serving.settings import ServingSettings

    store, index = prompt_cache(
        ServingSettings.of(Settings(kv_requests=1, prompt_cache_disk=0)),
        SimpleNamespace(prompt_cache_resumed=lambda n, source: None),
        100,
        "m",
        Baton(),
    )
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


KEEP_DELAY = 0.5  # seconds: far longer than a client takes to send its next turn


@pytest.fixture
def slow_keep(monkeypatch):
    """Every node's store (in this process) keeps a prefix only after ``KEEP_DELAY`` (a busy node;
    a remote stage's round trip)."""
    keep = PrefixStore.keep

    def keep_slowly(self, *args, **kwargs):
        time.sleep(KEEP_DELAY)
        return keep(self, *args, **kwargs)

    monkeypatch.setattr(PrefixStore, "keep", keep_slowly)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", ["pipeline", "batched"])
@pytest.mark.parametrize(
    "weights", [("llama", "4bit", "float16"), ("qwen3", None, "bfloat16")], ids=lambda w: "-".join(str(x) for x in w)
)
def test_an_answer_closed_early_is_complete_only_once_its_prefix_is_kept(tmp_path, source, weights, slow_keep):
    """The API closes a generation's tokens as soon as the answer is complete (EOS, a stop
    string, max_tokens) and the client sends its next turn as soon as it has the answer, while
    the generation still runs the step built ahead and then keeps its prefix. Closing waits for
    that keep: with keeping held back far longer than a next turn takes, the prefix is there the
    moment the tokens are closed (else the next turn misses it and prefills everything)."""
    family, quantize, dtype = weights
    path = build_model(
        tmp_path / family, family, num_layers=4, hidden_size=64, intermediate_size=128, dtype=dtype, quantize=quantize
    )
    store, index = PrefixStore(capacity=1024), PrefixIndex()
    scheduler = TokenScheduler("test-prompt-cache")
    try:
        if source == "pipeline":
            stages = [LocalStage(Shard(path, 0, 2), store), LocalStage(Shard(path, 2, 4), store)]
            tokens_of = PipelineSource(scheduler, lambda: stages, prefill=PrefillOptions(), prefixes=index)
        else:
            tokens_of = BatchedSource(scheduler, LocalStage(Shard(path, 0, 4), store), prefixes=index)
        prompt = list(range(40, 40 + 2 * MIN_REUSE))

        async def answer(n: int) -> tuple[list[int], float]:
            out = []
            async with contextlib.aclosing(tokens_of.tokens(prompt, SamplingParams(max_tokens=64))) as tokens:
                async for token in tokens:
                    out.append(int(token))
                    if len(out) == n:
                        break  # the answer is complete: the API closes the tokens
                t0 = time.monotonic()
            return out, time.monotonic() - t0

        out, closing = asyncio.run(answer(5))
        resume = index.match(prompt + out + [7, 8, 9])  # the next turn, sent at once
        assert resume is not None, (out, closing)
        assert resume[1] >= len(prompt) + len(out) - 1, (resume, out)  # what every stage was fed
        assert closing >= KEEP_DELAY - 0.1, closing  # it waited for the keep
    finally:
        scheduler.stop()


def test_a_head_waits_for_the_generations_a_relay_gave_up():
    """A relay gives a generation up (cancels the head's stream) when its answer is complete, and
    names it in its next request to that head (GenerateRequest.after): the head waits for those
    still running to be over (their prefixes kept). Others running, an agent's parallel calls,
    are not waited for, and nothing waits longer than it is allowed to."""
    index = PrefixIndex()
    given_up, parallel = index.relayed("relay-a-1"), index.relayed("relay-a-2")

    def waited(ids, timeout=5.0) -> float:
        t0 = time.monotonic()
        asyncio.run(index.after(ids, timeout))
        return time.monotonic() - t0

    assert waited(["unknown", "relay-b-9"]) < 0.1  # never ran here, or long over
    threading.Timer(0.3, given_up.set).start()
    assert 0.25 < waited(["relay-a-1"]) < 2  # over in 0.3 s: waited for exactly that
    assert waited(["relay-a-1"]) < 0.1  # over
    assert 0.15 < waited(["relay-a-2"], timeout=0.2) < 1  # never over: bounded
    parallel.set()
    index.relayed("relay-a-3")
    assert index._relayed.keys() == {"relay-a-3"}  # ended ones are not remembered


@pytest.mark.netns
@pytest.mark.timeout(400)
def test_a_tensor_pair_keeps_prefixes_in_its_workers(tmp_path):
    """Two hosts sharing every layer (a tensor group, float32 where the split changes rounding): the
    group's workers keep each turn's KV and resume the next turn from it, every answer still equal
    to mlx_lm.generate on the whole conversation."""
    model = build_model(
        tmp_path / "qwen3-f32", "qwen3", num_layers=4, hidden_size=64, intermediate_size=128, dtype="float32"
    )
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
        answers = in_ns(cluster.client, CHAT, f"http://{other.ip}:{HTTP}", model.name, json.dumps(TURNS), timeout=300)
        assert answers == _references(model, answers), cluster.logs()
        hits, reused = prompt_cache_reuse(node_metrics(cluster, lead))
        assert hits == len(TURNS) - 1 and reused > 100 * (len(TURNS) - 1), (hits, reused, cluster.logs())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_relay_s_next_turn_resumes_what_the_head_was_still_keeping(tmp_path, slow_keep):
    """Two nodes (in this process), two stages; the client asks the node that is not the head,
    which relays. The relay sees a stop string the head does not know of and gives the head's
    stream up, while the head's stages still run and then keep the prefix (held back here far
    longer than a next turn takes). The next turn does not hold the last prompt whole (a template
    that renders the last turn's generation prompt otherwise in the history), so nothing but the
    relay naming the generation it gave up makes the head wait for it. Every stage resumes the
    next turn, and the answer is mlx-lm's cut at the stop string."""
    model = build_model(
        tmp_path / "qwen3-4bit", "qwen3", num_layers=4, hidden_size=64, intermediate_size=128, quantize="4bit"
    )
    prompt = list(range(40, 40 + 3 * MIN_REUSE))
    whole, tokenizer = load(str(model))
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), whole, max_tokens=3)]
    stop = tokenizer.decode(reference[:2])  # the head would go on to max_tokens: the relay stops it
    assert stop.isprintable() and stop and stop not in tokenizer.decode(reference[:1]), reference
    budget = int(profile_model(model).total_bytes(1024, 1) * 0.6)  # neither holds it alone
    flags = dict(max_context=1024, memory_budget=budget, strategy="pipeline", kv_requests=1)
    with contextlib.ExitStack() as stack:
        a, base_a = stack.enter_context(running_node(model, tmp_path / "a", ready=False, node_id="node-a", **flags))
        b, base_b = stack.enter_context(
            running_node(
                model, tmp_path / "b", ready=False, node_id="node-b", peers=[f"127.0.0.1:{a.grpc_port}"], **flags
            )
        )
        view = wait_mesh(
            base_a,
            lambda v: v["plan"] and len(v["plan"]["stages"]) == 2 and a.serving_ready() and b.serving_ready(),
            timeout=120,
            what="two stages serving",
        )
        head = view["plan"]["stages"][-1]["nodes"][0]
        head_base, relay_base = (base_a, base_b) if head == "node-a" else (base_b, base_a)  # the relay is a stage

        def complete(tokens: list[int]) -> dict:
            body = json.dumps(
                {"model": model.name, "prompt": tokens, "max_tokens": 32, "temperature": 0, "stop": [stop]}
            ).encode()
            req = urllib.request.Request(f"{relay_base}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.load(r)

        first = complete(prompt)
        assert first["choices"][0]["finish_reason"] == "stop" and first["choices"][0]["text"] == "", first
        complete(prompt[:-1] + [7, 8, 9])  # sent at once; shares all of the last prompt but its last token
        reuse = {}
        for base in (head_base, relay_base):
            with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
                reuse[base] = prompt_cache_reuse(r.read().decode())
    assert set(reuse.values()) == {(1, len(prompt) - 1)}, reuse  # each stage resumed the second turn
