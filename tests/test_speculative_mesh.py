"""Speculative decoding on real nodes (namespace hosts), asked through the openai package.

The head's drafter is the test one (harness/drafts.py, given to the nodes as a test hook) with guesses right
60% of the time at chosen positions, so passes with rejections happen on every run; the answers
must be exactly mlx-lm's (greedy) and exactly the same seeded draws as decoding one token at a
time, over 2 pipeline stages (data port and gRPC), a tensor pair, and through a stage killed in
the middle of a speculative stream (failover replays it).
"""

from __future__ import annotations

import json
import re

import pytest

from harness.cluster import HTTP, Cluster, in_ns, read_stream, stage_nodes
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.model.compute import seed_figures
from meshnode.weights.profile import profile_model
from tests.helpers import node_metrics

pytestmark = [pytest.mark.netns, pytest.mark.timeout(400)]

MESSAGES = [{"role": "user", "content": "Tell me a very long story about the sea and the rivers."}]
MAX_TOKENS = 64
SEEDED = {"temperature": 0.8, "seed": 20261126}

# Greedy (not streamed), greedy (streamed) and seeded (streamed), one after another.
ASK = r"""
import json, sys
from openai import OpenAI
base, model, n, seeded = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
messages = [{"role": "user", "content": "Tell me a very long story about the sea and the rivers."}]
plain = c.chat.completions.create(model=model, messages=messages, max_tokens=n,
                                  temperature=0).choices[0].message.content
def streamed(**kw):
    return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=model, messages=messages, max_tokens=n, stream=True, **kw) if ch.choices)
print(json.dumps({"greedy": plain, "greedy_stream": streamed(temperature=0), "seeded": streamed(**seeded)}))
"""


def references(model, max_tokens: int) -> tuple[dict, list[list[int]]]:
    """mlx-lm's greedy answer and the seeded answer drawn one token at a time (meshnode's sampler
    over mlx-lm's generate_step on the whole model), and each as prompt + answer token ids."""
    from mlx_lm import load, stream_generate

    from meshnode.serving.sampling import SamplingParams, make_request_sampler

    m, tok = load(str(model))
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    texts, answers = {}, []
    for name, sampler in [
        ("greedy", None),
        ("seeded", make_request_sampler(SamplingParams(max_tokens=max_tokens, **SEEDED))),
    ]:
        text, ids = "", []
        for r in stream_generate(m, tok, prompt, max_tokens=max_tokens, sampler=sampler):
            text += r.text
            ids.append(r.token)
        texts[name], answers = text, answers + [list(prompt) + ids]
    return texts, answers


def drafts_file(tmp_path, model, answers, p: float = 0.6, k: int | None = 4, mode: str | None = "prompt_lookup"):
    """The nodes' environment (their ``speculative`` setting) and the test drafter's file
    (Cluster.start's ``drafts``: read for each request, so a test may write it again between two).
    ``k``: that many guesses every pass, whatever they cost (here each costs ~a step: the head
    would stop); None: the head's own choice. ``mode``: the ``speculative`` setting (None: the
    default, "auto")."""
    from mlx_lm.utils import load_config

    path = tmp_path / "drafts.json"
    vocab = load_config(model)["vocab_size"]
    path.write_text(
        json.dumps({"p": p, "seed": 5, "vocab": vocab, "answers": answers, **({"k": k} if k is not None else {})})
    )
    return ({"MESHNODE_SPECULATIVE": mode} if mode else {}), path


