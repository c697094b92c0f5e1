"""mDNS discovery: TXT properties round trip, malformed announcements are skipped, peers/duplicates
bookkeeping (no network), and real zeroconf between network-namespace hosts."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from zeroconf.asyncio import AsyncServiceInfo

from harness.cluster import wait_until
from meshnode.control.discovery import SERVICE_TYPE, Discovery, NodeInfo

ME = NodeInfo(
    node_id="node-a",
    addresses=("198.18.0.10",),
    http_port=8470,
    grpc_port=8471,
    memory_budget=3 * 2**30,
    total_memory=16 * 2**30,
    compute=1.5,
    version="0.1.0",
    cluster_id="0123456789abcdef",
    models=("llama-8l",),
    started_at=1700000000.25,
)


def service_info(node: NodeInfo, *, name: str | None = None, properties=None, addresses=None) -> AsyncServiceInfo:
    return AsyncServiceInfo(
        SERVICE_TYPE,
        name or f"{node.node_id}.{SERVICE_TYPE}",
        port=node.grpc_port,
        properties=node.to_properties() if properties is None else properties,
        parsed_addresses=list(node.addresses if addresses is None else addresses),
    )


# ------------------------------------------------------------------------------------ unit tests
def test_properties_round_trip_ipv4_first():
    info = service_info(ME, addresses=["fd00::1", "198.18.0.10", "198.18.1.10"])
    node = NodeInfo.from_service_info(info)
    assert node == replace(ME, addresses=("198.18.0.10", "198.18.1.10", "fd00::1"))
    assert all(isinstance(v, str) for v in ME.to_properties().values())
    bare = replace(ME, models=(), started_at=0.0)
    assert NodeInfo.from_service_info(service_info(bare)) == bare


def test_models_that_do_not_fit_one_txt_entry_are_left_out():
    many = replace(ME, models=tuple(f"model-{i:03d}-" + "x" * 20 for i in range(20)))
    props = many.to_properties()
    assert len(f"models={props['models']}".encode()) <= 255
    node = NodeInfo.from_service_info(service_info(many))
    assert 0 < len(node.models) < 20 and node.models == many.models[: len(node.models)]


GOOD = ME.to_properties()


@pytest.mark.parametrize(
    "change",
    [
        {"id": None},
        {"http": None},
        {"grpc": None},
        {"budget": None},
        {"cluster": None},
        {"version": None},
        {"id": ""},
        {"id": "bad id!"},
        {"id": "x" * 64},
        {"grpc": "abc"},
        {"grpc": "0"},
        {"http": "70000"},
        {"budget": "-1"},
        {"total": "1.5"},
        {"compute": "nan"},
        {"compute": "inf"},
        {"compute": "-1"},
        {"started": "nan"},
        {"version": "1.0\nevil"},
        {"cluster": "c" * 65},
        {"models": "a,b\x01"},
        {"id": b"\xff\xfe"},
        {b"\xff": b"1"},
    ],
    ids=repr,
)
def test_malformed_announcements_are_skipped_and_logged(change, caplog):
    props = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with caplog.at_level(logging.WARNING, logger="meshnode.control.discovery"):
        assert NodeInfo.from_service_info(service_info(ME, properties=props)) is None
    assert "malformed" in caplog.text


@pytest.mark.parametrize(
    "raw", [b"", b"\x00", b"\xff\xff\xff", b"\x03a=b", b"\x05hello", b"\x10short", b"\x04id=x\x07grpc=99"]
)
def test_raw_garbage_txt_never_crashes(raw):
    assert NodeInfo.from_service_info(service_info(ME, properties=raw)) is None


def test_no_addresses_is_malformed():
    assert NodeInfo.from_service_info(service_info(ME, addresses=[])) is None


def make(node_id: str, **kw) -> NodeInfo:
    return replace(ME, node_id=node_id, **kw)


def name_of(node_id: str) -> str:
    return f"{node_id}.{SERVICE_TYPE}"


def test_peers_changes_foreign_clusters_and_duplicate_ids_without_network():
    changes = []
    disc = Discovery(ME, on_change=lambda node_id, info: changes.append((node_id, info)))
    b = make("node-b", addresses=("198.18.0.11",))
    disc._accept(name_of("node-b"), service_info(b))
    assert disc.peers() == {"node-b": b} and changes == [("node-b", b)]
    # the same announcement again: no change reported; a new budget: reported
    disc._accept(name_of("node-b"), service_info(b))
    b2 = replace(b, memory_budget=2**30)
    disc._accept(name_of("node-b"), service_info(b2))
    assert changes[1:] == [("node-b", b2)]
    # another cluster and malformed announcements are not peers
    disc._accept(name_of("node-x"), service_info(make("node-x", cluster_id="ffffffffffffffff")))
    disc._accept(name_of("junk"), service_info(ME, properties={"id": "junk"}))
    assert set(disc.peers()) == {"node-b"} and len(changes) == 2
    # someone else uses our id: reported, never a peer
    disc._accept(f"node-a (2).{SERVICE_TYPE}", service_info(make("node-a", addresses=("198.18.0.99",))))
    assert "node-a" in disc.duplicates and "node-a" not in disc.peers()
    # two other nodes share an id: the one that started first keeps it
    late = make("node-c", addresses=("198.18.0.13",), started_at=ME.started_at + 10)
    early = make("node-c", addresses=("198.18.0.12",), started_at=ME.started_at + 5)
    disc._accept(name_of("node-c"), service_info(late))
    disc._accept(f"node-c (2).{SERVICE_TYPE}", service_info(early))
    assert disc.peers()["node-c"] == early and "node-c" in disc.duplicates
    disc._forget(f"node-c (2).{SERVICE_TYPE}")
    assert disc.peers()["node-c"] == late
    disc._forget(name_of("node-c"))
    disc._forget(name_of("node-b"))
    assert disc.peers() == {} and changes[-2:] == [("node-c", None), ("node-b", None)]


def test_our_own_name_answered_from_elsewhere_is_a_duplicate():
    disc = Discovery(ME)
    disc._accept(disc.name, service_info(ME))  # our own records read back: fine
    assert disc.duplicates == {}
    disc._accept(disc.name, service_info(ME, addresses=["198.18.0.10", "198.18.0.77"]))
    assert "node-a" in disc.duplicates and disc.peers() == {}


# ---------------------------------------------------------------------- real mDNS between hosts
KEY = "discovery-test-key"


def start(host, log: Path, node_id: str, key: str = KEY, seconds: float = 60):
    cmd = [
        sys.executable,
        "-m",
        "meshnode.control.discovery",
        "--node-id",
        node_id,
        "--cluster-key",
        key,
        "--seconds",
        str(seconds),
    ]
    return host.popen(cmd, log_path=log, stdin=subprocess.PIPE)


def latest(log: Path) -> dict[str, dict]:
    reports = [e for e in events(log) if e["event"] == "peers"]
    return reports[-1]["peers"] if reports else {}


def events(log: Path) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def seen(log: Path) -> set[str]:
    """The peers a host lists now (its latest report)."""
    return set(latest(log))


def wait_for(predicate, timeout: float, what: str, logs: list[Path]):
    def dump() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())

    return wait_until(predicate, timeout, what, interval=0.1, details=dump)


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_hosts_find_each_other_ignore_other_clusters_and_see_goodbyes(netns_mesh_factory, tmp_path):
    mesh = netns_mesh_factory(5, "disc")
    hosts = mesh.hosts
    members, foreign, hermit = hosts[:3], hosts[3], hosts[4]
    hermit.block_multicast()  # same key, but no multicast: nobody sees it and it sees nobody
    logs = {h.name: tmp_path / f"{h.name}.log" for h in hosts}
    launched = time.monotonic()
    procs = {h.name: start(h, logs[h.name], h.name, key="another-key" if h is foreign else KEY) for h in hosts}
    all_logs = list(logs.values())
    wait_for(
        lambda: all(any(e["event"] == "up" for e in events(logs[h.name])) for h in hosts),
        20,
        "every node to announce",
        all_logs,
    )
    names = {h.name for h in members}
    wait_for(
        lambda: all(seen(logs[h.name]) == names - {h.name} for h in members),
        10,
        "the three members to see each other",
        all_logs,
    )
    print(f"members converged {time.monotonic() - launched:.2f} s after launch")
    for h in members:
        peers = latest(logs[h.name])
        for other in members:
            if other is not h:
                assert peers[other.name]["addresses"] == [other.ip]  # only namespace addresses
                assert peers[other.name]["grpc_port"] == 8471
    time.sleep(1.0)  # the foreign node and the hermit have been announcing all along
    for h in members:
        listed = set().union(*(e["peers"] for e in events(logs[h.name]) if e["event"] == "peers"))
        assert foreign.name not in listed and hermit.name not in listed
    assert seen(logs[foreign.name]) == set() and seen(logs[hermit.name]) == set()

    # a new budget is re-announced and reaches the others
    first = members[0]
    procs[first.name].stdin.write(b"budget 123456\n")
    procs[first.name].stdin.flush()
    wait_for(
        lambda: all(latest(logs[h.name])[first.name]["memory_budget"] == 123456 for h in members[1:]),
        5,
        "the new budget to reach the others",
        all_logs,
    )

    leaver = members[2]
    mesh.stop(procs[leaver.name], timeout=10)  # SIGTERM: unregister (goodbye) and exit
    assert procs[leaver.name].returncode == 0
    assert events(logs[leaver.name])[-1]["event"] == "down"
    rest = members[:2]
    wait_for(
        lambda: all(seen(logs[h.name]) == names - {h.name, leaver.name} for h in rest),
        5,
        "the others to drop the node that left",
        all_logs,
    )
    for h in hosts:
        mesh.stop(procs[h.name])


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_two_nodes_with_one_id_are_reported(netns_mesh_factory, tmp_path):
    mesh = netns_mesh_factory(3, "dup")
    first, second, watcher = mesh.hosts
    logs = {h: tmp_path / f"{h.name}.log" for h in (first, second, watcher)}
    procs = {watcher: start(watcher, logs[watcher], "watcher"), first: start(first, logs[first], "twin")}
    is_up = lambda h: any(e["event"] == "up" for e in events(logs[h]))  # noqa: E731
    wait_for(lambda: is_up(first) and is_up(watcher), 20, "the first twin", list(logs.values()))
    procs[second] = start(second, logs[second], "twin")
    wait_for(lambda: is_up(second), 20, "the second twin", list(logs.values()))
    up = next(e for e in events(logs[second]) if e["event"] == "up")
    assert "twin" in up["duplicates"] and up["name"] != f"twin.{SERVICE_TYPE}"  # it had to rename
    wait_for(lambda: "twin" in seen(logs[watcher]), 10, "the watcher to see the twin", list(logs.values()))
    time.sleep(2.0)
    for h in (second, first, watcher):
        mesh.stop(procs[h])
    downs = {h: [e for e in events(logs[h]) if e["event"] == "down"] for h in logs}
    assert all(downs.values()), downs
    assert "twin" in downs[first][0]["duplicates"]  # the first saw the second's announcement too
    assert "twin" in downs[watcher][0]["duplicates"]
    reports = [e for e in events(logs[watcher]) if e["event"] == "peers" and "twin" in e["peers"]]
    assert reports[-1]["peers"]["twin"]["addresses"] == [first.ip]  # the one that started first keeps the id
