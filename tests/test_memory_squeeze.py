"""Memory the owner takes back is given back (issue 19), on real namespace hosts.

Three hosts each offer 0.6 of a model, so a plan needs two and one is spare. While a client keeps
asking, one stage's node is put in a memory cgroup limited to what it uses plus a little (as a
browser taking back gigabytes leaves the machine): the node sees that what it holds plus what is
free, less its margin, no longer covers its offer, lowers the offer at once, and the mesh moves its
layers to the spare, make before break. No OOM kill, every answer mlx-lm's. The limit lifted, the
node offers its memory again after ``memory_dwell``.

Isolation: the cgroup holds only that node's process (its pages moved with it). The hosts enter
only their network namespaces (``machine_sysfs``), so a node reads its cgroup's limit as a process
on a real machine does; every other test leaves the watch off, since their budgets stand for
machines other than this one.
"""

from __future__ import annotations

import time

import pytest

from harness import memlimit
from harness.cluster import Cluster, mlx_reference, node_view, stage_nodes
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.model.compute import seed_figures
from meshnode.weights.profile import profile_model

pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(300),
    pytest.mark.skipif(memlimit.available() is not None, reason=str(memlimit.available())),
]

MESSAGES = [{"role": "user", "content": "Tell me a story about the sea and the rivers."}]
TOKENS = 24
MIB = 2**20
MARGIN = 384 * MIB  # the machine keeps this free beyond what the node holds
HEADROOM = 256 * MIB  # what the squeezed node may still allocate: under the margin
DWELL = 5
ENV = {
    "MESHNODE_STRATEGY": "pipeline",
    "MESHNODE_MEMORY_MARGIN": str(MARGIN),
    "MESHNODE_MEMORY_DWELL": str(DWELL),
    "MESHNODE_REBALANCE_DWELL": str(DWELL),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(
        tmp_path_factory.mktemp("squeeze") / "llama",
        "llama",
        num_layers=8,
        hidden_size=256,
        intermediate_size=512,
        dtype="float32",
        seed=11,
    )


def test_memory_taken_back_moves_a_stage_off_without_an_oom_and_is_offered_again(model, tmp_path):
    want = mlx_reference(model, MESSAGES, TOKENS)
    seed = tmp_path / "seed"
    seed_figures(model, profile_model(model).num_layers, seed, rounds=1, tensor=False)
    total = profile_model(model).total_bytes(512)
    with netns_mesh(3) as mesh:
        for h in mesh.hosts:
            h.machine_sysfs = True
        cluster = Cluster(mesh, model, tmp_path, seed=seed)
        for h in cluster.hosts:
            cluster.start(h, int(total * 0.6), env=ENV)
        view = cluster.wait(lambda: cluster.converged(cluster.hosts, 3, stages=2), 60, "a 2-stage plan")[0]
        victim = stage_nodes(view)[0]
        spare = next(h for h in cluster.hosts if h.name not in stage_nodes(view))
        offered = node_view(view, victim)["memory_budget"]
        assert cluster.chat(spare, MESSAGES, TOKENS) == want
        proc = cluster.procs[victim]

        with memlimit.memory_cgroup(proc.pid) as cgroup:
            limit, t0, answers = cgroup.squeeze(HEADROOM), time.monotonic(), 0
            while time.monotonic() - t0 < 60:
                assert cluster.chat(spare, MESSAGES, TOKENS, timeout=90) == want, cluster.logs()
                answers += 1
                view = cluster.mesh_view(spare)
                if victim not in stage_nodes(view) and view["healthy"]:
                    break
            moved = time.monotonic() - t0
            assert victim not in stage_nodes(view), (view["plan"], cluster.logs())
            lowered = node_view(view, victim)["memory_budget"]
            assert lowered < offered, (lowered, offered)
            log = cluster.log(cluster.host(victim))
            assert "the machine took memory back" in log, log[-3000:]
            assert cgroup.oom_kills() == 0 and proc.poll() is None, "the squeezed node was OOM-killed"
            assert cgroup.usage() <= limit
            assert cluster.chat(spare, MESSAGES, TOKENS) == want
            print(f"{victim} offered {lowered} of {offered} bytes and was planned around after {moved:.1f} s")

            cgroup.lift()
            t1 = time.monotonic()
            cluster.wait(
                lambda: node_view(cluster.mesh_view(spare), victim)["memory_budget"] == offered,
                DWELL + 30,
                "the memory offered again",
            )
            print(f"{victim} offered its memory again {time.monotonic() - t1:.1f} s after the limit was lifted")
            assert "memory came back" in cluster.log(cluster.host(victim))
            assert cgroup.oom_kills() == 0 and proc.poll() is None
        assert cluster.chat(spare, MESSAGES, TOKENS) == want
