"""Several models on one mesh (real nodes on namespace hosts): nodes started with different model
lists under one key form one mesh that serves the union; each model gets its own plan, the plans
together fit every node's budget, and concurrent requests to both models (the openai package)
answer exactly as mlx_lm.generate on each whole model; models load on demand, are added and
removed at run time, and re-plan on their own when a node dies."""

from __future__ import annotations

import json

import pytest

from harness.cluster import HTTP, Cluster, in_ns, mlx_reference, read_stream, wait_until
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model
from tests.helpers import CONCURRENT_CHATS

pytestmark = [pytest.mark.netns, pytest.mark.timeout(420)]

MAX_TOKENS = 24
LONG = 64  # a streamed answer long enough to be cut by a fault


def _serving(view: dict, models: set[str]) -> bool:
    states = {m["model"]: m for m in view.get("models", [])}
    return models <= states.keys() and all(states[m]["healthy"] for m in models)


def test_nodes_with_different_model_lists_serve_the_union_each_as_mlx_lm(tmp_path):
    # About the same size (so the budget below makes each need two nodes): bf16, and 4-bit over float32.
    a = build_model(
        tmp_path / "chat-llama", "llama", num_layers=6, hidden_size=64, intermediate_size=128, dtype="bfloat16", seed=3
    )
    b = build_model(
        tmp_path / "coder-qwen3",
        "qwen3",
        num_layers=6,
        hidden_size=64,
        intermediate_size=128,
        dtype="float32",
        quantize="4bit",
        seed=5,
    )
    prompts = {
        a.name: ["Tell me about the sea.", "Why is the sky blue?"],
        b.name: ["Write a poem about autumn.", "How do rivers reach the ocean?"],
    }
    references = {
        (m, p): mlx_reference(path, [{"role": "user", "content": p}], MAX_TOKENS)
        for m, path in ((a.name, a), (b.name, b))
        for p in prompts[m]
    }
    sizes = [profile_model(m).total_bytes(512) for m in (a, b)]
    budget = int(max(sizes) * 0.8)  # neither model fits one node; both fit the three
    assert budget < min(sizes) and sum(sizes) < 3 * budget * 0.9, (sizes, budget)
    with netns_mesh(3) as mesh:
        cluster = Cluster(mesh, a, tmp_path, max_context=512)
        env = {"MESHNODE_STRATEGY": "pipeline"}
        h1, h2, h3 = cluster.hosts
        cluster.start(h1, budget, env=env, model=a)  # a: offers the llama only
        cluster.start(h2, budget, env=env, model=b)  # b: the qwen3 only
        cluster.start(h3, budget, env={**env, "MESHNODE_MODELS": f"{a},{b}"}, model=a)  # c: both
        models = {a.name, b.name}
        views = wait_until(
            lambda: (
                (vs := [cluster.mesh_view(h) for h in cluster.hosts]) and all(_serving(v, models) for v in vs) and vs
            ),
            150,
            "both models served",
            details=cluster.logs,
        )
        # Each model has its own plan; every node holds no more than its budget for both together.
        plans = {m["model"]: m["plan"] for m in views[0]["models"]}
        held: dict[str, int] = {}
        for plan in plans.values():
            assert len(plan["stages"]) >= 2, plans  # neither fits one node
            for stage in plan["stages"]:
                for node in stage["nodes"]:
                    held[node] = held.get(node, 0) + stage["bytes"]
        print(
            json.dumps(
                {m: [(s["start_layer"], s["end_layer"], s["nodes"]) for s in p["stages"]] for m, p in plans.items()}
            ),
            held,
            budget,
        )
        assert all(held[n] <= budget for n in held), (held, budget)
        for view in views[1:]:  # every node follows the same plans
            assert {m["model"]: m["plan"]["stages"] for m in view["models"]} == {
                m: p["stages"] for m, p in plans.items()
            }
        asks = [(m, p) for m in sorted(prompts) for p in prompts[m]]
        out = in_ns(
            cluster.client, CONCURRENT_CHATS, f"http://{h2.ip}:{HTTP}", json.dumps(asks), MAX_TOKENS, timeout=300
        )
        assert out["models"] == sorted(models)
        assert out["answers"] == [references[ask] for ask in asks], cluster.logs()


def _states(cluster, host) -> dict[str, str]:
    return {m["id"]: m["state"] for m in cluster.fetch(f"http://{host.ip}:{HTTP}/v1/models")[2]["data"]}


def _plan_of(cluster, host, model: str) -> dict:
    return next((m.get("plan") or {} for m in cluster.mesh_view(host)["models"] if m["model"] == model), {})


def _ask(cluster, host, model: str, prompt: str) -> tuple[int, dict]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    status, _, out = cluster.fetch(f"http://{host.ip}:{HTTP}/v1/chat/completions", body, timeout=200)
    return status, out


