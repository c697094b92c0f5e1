"""The mesh on real hosts: network namespaces on a bridge, one `meshnode run` per host.

Three hosts with different budgets and a model no single node can hold converge on one
coordinator and epoch, split the layers by memory, and answer exactly like mlx_lm.generate
through every node. Static peers work with multicast blocked; another cluster key is never
joined; a stopped node leads to a new plan.
"""

from __future__ import annotations

import json
import sys
import os
import time
from pathlib import Path

import pytest

from meshnode.data.profile import profile_model
from meshnode.modelbuild import build_model
from tests.netns import netns_mesh

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

KEY = "test-cluster-key-1"
MESSAGES = [{"role": "user", "content": "Where do rivers go?"}]
HTTP, GRPC = 8470, 8471


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("mesh") / "llama", "llama", num_layers=8, hidden_size=128,
                       intermediate_size=256, dtype="float32")


@pytest.fixture(scope="module")
def reference(model):
    from mlx_lm import generate, load

    m, tok = load(str(model))
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    return generate(m, tok, prompt=prompt, max_tokens=16)


# The test process lives outside the namespaces: every request is made from the mesh's client
# host, so no packet for 198.18.x.y ever leaves through this machine's own network.
CLIENT = None


def _fetch(url: str, body: dict | None, timeout: float):
    code = ("import json,sys,urllib.request\n"
            "url,body,t=sys.argv[1],sys.argv[2],float(sys.argv[3])\n"
            "req=urllib.request.Request(url,data=body.encode() if body else None,"
            "headers={'Content-Type':'application/json'})\n"
            "print(urllib.request.urlopen(req,timeout=t).read().decode())")
    out = CLIENT.run([sys.executable, "-c", code, url, json.dumps(body) if body else "", str(timeout)],
                     timeout=timeout + 10, check=False)
    if out.returncode != 0:
        raise OSError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "request failed")
    return json.loads(out.stdout)


def get(url: str, timeout: float = 3.0):
    return _fetch(url, None, timeout)


