"""Peers announced over mDNS that never answer (macOS Local Network privacy, a firewall).

The bookkeeping with a made-up clock; then for real on namespace hosts: a node whose connections
to a peer are silently dropped (tc) and a real mDNS announcement of a port nothing listens on are
reported by that node's /v1/mesh, its log (once, with the hint) and `meshnode status` (exit 1);
a normal two-node mesh reports nothing (exit 0).
"""

from __future__ import annotations

import json
import logging
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.cluster import GRPC, HTTP, KEY, Cluster
from harness.netns import netns_mesh
from meshnode.control.reachability import HINT, Reachability
from meshnode.model.build import build_model

UNREACHABLE_LINE = "is announced over mDNS but has not answered"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_unreachable_only_after_grace_and_said_once():
    clock = Clock()
    r = Reachability(grace=10, clock=clock, hint_every=600)
    r.announced("b", "10.0.0.2:8471")
    r.failed("10.0.0.2:8471", "DEADLINE_EXCEEDED: Deadline Exceeded")
    clock.t += 9.9
    r.failed("10.0.0.2:8471", "DEADLINE_EXCEEDED: Deadline Exceeded")
    assert r.report() == [] and r.check() == []
    clock.t += 0.1
    assert r.report() == [
        {"node_id": "b", "address": "10.0.0.2:8471", "seconds": 10.0, "error": "DEADLINE_EXCEEDED: Deadline Exceeded"}
    ]
    ((level, message, fields),) = r.check()
    assert level == logging.WARNING and "peer b " + UNREACHABLE_LINE in message and HINT in message
    assert fields == {"node_id": "b", "address": "10.0.0.2:8471", "error": "DEADLINE_EXCEEDED: Deadline Exceeded"}
    clock.t += 30
    assert r.check() == []  # once per episode
    assert r.report()[0]["seconds"] == 40.0


def test_hint_is_rate_limited_across_peers():
    clock = Clock()
    r = Reachability(grace=5, clock=clock, hint_every=600)
    for nid in ("b", "c"):
        r.announced(nid, f"{nid}:1")
        r.failed(f"{nid}:1", "UNAVAILABLE: Connection refused")
    clock.t += 5
    messages = [m for _, m, _ in r.check()]
    assert len(messages) == 2 and sum(HINT in m for m in messages) == 1
    r.announced("d", "d:1")
    r.failed("d:1", "x")
    clock.t += 5
    assert HINT not in r.check()[0][1]  # within hint_every of the last hint
    r.announced("e", "e:1")
    r.failed("e:1", "x")
    clock.t += 600
    assert HINT in r.check()[0][1]


def test_an_answer_clears_it_and_is_said():
    clock = Clock()
    r = Reachability(grace=5, clock=clock)
    r.announced("b", "b:1")
    r.failed("b:1", "x")
    clock.t += 6
    assert len(r.check()) == 1
    r.answered("b:1")
    assert r.report() == []
    ((level, message, fields),) = r.check()
    assert level == logging.INFO and "peer b answers at b:1 again" in message and fields == {"node_id": "b"}
    assert r.check() == []
    r.failed("b:1", "y")  # a new episode starts from its first failure
    clock.t += 4
    assert r.report() == []
    clock.t += 1
    assert [p["node_id"] for p in r.report()] == ["b"] and len(r.check()) == 1


def test_only_announced_peers_count():
    clock = Clock()
    r = Reachability(grace=5, clock=clock)
    r.failed("static:1", "x")  # a --peer address nobody announces: the failure detector's business
    r.announced("b", "b:1")
    clock.t += 60
    assert r.report() == []  # announced, never tried: nothing failed
    r.failed("b:1", "x")
    clock.t += 5
    assert [p["node_id"] for p in r.report()] == ["b"]
    r.withdrawn("b")  # mDNS lost it too
    assert r.report() == [] and r.check() == []
    r.announced("b", "b:1")
    r.failed("b:1", "x")
    r.announced("b", "b:2")  # a new address: a fresh start
    clock.t += 5
    assert r.report() == []


# --------------------------------------------------------------------------- on namespace hosts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(
        tmp_path_factory.mktemp("reach") / "llama",
        "llama",
        num_layers=4,
        hidden_size=64,
        intermediate_size=128,
        dtype="float32",
    )


def _status(cluster, host, *extra):
    out = cluster.client.run(
        [sys.executable, "-m", "meshnode.cli", "status", "--url", f"http://{host.ip}:{HTTP}", *extra],
        check=False,
        timeout=30,
    )
    return out.returncode, out.stdout, out.stderr


def _unreachable_gauge(cluster, host) -> float:
    code = "import sys,urllib.request\nprint(urllib.request.urlopen(sys.argv[1],timeout=10).read().decode())\n"
    raw = cluster.client.run([sys.executable, "-c", code, f"http://{host.ip}:{HTTP}/metrics"], timeout=30).stdout
    (family,) = [f for f in text_string_to_metric_families(raw) if f.name == "meshnode_unreachable_peers"]
    return family.samples[0].value