def test_a_model_requested_on_demand_evicts_the_least_recently_used_idle_one(tmp_path):
    """Three models of which two fit at once, and one that fits nowhere: the third is loaded when
    asked (the idle one used longest ago makes room), the evicted one comes back when asked, and
    the one too big for the mesh is refused with a 503 that says so."""
    specs = {"a-llama": ("llama", 3), "b-qwen3": ("qwen3", 5), "c-llama": ("llama", 7)}
    paths = {
        name: build_model(
            tmp_path / name, family, num_layers=6, hidden_size=64, intermediate_size=128, dtype="bfloat16", seed=seed
        )
        for name, (family, seed) in specs.items()
    }
    big = build_model(
        tmp_path / "d-big", "llama", num_layers=8, hidden_size=256, intermediate_size=512, dtype="float32", seed=9
    )
    prompt = "Tell me about the sea."
    references = {
        name: mlx_reference(path, [{"role": "user", "content": prompt}], MAX_TOKENS) for name, path in paths.items()
    }
    sizes = {name: profile_model(path).total_bytes(512) for name, path in paths.items()}
    budget = int(sum(sizes.values()) / 3 * 0.9)  # any two fit the three nodes, never all three
    assert profile_model(big).total_bytes(512) > 3 * budget
    with netns_mesh(3) as mesh:
        cluster = Cluster(mesh, paths["a-llama"], tmp_path, max_context=512)
        h1, h2, h3 = cluster.hosts
        env = {"MESHNODE_STRATEGY": "pipeline"}
        cluster.start(h1, budget, env={**env, "MESHNODE_MODELS": str(paths["b-qwen3"])}, model=paths["a-llama"])
        cluster.wait(lambda: cluster.mesh_view(h1)["coordinator"], 90, "the first node up")  # h1 coordinates
        cluster.start(h2, budget, env=env, model=paths["c-llama"])
        cluster.start(h3, budget, env={**env, "MESHNODE_MODELS": str(big)}, model=paths["a-llama"])

        def settled():  # a-llama (the coordinator's first) placed; one of the others on demand
            states = [_states(cluster, h) for h in cluster.hosts]
            first = states[0]
            ok = (
                all(s == first for s in states)
                and first.get("a-llama") == "ready"
                and first.get("d-big") == "does not fit"
                and sorted([first.get("b-qwen3"), first.get("c-llama")]) == ["on demand", "ready"]
            )
            return ok and first

        first = cluster.wait(settled, 150, "a-llama ready, one of b-qwen3 and c-llama on demand")
        # Which one waits depends on when the nodes joined (two nodes had room for one beside a-llama).
        x, y = ("b-qwen3", "c-llama") if first["b-qwen3"] == "on demand" else ("c-llama", "b-qwen3")
        ready = {"a-llama": "ready", "d-big": "does not fit"}

        status, out = _ask(cluster, h2, "a-llama", prompt)  # a-llama used: y is now the least recent
        assert status == 200 and out["choices"][0]["message"]["content"] == references["a-llama"], out
        status, out = _ask(cluster, h3, x, prompt)  # loaded on demand, in y's room
        assert status == 200 and out["choices"][0]["message"]["content"] == references[x], out
        assert _states(cluster, h1) == {**ready, x: "ready", y: "on demand"}
        status, out = _ask(cluster, h1, y, prompt)  # back, in a-llama's room (used before x)
        assert status == 200 and out["choices"][0]["message"]["content"] == references[y], out
        assert _states(cluster, h2) == {**ready, "a-llama": "on demand", x: "ready", y: "ready"}
        status, out = _ask(cluster, h2, "a-llama", prompt)
        assert status == 200 and out["choices"][0]["message"]["content"] == references["a-llama"], out

        status, out = _ask(cluster, h2, "d-big", prompt)
        assert status == 503 and "does not fit" in out["error"]["message"], out
        view = cluster.mesh_view(h1)
        held: dict[str, int] = {}
        for m in view["models"]:
            for stage in (m["plan"] or {}).get("stages", []):
                for node in stage["nodes"]:
                    held[node] = held.get(node, 0) + stage["bytes"]
        assert all(v <= budget for v in held.values()), (held, budget)


def _models_cli(host, *args) -> str:
    """``meshnode models ...`` inside ``host``, against its own node over loopback (admin calls need
    an API key or this machine)."""
    import sys

    out = host.run(
        [sys.executable, "-m", "meshnode.cli", "models", *map(str, args), "--url", f"http://127.0.0.1:{HTTP}"],
        timeout=120,
    )
    return out.stdout