def counter(metrics: str, name: str) -> float:
    found = re.search(rf"^{name}_total (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


def ask_and_compare(cluster, head, model, texts: dict) -> None:
    """The three answers of ASK from the head: greedy ones mlx-lm's, the seeded one the one-at-a-time draws."""
    got = in_ns(
        cluster.client, ASK, f"http://{head.ip}:{HTTP}", model.name, MAX_TOKENS, json.dumps(SEEDED), timeout=300
    )
    assert got == {"greedy": texts["greedy"], "greedy_stream": texts["greedy"], "seeded": texts["seeded"]}, (
        cluster.logs()
    )


def check_speculated(cluster, heads, filled: bool) -> None:
    """``heads``: the node, or nodes (summed), that headed the requests; ``filled``: they sent passes
    of guesses behind the one in flight (remote stages), and a rejection cancelled some."""
    heads = heads if isinstance(heads, list) else [heads]
    metrics = [node_metrics(cluster, h) for h in heads]
    drafted, accepted, passes, cancelled = (
        sum(counter(m, f"meshnode_speculative_{name}") for m in metrics)
        for name in ("drafted_tokens", "accepted_tokens", "passes", "cancelled_passes")
    )
    print(
        f"speculative passes {passes:.0f}, guesses {drafted:.0f}, confirmed {accepted:.0f}, cancelled {cancelled:.0f}"
    )
    assert passes > 0 and 0 < accepted < drafted, (passes, drafted, accepted)  # confirmed and rejected guesses
    assert (cancelled > 0) == filled, cancelled
    views = [cluster.mesh_view(h)["metrics"]["speculation"] for h in heads]
    assert sum(v["passes"] for v in views) == passes, views
    assert sum(v["cancelled"] for v in views) == cancelled, views
    # What the head measured of its passes (meshnode.serving.draft_length.PassCosts). (A fixed k
    # sends a pass behind each lone one at once: no traversal is timed, no share measured.)
    assert any(v["position_cost"] is not None for v in views), views
    assert any(re.search(r"^meshnode_speculative_filled_share [0-9.e-]+$", m, re.M) for m in metrics)


def check_filled_share(cluster, head, model, answers, texts, tmp_path) -> None:
    """A greedy request with every guess right, two a pass: passes go behind the one in flight, and
    the head shows their time apart against a traversal of their size (PassCosts.filled_share,
    priced from the steps and passes it timed before). Two a pass, not the head's own k: where it
    measures guesses nearly free it guesses eight, and this model's short answer may then leave no
    room for a pass behind. The nodes' drafts file (drafts_file's, in ``tmp_path``) is
    written again for it."""
    drafts_file(tmp_path, model, answers, p=1.0, k=2)
    assert cluster.chat(head, MESSAGES, MAX_TOKENS) == texts["greedy"]
    view = cluster.mesh_view(head)["metrics"]["speculation"]
    assert view["filled_share"] is not None and 0 < view["filled_share"] < 2, view
    print(
        f"the head measured: a further position {view['position_cost']} of a step, "
        f"a full pipeline's share of a traversal {view['filled_share']}"
    )


@pytest.mark.parametrize(
    "family,quantize,fast_hops",
    [("llama", None, True), ("qwen3_moe", None, False), ("llama", "4bit", True)],
    ids=["llama-dataport", "qwen3_moe-grpc", "llama-4bit"],
)
def test_two_stages_speculate_with_rejections_and_answer_as_one_token_at_a_time(family, quantize, fast_hops, tmp_path):
    model = build_model(
        tmp_path / family,
        family,
        num_layers=6,
        hidden_size=64,
        intermediate_size=128,
        dtype="float32",
        quantize=quantize,
        seed=4,
    )
    texts, answers = references(model, MAX_TOKENS)
    # The 4-bit case runs with the default setting ("auto": on, where the model is split).
    env, drafts = drafts_file(tmp_path, model, answers, mode=None if quantize else "prompt_lookup")
    env.update({"MESHNODE_STRATEGY": "pipeline", "MESHNODE_FAST_HOPS": str(fast_hops).lower()})
    total = profile_model(model).total_bytes(1024)
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=1024)
        for h in cluster.hosts:  # neither holds it alone: two stages
            cluster.start(h, int(total * 0.6), env=env, drafts=drafts)
        view = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 90, "convergence")[0]
        assert len(view["plan"]["stages"]) == 2, view["plan"]
        head = cluster.host(view["plan"]["stages"][-1]["nodes"][0])
        ask_and_compare(cluster, head, model, texts)
        check_speculated(cluster, head, filled=True)
        check_filled_share(cluster, head, model, answers, texts, tmp_path)


def test_tensor_pair_speculates_and_answers_as_mlx_lm(tmp_path):
    model = build_model(
        tmp_path / "llama",
        "llama",
        num_layers=6,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        dtype="float32",
        seed=5,
    )
    texts, answers = references(model, MAX_TOKENS)
    env, drafts = drafts_file(tmp_path, model, answers)
    env["MESHNODE_STRATEGY"] = "tensor"
    total = profile_model(model).total_bytes(512)
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path)
        for h in cluster.hosts:
            cluster.start(h, int(total * 2), env=env, drafts=drafts)
        view = cluster.wait(
            lambda: (v := cluster.converged(cluster.hosts, 2)) and v[0]["plan"]["strategy"] == "tensor" and v,
            90,
            "a tensor plan",
        )[0]
        head = cluster.host(view["plan"]["stages"][-1]["nodes"][0])
        ask_and_compare(cluster, head, model, texts)
        check_speculated(cluster, head, filled=False)  # one stage (both nodes in it): nothing to fill