def _unreachable(cluster, host) -> dict:
    return {p["node_id"]: p for p in cluster.mesh_view(host).get("unreachable", [])}


@pytest.mark.netns
@pytest.mark.timeout(180)
def test_blocked_and_dead_announced_peers_are_reported(model, tmp_path):
    """h0 cannot open connections to h1 (dropped, as macOS Local Network privacy or a firewall
    would), though h1 reaches h0; h2 announces a node over real mDNS whose port nothing listens on."""
    with netns_mesh(3, "reach") as mesh:
        h0, h1, h2 = mesh.hosts
        h0.drop_tcp_out(h1.ip, GRPC)
        cluster = Cluster(mesh, model, tmp_path, max_context=128)
        budget = 8 * 2**30  # each node holds the model alone
        cluster.start(h0, budget)
        cluster.start(h1, budget)
        ghost = h2.popen(
            [
                sys.executable,
                "-m",
                "meshnode.control.discovery",
                "--node-id",
                "ghost",
                "--cluster-key",
                KEY,
                "--grpc-port",
                str(GRPC),
                "--address",
                h2.ip,
                "--seconds",
                "150",
            ],
            log_path=tmp_path / "ghost.log",
        )

        views = cluster.wait(
            lambda: (
                set(_unreachable(cluster, h0)) == {"node-h1", "ghost"} and set(_unreachable(cluster, h1)) == {"ghost"}
            ),
            60,
            "h0 to report node-h1 and ghost unreachable, h1 to report ghost",
        )
        assert views
        bad = _unreachable(cluster, h0)
        assert bad["node-h1"]["address"] == f"{h1.ip}:{GRPC}" and bad["node-h1"]["seconds"] >= 10
        assert "DEADLINE_EXCEEDED" in bad["node-h1"]["error"] or "UNAVAILABLE" in bad["node-h1"]["error"]
        assert bad["ghost"]["address"] == f"{h2.ip}:{GRPC}" and "refused" in bad["ghost"]["error"].lower()
        assert _unreachable_gauge(cluster, h0) == 2 and _unreachable_gauge(cluster, h1) == 1

        # meshnode status, as a person runs it: exit 1, what is wrong and how to fix it
        rc, out, err = _status(cluster, h0)
        assert rc == 1, out + err
        assert "(meshnode " in out and "NOT healthy" in out
        assert f"peer node-h1 is announced over mDNS but does not answer at {h1.ip}:{GRPC}" in out
        assert "peer ghost is announced over mDNS" in out
        assert "Privacy & Security > Local Network" in out and "firewall" in out
        rc, out, _ = _status(cluster, h0, "--json")
        assert rc == 1 and {p["node_id"] for p in json.loads(out)["unreachable"]} == {"node-h1", "ghost"}

        # the log says it once per peer, and the hint once for both
        log = cluster.log(h0)
        assert log.count("peer node-h1 " + UNREACHABLE_LINE) == 1, log
        assert log.count("peer ghost " + UNREACHABLE_LINE) == 1, log
        assert log.count("Privacy & Security > Local Network") == 1, log
        assert "node-h0 " + UNREACHABLE_LINE not in cluster.log(h1)  # h1 reaches h0 fine

        # fixed: traffic flows, the ghost says goodbye over mDNS; h0 is healthy again
        h0.allow_tcp_out()
        mesh.stop(ghost)
        cluster.wait(
            lambda: not _unreachable(cluster, h0) and not _unreachable(cluster, h1),
            30,
            "the unreachable peers to clear",
        )
        cluster.wait(lambda: _status(cluster, h0)[0] == 0, 20, "status on h0 to exit 0")
        assert _unreachable_gauge(cluster, h0) == 0
        assert f"peer node-h1 answers at {h1.ip}:{GRPC} again" in cluster.log(h0)


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_a_normal_two_node_mesh_reports_nothing(model, tmp_path):
    with netns_mesh(2, "reachok") as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=128)
        for h in cluster.hosts:
            cluster.start(h, 8 * 2**30)
        cluster.wait(lambda: cluster.converged(cluster.hosts, 2), 40, "convergence")
        time.sleep(12)  # past the 10 s grace: a peer that did not answer would be reported by now
        for h in cluster.hosts:
            view = cluster.mesh_view(h)
            assert view["unreachable"] == [] and len(view["nodes"]) == 2, view
            rc, out, err = _status(cluster, h)
            assert rc == 0, out + err
            assert "health       ok: serving, every peer answers" in out and "Local Network" not in out
            rc, out, _ = _status(cluster, h, "--json")
            assert rc == 0 and json.loads(out)["unreachable"] == []
            assert _unreachable_gauge(cluster, h) == 0
            assert UNREACHABLE_LINE not in cluster.log(h)