def chat(url: str, model_id: str, timeout: float = 60.0) -> str:
    body = {"model": model_id, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    return _fetch(f"{url}/v1/chat/completions", body, timeout)["choices"][0]["message"]["content"]


@pytest.fixture
def client_host():
    def attach(mesh):
        global CLIENT
        CLIENT = mesh.add_host("client")
        return CLIENT

    yield attach


def start(host, model: Path, tmp: Path, budget: int, *, key: str = KEY, peers=(), mdns=True, node_id=None):
    state = tmp / host.name
    state.mkdir(exist_ok=True)
    args = [sys.executable,
            "-m", "meshnode.cli", "run", "--model", str(model), "--host", "0.0.0.0",
            "--http-port", str(HTTP), "--grpc-port", str(GRPC), "--node-id", node_id or host.name,
            "--memory-budget", str(budget), "--state-dir", str(state), "--cache-dir", str(tmp / "cache"),
            "--max-context", "256", "--log-level", "INFO"]
    for p in peers:
        args += ["--peer", p]
    if not mdns:
        args.append("--no-mdns")
    return host.popen(args, env={**os.environ, "MESHNODE_CLUSTER_KEY": key}, log_path=state / "node.log")


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except OSError as exc:
            last = exc
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def converged(hosts, min_nodes: int):
    views = [get(f"http://{h.ip}:{HTTP}/v1/mesh") for h in hosts]
    epochs = {v["epoch"] for v in views}
    coords = {v["coordinator"] for v in views}
    if len(epochs) == 1 and len(coords) == 1 and all(v["healthy"] for v in views) and \
            all(len(v["nodes"]) >= min_nodes for v in views) and views[0]["plan"]:
        return views
    return None


def logs(tmp: Path) -> str:
    return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*/node.log")))


def test_three_hosts_split_by_memory_and_answer_like_mlx_lm(model, reference, tmp_path, client_host):
    profile = profile_model(model)
    total = profile.total_bytes(256)
    budgets = [int(total * f) for f in (0.45, 0.38, 0.32)]  # no one or two hold it: all three needed
    with netns_mesh(3) as mesh:
        hosts = list(mesh.hosts)
        client_host(mesh)
        procs = [start(h, model, tmp_path, b) for h, b in zip(hosts, budgets)]
        try:
            t0 = time.monotonic()
            views = wait_for(lambda: converged(hosts, 3), 30, "convergence")
            took = time.monotonic() - t0
            plan = views[0]["plan"]
            stages = plan["stages"]
            assert plan["strategy"] == "pipeline" and len(stages) == 3
            assert stages[0]["start_layer"] == 0 and stages[-1]["end_layer"] == profile.num_layers
            assert all(a["end_layer"] == b["start_layer"] for a, b in zip(stages, stages[1:]))
            layers = {s["nodes"][0]: s["end_layer"] - s["start_layer"] for s in stages}
            by_budget = sorted(layers, key=lambda n: -budgets[[h.name for h in hosts].index(n)])
            assert [layers[n] for n in by_budget] == sorted(layers.values(), reverse=True)
            for h in hosts:
                assert chat(f"http://{h.ip}:{HTTP}", model.name) == reference, h.name
            print(f"converged in {took:.1f} s: {stages}")
            assert took <= 10 + 5  # 10 s target, plus start-up of three Python processes on 2 cores
        except BaseException:
            print(logs(tmp_path))
            raise
        finally:
            for p in procs:
                mesh.stop(p)


def test_static_peers_without_multicast_and_other_key_ignored_and_stop_replans(model, reference, tmp_path,
                                                                              client_host):
    profile = profile_model(model)
    total = profile.total_bytes(256)
    with netns_mesh(4) as mesh:
        a, b, d, c = mesh.hosts
        for h in mesh.hosts:
            h.block_multicast()
        client_host(mesh)
        budget = int(total * 0.6)  # two nodes needed, any two suffice
        procs = {
            a.name: start(a, model, tmp_path, budget, mdns=False, peers=[f"{b.ip}:{GRPC}"]),
            b.name: start(b, model, tmp_path, budget, mdns=False, peers=[f"{d.ip}:{GRPC}"]),
            d.name: start(d, model, tmp_path, budget, mdns=False, peers=[f"{a.ip}:{GRPC}"]),
            c.name: start(c, model, tmp_path, int(total * 2), key="another-key", mdns=False,
                          peers=[f"{a.ip}:{GRPC}", f"{b.ip}:{GRPC}"]),
        }
        try:
            views = wait_for(lambda: converged([a, b, d], 3), 30, "convergence over static peers")
            assert {n["node_id"] for n in views[0]["nodes"]} == {a.name, b.name, d.name}
            plan = views[0]["plan"]
            assert len(plan["stages"]) == 2
            assert chat(f"http://{a.ip}:{HTTP}", model.name) == reference
            # c (another key) serves alone and is never listed by the others
            vc = wait_for(lambda: (v := get(f"http://{c.ip}:{HTTP}/v1/mesh"))["healthy"] and v, 30, "c alone")
            assert [n["node_id"] for n in vc["nodes"]] == [c.name]
            for h in (a, b, d):
                assert c.name not in {n["node_id"] for n in get(f"http://{h.ip}:{HTTP}/v1/mesh")["nodes"]}
            # stop a node of the plan (SIGTERM): the survivors re-plan with a higher epoch and still answer
            victim = plan["stages"][-1]["nodes"][0]
            survivors = [h for h in (a, b, d) if h.name != victim]
            mesh.stop(procs[victim])
            after = wait_for(lambda: (v := converged(survivors, 2)) and v[0]["epoch"] > views[0]["epoch"] and v,
                             15, "re-plan after a graceful stop")
            assert victim not in {n for s in after[0]["plan"]["stages"] for n in s["nodes"]}
            assert chat(f"http://{survivors[0].ip}:{HTTP}", model.name) == reference
        except BaseException:
            print(logs(tmp_path))
            raise
        finally:
            for p in procs.values():
                mesh.stop(p)