def test_a_stage_killed_mid_speculation_replays_to_the_same_output(tmp_path):
    model = build_model(
        tmp_path / "llama", "llama", num_layers=8, hidden_size=128, intermediate_size=256, dtype="float32", seed=3
    )
    max_tokens = 200
    texts, answers = references(model, max_tokens)
    assert len(texts["greedy"]) > 100, "too short to fault in the middle"
    env, drafts = drafts_file(tmp_path, model, answers, p=0.8)
    env["MESHNODE_STRATEGY"] = "pipeline"
    profile = profile_model(model)
    total = profile.total_bytes(512)
    seed = tmp_path / "seed"  # the same compute figures on every node, so that the plan does not follow
    seed_figures(model, profile.num_layers, seed, rounds=1)  # each node's timing on busy cores
    with netns_mesh(3) as mesh:
        cluster = Cluster(mesh, model, tmp_path, seed=seed)
        for h in cluster.hosts:
            cluster.start(h, int(total * 0.6), env=env, drafts=drafts)
        view = cluster.wait(lambda: cluster.converged(cluster.hosts, 3), 60, "convergence")[0]
        stages = stage_nodes(view)
        first, head = stages[0], stages[-1]
        text, faulted = read_stream(
            cluster.stream(cluster.host(head), MESSAGES, max_tokens), fault=lambda: mesh.kill(cluster.procs[first])
        )
        assert faulted
        assert text == texts["greedy"], cluster.logs()
        seeded, _ = read_stream(cluster.stream(cluster.host(head), MESSAGES, max_tokens, **SEEDED))
        assert seeded == texts["seeded"], cluster.logs()
        after = cluster.mesh_view(cluster.host(head))
        assert after["epoch"] > view["epoch"] and first not in stage_nodes(after)
        # The new plan's head may be another node: every node left may have headed a part.
        check_speculated(cluster, [h for h in cluster.hosts if h.name != first], filled=True)


def test_a_draft_model_on_the_head_guesses_for_two_stages(tmp_path):
    """speculative = "draft_model": each node loads the draft whole (here the served model itself, so
    every guess is confirmed), offers that much less memory, and the answers are mlx-lm's."""
    model = build_model(
        tmp_path / "llama", "llama", num_layers=6, hidden_size=64, intermediate_size=128, dtype="float32", seed=4
    )
    texts, _ = references(model, MAX_TOKENS)
    total = profile_model(model).total_bytes(1024)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    budget = weights + int(total * 0.6)  # after the draft's weights, neither holds the model alone
    # Four guesses every pass, whatever guessing costs on this machine (the head would otherwise
    # measure that a guess costs about a step here and may stop guessing, which is its job).
    fixed = tmp_path / "fixed-k.json"
    fixed.write_text(json.dumps({"k": 4}))
    env = {"MESHNODE_STRATEGY": "pipeline", "MESHNODE_SPECULATIVE": "draft_model", "MESHNODE_DRAFT_MODEL": str(model)}
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=1024)
        for h in cluster.hosts:
            cluster.start(h, budget, env=env, drafts=fixed)
        view = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 90, "convergence")[0]
        assert len(view["plan"]["stages"]) == 2, view["plan"]
        for node in view["nodes"]:  # the draft's weights (the file less its header) are off what each node offers
            assert abs(node["memory_budget"] - (budget - weights)) < 64 << 10, (node["memory_budget"], budget, weights)
        head = cluster.host(view["plan"]["stages"][-1]["nodes"][0])
        ask_and_compare(cluster, head, model, texts)
        # A greedy answer: the draft (the same model) guesses every token right. (A seeded draw is
        # not the draft's greedy guess, so the seeded answer above had rejections.)
        before = node_metrics(cluster, head)
        assert cluster.chat(head, MESSAGES, MAX_TOKENS) == texts["greedy"]
        after = node_metrics(cluster, head)
        drafted, accepted = (
            counter(after, f"meshnode_speculative_{k}_tokens") - counter(before, f"meshnode_speculative_{k}_tokens")
            for k in ("drafted", "accepted")
        )
        assert drafted > 0 and accepted == drafted, (drafted, accepted)
