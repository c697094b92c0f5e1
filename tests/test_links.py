"""Link measurement between two real nodes (loopback): RTT, jitter and bandwidth per address,
shown in /v1/mesh and carried to peers in heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import grpc
import pytest

from harness.cluster import wait_mesh
from meshnode.control.echo import FRAME, MAX_CONNECTIONS, EchoServer, echo_rtt
from meshnode.control.links import MAX_PROBE_BYTES, LinkProber, LinkStat, best, best_paths, probe_reply, ring_address
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from tests.helpers import running_node

pytestmark = pytest.mark.timeout(120)


def test_probe_reply_is_bounded():
    assert len(probe_reply(mesh_pb2.ProbeRequest(reply_bytes=10)).payload) == 10
    assert len(probe_reply(mesh_pb2.ProbeRequest(reply_bytes=2**31)).payload) == MAX_PROBE_BYTES


def test_best_is_the_least_time_for_a_typical_message():
    slow = LinkStat("b", "10.0.0.2", 900.0, 50.0, 1e7, 0.0)
    fast = LinkStat("b", "10.0.1.2", 40.0, 5.0, 1e9, 0.0)
    fatter = LinkStat("b", "10.0.2.2", 40.0, 5.0, 2e9, 0.0)
    throttled = LinkStat("b", "10.0.3.2", 30.0, 5.0, 1.25e6, 0.0)  # 10 Mbit/s: 13 ms per 16 KiB
    assert best([slow, fast]) is fast
    assert best([slow, fast, fatter]) is fatter
    assert best([throttled, fast]) is fast
    assert best([]) is None


def test_link_stat_from_a_peer_is_checked():
    with pytest.raises(ValueError):
        LinkStat.from_pb(mesh_pb2.Link(peer="x", address="1.2.3.4", rtt_us=-1))
    with pytest.raises(ValueError):
        LinkStat.from_pb(mesh_pb2.Link(peer="x" * 500, address="1.2.3.4", rtt_us=1))


@pytest.mark.slow
def test_two_nodes_measure_their_link(tmp_path):
    with contextlib.ExitStack() as stack:
        a, base_a = stack.enter_context(running_node(None, tmp_path / "a", node_id="node-a", link_probe_interval=1))
        b, base_b = stack.enter_context(
            running_node(
                None, tmp_path / "b", node_id="node-b", link_probe_interval=1, peers=[f"127.0.0.1:{a.grpc_port}"]
            )
        )
        view = wait_mesh(
            base_a,
            lambda v: {n["node_id"]: bool(n["links"]) for n in v["nodes"]} == {"node-a": True, "node-b": True},
            timeout=30,
            request_timeout=5,
            what="link figures",
        )
        nodes = {n["node_id"]: n for n in view["nodes"]}
        mine, theirs = nodes["node-a"]["links"][0], nodes["node-b"]["links"][0]
        assert mine["peer"] == "node-b" and theirs["peer"] == "node-a"  # b's figures reached a by heartbeat
        for link in (mine, theirs):
            assert link["address"] == "127.0.0.1"
            assert 0 < link["rtt_us"] < 200_000 and link["jitter_us"] >= 0 and link["bandwidth"] > 1e6
            # Both round trips are taken; which is smaller on a busy machine is timing, not a property
            # (test_rtt_is_the_echo_not_the_rpc pins which figure is which).
            assert 0 < link["rpc_rtt_us"] < 200_000
        assert a.peers.links.best_address("node-b") == "127.0.0.1"


class _SlowProbe(mesh_pb2_grpc.MeshServicer):
    """A Mesh service whose Probe takes at least ``delay`` seconds: the RPC figure has a floor."""

    def __init__(self, delay: float):
        self.delay = delay

    async def Probe(self, request, context):
        await asyncio.sleep(self.delay)
        return probe_reply(request)


@pytest.mark.slow
def test_rtt_is_the_echo_not_the_rpc():
    """The RTT a link reports is the echo's (the network alone), the RPC round trip is kept apart.
    The RPC here takes >= 250 ms by construction, so the ordering below does not depend on load."""
    delay = 0.25

    async def main():
        server = grpc.aio.server()
        mesh_pb2_grpc.add_MeshServicer_to_server(_SlowProbe(delay), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        echo = EchoServer("127.0.0.1", 0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            prober = LinkProber(lambda _target: channel, samples=3, bulk_bytes=1 << 12)
            with_echo = await prober.measure("b", "127.0.0.1", port, echo.port)
            without = await prober.measure("b", "127.0.0.1", port, 0)
        finally:
            await channel.close()
            echo.close()
            await server.stop(None)
        return with_echo, without

    with_echo, without = asyncio.run(main())
    assert with_echo.rpc_rtt_us >= delay * 1e6 and without.rpc_rtt_us >= delay * 1e6
    assert 0 < with_echo.rtt_us < delay * 1e6  # the echo's figure, not the RPC's
    assert without.rtt_us == without.rpc_rtt_us  # no echo: the RPC round trip stands in


def test_echo_times_the_network_and_survives_garbage():
    server = EchoServer("127.0.0.1", 0)
    try:
        rtt, jitter = echo_rtt("127.0.0.1", server.port, samples=20)
        assert 0 < rtt < 0.05 and jitter >= 0
        # Garbage, a half frame and a flood of connections: dropped, and the echo still answers.
        with socket.create_connection(("127.0.0.1", server.port), timeout=2) as bad:
            bad.sendall(b"\xff" * (FRAME // 2))
        hogs = [socket.create_connection(("127.0.0.1", server.port), timeout=2) for _ in range(MAX_CONNECTIONS + 4)]
        for hog in hogs:
            hog.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert echo_rtt("127.0.0.1", server.port, samples=3)[0] > 0
                break
            except OSError:
                assert time.monotonic() < deadline, "the echo stopped answering"
                time.sleep(0.1)
    finally:
        server.close()
    with pytest.raises(OSError):
        echo_rtt("127.0.0.1", server.port, samples=1, timeout=1)


def test_best_paths_take_the_faster_end_and_ring_addresses_the_fastest_path():
    wifi = LinkStat("b", "192.168.1.2", 3000.0, 500.0, 3e7, 0.0, 3500.0)
    bridge = LinkStat("b", "169.254.0.2", 40.0, 5.0, 2e9, 0.0, 600.0)
    back = LinkStat("a", "169.254.0.1", 90.0, 5.0, 2e9, 0.0, 700.0)  # b's view of a: busier end
    stray = LinkStat("c", "10.0.0.3", 10.0, 1.0, 1e9, 0.0)  # c is not a member
    measured = [("a", wifi), ("a", bridge), ("b", back), ("a", stray)]
    paths = best_paths(measured, {"a", "b"})
    assert list(paths) == [frozenset({"a", "b"})] and paths[frozenset({"a", "b"})] == ("a", bridge)
    assert ring_address(measured, "b", ("a", "b")) == "169.254.0.2"
    assert ring_address(measured, "a", ("a", "b")) == "169.254.0.1"
    assert ring_address(measured, "c", ("a", "c")) == "10.0.0.3"
    assert ring_address(measured, "a", ("a", "c")) is None  # c has measured nobody yet


async def test_a_remote_stage_opens_each_stream_on_the_peer_s_fastest_address_now():
    """A placement made before the links were measured must not keep the first address found:
    each request's stream looks up the data port again (tests/test_links_mesh.py lost the fast
    path this way under load)."""
    from meshnode.transport.remote_stage import RemoteStage

    addresses = iter([("198.18.0.2", 9), ("10.9.0.2", 9)])  # the bridge, then the measured direct link
    opened = []
    stage = RemoteStage(
        node_id="b",
        channel=grpc.aio.insecure_channel("127.0.0.1:9"),
        loop=asyncio.get_running_loop(),
        start=0,
        end=4,
        epoch=1,
        hidden_size=8,
        hop_timeout=1.0,
        data_port=lambda: next(addresses),
        auth=object(),
        data_session=lambda stage, request_id, host, port, **kw: opened.append(host) or host,
    )
    assert stage.open("r1") == "198.18.0.2" and stage.open("r2") == "10.9.0.2"
    assert opened == ["198.18.0.2", "10.9.0.2"]
