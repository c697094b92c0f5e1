"""The mesh on real hosts: network namespaces on a bridge, one `meshnode run` per host.

Three hosts with different budgets and a model no single node can hold converge on one
coordinator and epoch, split the layers by memory, and answer exactly like mlx_lm.generate
through every node. Static peers work with multicast blocked; another cluster key is never
joined; a stopped node leads to a new plan.
"""

from __future__ import annotations

import time

import pytest

from harness.cluster import GRPC, Cluster
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

MESSAGES = [{"role": "user", "content": "Where do rivers go?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(
        tmp_path_factory.mktemp("mesh") / "llama",
        "llama",
        num_layers=8,
        hidden_size=128,
        intermediate_size=256,
        dtype="float32",
    )


@pytest.fixture(scope="module")
def reference(model):
    from mlx_lm import generate, load

    m, tok = load(str(model))
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    return generate(m, tok, prompt=prompt, max_tokens=16)


def build(mesh, model, tmp):
    return Cluster(mesh, model, tmp, max_context=256)


def test_three_hosts_split_by_memory_and_answer_like_mlx_lm(model, reference, tmp_path):
    profile = profile_model(model)
    total = profile.total_bytes(256)
    budgets = [int(total * f) for f in (0.45, 0.38, 0.32)]  # no one or two hold it: all three needed
    with netns_mesh(3) as mesh:
        t0 = time.monotonic()
        cluster = build(mesh, model, tmp_path)
        for h, b in zip(cluster.hosts, budgets):
            cluster.start(h, b)
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, 3), 30, "convergence")
        took = time.monotonic() - t0
        plan = views[0]["plan"]
        stages = plan["stages"]
        assert plan["strategy"] == "pipeline" and len(stages) == 3
        assert stages[0]["start_layer"] == 0 and stages[-1]["end_layer"] == profile.num_layers
        assert all(a["end_layer"] == b["start_layer"] for a, b in zip(stages, stages[1:]))
        layers = {s["nodes"][0]: s["end_layer"] - s["start_layer"] for s in stages}
        budget_of = {h.name: b for h, b in zip(cluster.hosts, budgets)}
        by_budget = sorted(layers, key=lambda n: -budget_of[n])
        assert [layers[n] for n in by_budget] == sorted(layers.values(), reverse=True)
        for h in cluster.hosts:
            assert cluster.chat(h, MESSAGES, 16) == reference, h.name
        # How fast is a figure, not a test (a busy 2-core machine starts three Python processes
        # slower): the wait above bounds it; this prints it.
        print(f"converged in {took:.1f} s (process start-up included): {stages}")


def test_static_peers_without_multicast_and_other_key_ignored_and_stop_replans(model, reference, tmp_path):
    total = profile_model(model).total_bytes(256)
    with netns_mesh(4) as mesh:
        a, b, d, c = mesh.hosts
        for h in mesh.hosts:
            h.block_multicast()
        cluster = build(mesh, model, tmp_path)
        budget = int(total * 0.6)  # two nodes needed, any two suffice
        cluster.start(a, budget, mdns=False, peers=[f"{b.ip}:{GRPC}"])
        cluster.start(b, budget, mdns=False, peers=[f"{d.ip}:{GRPC}"])
        cluster.start(d, budget, mdns=False, peers=[f"{a.ip}:{GRPC}"])
        cluster.start(c, int(total * 2), key="another-key", mdns=False, peers=[f"{a.ip}:{GRPC}", f"{b.ip}:{GRPC}"])
        views = cluster.wait(lambda: cluster.converged([a, b, d], 3), 30, "convergence over static peers")
        assert {n["node_id"] for n in views[0]["nodes"]} == {a.name, b.name, d.name}
        plan = views[0]["plan"]
        # Two of the three serve: a two-stage pipeline, or a tensor pair where this run's measured
        # compute and links make the planner prefer one (it decides from measurements).
        assert sum(len(s["nodes"]) for s in plan["stages"]) == 2, plan
        assert cluster.chat(a, MESSAGES, 16) == reference
        # c (another key) serves alone and is never listed by the others
        vc = cluster.wait(lambda: (v := cluster.mesh_view(c))["healthy"] and v, 30, "c alone")
        assert [n["node_id"] for n in vc["nodes"]] == [c.name]
        for h in (a, b, d):
            assert c.name not in {n["node_id"] for n in cluster.mesh_view(h)["nodes"]}
        # stop a node of the plan (SIGTERM): the survivors re-plan with a higher epoch and still answer
        victim = plan["stages"][-1]["nodes"][0]
        survivors = [h for h in (a, b, d) if h.name != victim]
        mesh.stop(cluster.procs[victim])
        # (45 s: the new plan may be a tensor pair, whose worker processes start from scratch, slowly
        # on a loaded machine)
        after = cluster.wait(
            lambda: (v := cluster.converged(survivors, 2)) and v[0]["epoch"] > views[0]["epoch"] and v,
            45,
            "re-plan after a graceful stop",
        )
        assert victim not in {n for s in after[0]["plan"]["stages"] for n in s["nodes"]}
        assert cluster.chat(survivors[0], MESSAGES, 16) == reference