def test_a_model_added_at_run_time_is_served_and_each_model_replans_on_its_own_when_a_node_dies(tmp_path):
    """`meshnode models add` on one node makes the mesh serve a second model beside the first; a node
    of only the second model's plan dies while it streams: the stream goes on to the same text, the
    first model keeps its plan (same epoch, never interrupted), the second re-plans on the
    survivors, and both still answer as mlx_lm.generate; `meshnode models remove` stops serving it."""
    small = build_model(
        tmp_path / "small-llama",
        "llama",
        num_layers=4,
        hidden_size=64,
        intermediate_size=128,
        dtype="bfloat16",
        quantize="4bit",
        seed=11,
    )
    big = build_model(
        tmp_path / "big-qwen3",
        "qwen3_moe",
        num_layers=6,
        hidden_size=64,
        intermediate_size=128,
        dtype="float32",
        seed=12,
    )  # (MLX's CPU GatherMM, for MoE experts, is float32 only)
    prompt = "Why is the sky blue?"
    references = {p.name: mlx_reference(p, [{"role": "user", "content": prompt}], MAX_TOKENS) for p in (small, big)}
    long_reference = mlx_reference(big, [{"role": "user", "content": prompt}], LONG)
    t_small, t_big = profile_model(small).total_bytes(512), profile_model(big).total_bytes(512)
    budget = int(t_big * 0.75)  # the big one needs two nodes; after one dies, the two left hold both
    assert t_small < 0.4 * t_big, (t_small, t_big)
    with netns_mesh(3) as mesh:
        cluster = Cluster(mesh, small, tmp_path, max_context=512)
        h1, h2, h3 = cluster.hosts
        env = {"MESHNODE_STRATEGY": "pipeline"}
        cluster.start(h1, budget, env=env)
        cluster.wait(lambda: cluster.mesh_view(h1)["coordinator"], 90, "the first node up")  # h1 coordinates
        cluster.start(h2, budget, env=env)
        cluster.start(h3, budget, env=env)
        cluster.wait(
            lambda: all(_states(cluster, h) == {small.name: "ready"} for h in cluster.hosts),
            120,
            "the first model served",
        )
        # Planned while h1 was alone, the small model is served whole there; once the others are in,
        # the coordinator moves it to the configured pipeline, rebalance_dwell after that first plan.
        # Waited for here: else that move could come while the victim dies, and look like a re-plan
        # the death caused.
        cluster.wait(
            lambda: all(_plan_of(cluster, h, small.name).get("strategy") == "pipeline" for h in cluster.hosts),
            60,
            "the small model on the configured pipeline",
        )
        assert "offered by this node" in _models_cli(h1, "add", big)
        both = {small.name: "ready", big.name: "ready"}
        cluster.wait(lambda: all(_states(cluster, h) == both for h in cluster.hosts), 120, "both models served")
        listing = _models_cli(h3, "list")
        assert small.name in listing and big.name in listing and "ready" in listing, listing

        plans = {m["model"]: m for m in cluster.mesh_view(h1)["models"]}
        small_nodes = {n for s in plans[small.name]["plan"]["stages"] for n in s["nodes"]}
        big_nodes = [n for s in plans[big.name]["plan"]["stages"] for n in s["nodes"]]
        assert len(big_nodes) >= 2, plans
        # The victim: a node of the big model's plan (not the one the client talks to), one holding
        # none of the small model's layers where the plans have one. With the pipeline preferred,
        # the small model may be split over two nodes and the big one over those two: then both
        # models lose a node, and each must re-plan on its own.
        candidates = [n for n in big_nodes if n != "node-h0"]
        victim = next((n for n in candidates if n not in small_nodes), candidates[0])
        small_hit = victim in small_nodes
        # A generation of the big model in flight when the victim dies goes on (replayed on the new plan).
        stream = cluster.stream(h1, [{"role": "user", "content": prompt}], LONG, model=big.name)
        text, faulted = read_stream(stream, fault=lambda: mesh.kill(cluster.procs[victim]), after_chunks=8)
        assert faulted and text == long_reference, (text, long_reference)
        alive = [h for h in cluster.hosts if h.name != victim]

        def replanned():
            views = [{m["model"]: m for m in cluster.mesh_view(h)["models"]} for h in alive]
            return (
                all(
                    v[big.name]["epoch"] > plans[big.name]["epoch"]
                    and v[big.name]["state"] == "ready"
                    and v[small.name]["state"] == "ready"
                    and (not small_hit or v[small.name]["epoch"] > plans[small.name]["epoch"])
                    for v in views
                )
                and views
            )

        views = cluster.wait(replanned, 90, f"{big.name} re-planned without {victim}")
        for v in views:  # the small model moved only if it lost a node too
            if small_hit:
                assert victim not in {n for s in v[small.name]["plan"]["stages"] for n in s["nodes"]}, v
            else:
                assert v[small.name]["epoch"] == plans[small.name]["epoch"], v
            assert victim not in {n for s in v[big.name]["plan"]["stages"] for n in s["nodes"]}
        print(
            f"victim {victim}: small model plan {sorted(small_nodes)}, big {big_nodes}, small re-planned: {small_hit}"
        )
        out = in_ns(
            cluster.client,
            CONCURRENT_CHATS,
            f"http://{alive[-1].ip}:{HTTP}",
            json.dumps([[small.name, prompt], [big.name, prompt]]),
            MAX_TOKENS,
            timeout=300,
        )
        assert out["answers"] == [references[small.name], references[big.name]], cluster.logs()

        assert "no longer offered" in _models_cli(h1, "remove", big.name)
        cluster.wait(
            lambda: all(_states(cluster, h) == {small.name: "ready"} for h in alive), 60, f"{big.name} no longer served"
        )
        big_now = {m["model"]: m for m in cluster.mesh_view(h1)["models"]}[big.name]
        assert big_now["plan"]["stages"] == [], big_now  # unloaded everywhere: its memory is free
