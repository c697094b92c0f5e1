"""The multi-host harness itself: hosts reach each other and nothing else, links go down and come
back, multicast can be blocked, extra links can be shaped, and nothing is left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from harness import netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

PORT = 9000
ECHO_SERVER = f"""
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', {PORT})); s.listen()
def serve(c):
    with c:
        while data := c.recv(65536):
            c.sendall(data)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""
# argv: timeout, then ip addresses; prints {ip: true/false}
REACH = f"""
import json, socket, sys
t, res = float(sys.argv[1]), {{}}
for ip in sys.argv[2:]:
    try:
        with socket.create_connection((ip, {PORT}), timeout=t) as s:
            s.sendall(b'hi'); res[ip] = s.recv(2) == b'hi'
    except OSError:
        res[ip] = False
print(json.dumps(res))
"""
# argv: addresses outside the mesh; a UDP connect() only consults the routing table (sends nothing)
NO_ROUTE = """
import errno, json, socket, sys
res = {}
for ip in sys.argv[1:]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((ip, 9)); res[ip] = 'routed'
    except OSError as e:
        res[ip] = errno.errorcode.get(e.errno, str(e.errno))
    s.close()
print(json.dumps(res))
"""
MCAST = """
import socket, sys, time
mode, ip, grp, port = sys.argv[1], sys.argv[2], '224.0.0.251', 5399
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if mode == 'recv':
    s.bind(('', port))
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(grp) + socket.inet_aton(ip))
    s.settimeout(3)
    try:
        print(s.recvfrom(64)[0].decode())
    except socket.timeout:
        print('nothing')
else:
    s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(ip))  # as zeroconf does
    for _ in range(10):
        s.sendto(b'hello', (grp, port)); time.sleep(0.1)
"""


def reach(src: netns.NetHost, ips, timeout: float = 2.0) -> dict[str, bool]:
    out = src.run([sys.executable, "-c", REACH, str(timeout), *ips], timeout=timeout * len(ips) + 10)
    return json.loads(out.stdout)


def serve_echo(host: netns.NetHost) -> subprocess.Popen:
    proc = host.popen([sys.executable, "-c", ECHO_SERVER])
    deadline = time.monotonic() + 10
    while f":{PORT} " not in host.run(["ss", "-Hltn"]).stdout:
        assert proc.poll() is None and time.monotonic() < deadline, "echo server did not start"
        time.sleep(0.05)
    return proc


def root_links() -> set[str]:
    return {
        line.split(":")[1].strip().split("@")[0]
        for line in subprocess.run(
            ["ip", "-o", "link"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.splitlines()
    }


def test_hosts_reach_each_other_and_nothing_else(netns_mesh_factory):
    mesh = netns_mesh_factory(3, "reach")
    for h in mesh.hosts:
        serve_echo(h)
    assert [h.ip for h in mesh.hosts] == ["198.18.0.10", "198.18.0.11", "198.18.0.12"]
    for src in mesh.hosts:
        others = [h.ip for h in mesh.hosts if h is not src]
        assert reach(src, others) == {ip: True for ip in others}, src.name
        # only loopback and the bridge veth; no route but the mesh's own subnet (and multicast)
        links = json.loads(src.run(["ip", "-j", "link"]).stdout)
        assert sorted(lk["ifname"] for lk in links) == ["eth0", "lo"]
        assert src.run(["ip", "route", "get", "1.1.1.1"], check=False).returncode != 0
        outside = ["1.1.1.1", "192.0.2.2", "10.0.0.1", "198.19.5.5", "198.18.1.10"]
        res = json.loads(src.run([sys.executable, "-c", NO_ROUTE, *outside]).stdout)
        assert res == {ip: "ENETUNREACH" for ip in outside}


def test_teardown_leaves_nothing_behind():
    before = root_links()
    with netns.netns_mesh(3, "tear") as mesh:
        names = list(mesh.names)
        assert set(names) <= set(netns.namespaces())
        assert root_links() == before  # nothing was ever added to this machine's own namespace
        sleeper = mesh.hosts[0].popen(["sleep", "600"])
        stray = subprocess.Popen(mesh.hosts[1].exec_args(["sleep", "600"]), start_new_session=True)
    try:
        assert sleeper.poll() is not None
        stray.wait(5)  # not started by popen(): killed via `ip netns pids`
    finally:
        if stray.poll() is None:
            stray.kill()
    left = netns.namespaces()
    assert not set(names) & set(left)
    assert not any(ns.startswith(mesh.tag) for ns in left)
    assert root_links() == before


def test_link_down_makes_a_host_unreachable(netns_mesh_factory):
    a, b, c = netns_mesh_factory(3, "down").hosts
    serve_echo(a)
    assert reach(b, [a.ip]) == {a.ip: True}
    a.link_down()
    assert reach(b, [a.ip], timeout=1) == {a.ip: False}
    assert reach(c, [a.ip], timeout=1) == {a.ip: False}
    a.link_up()
    deadline = time.monotonic() + 10
    while not reach(b, [a.ip])[a.ip]:
        assert time.monotonic() < deadline, "a did not come back after link_up"
        time.sleep(0.2)


def test_block_multicast_drops_mdns_traffic_but_not_unicast(netns_mesh_factory):
    a, b, c = netns_mesh_factory(3, "mcast").hosts

    def trial() -> tuple[str, str]:
        rb = b.popen([sys.executable, "-c", MCAST, "recv", b.ip], stdout=subprocess.PIPE)
        rc = c.popen([sys.executable, "-c", MCAST, "recv", c.ip], stdout=subprocess.PIPE)
        time.sleep(0.5)
        a.run([sys.executable, "-c", MCAST, "send", a.ip])
        return rb.communicate(timeout=10)[0].decode().strip(), rc.communicate(timeout=10)[0].decode().strip()

    assert trial() == ("hello", "hello")
    c.block_multicast()  # c receives nothing
    assert trial() == ("hello", "nothing")
    serve_echo(c)
    assert reach(a, [c.ip]) == {c.ip: True}
    a.block_multicast()  # and a sends nothing
    assert trial() == ("nothing", "nothing")
    a.unblock_multicast()
    c.unblock_multicast()
    assert trial() == ("hello", "hello")


def test_drop_tcp_out_drops_one_port_to_one_host_only(netns_mesh_factory):
    a, b, c = netns_mesh_factory(3, "droptcp").hosts
    for h in (a, b):
        serve_echo(h)
    assert reach(a, [b.ip]) == {b.ip: True}
    a.drop_tcp_out(b.ip, PORT)
    assert reach(a, [b.ip], timeout=1) == {b.ip: False}  # a's connection attempts to b:PORT vanish
    assert reach(c, [b.ip]) == {b.ip: True}  # others still reach b
    assert reach(b, [a.ip]) == {a.ip: True}  # connections b opens to a still work both ways
    a.block_multicast()  # the two blocks coexist on one device; unblocking multicast removes both
    assert reach(a, [b.ip], timeout=1) == {b.ip: False}
    a.unblock_multicast()
    assert reach(a, [b.ip]) == {b.ip: True}
    a.drop_tcp_out(b.ip, PORT)
    assert reach(a, [b.ip], timeout=1) == {b.ip: False}
    a.allow_tcp_out()
    assert reach(a, [b.ip]) == {b.ip: True}


def test_extra_link_and_shaping(netns_mesh_factory):
    mesh = netns_mesh_factory(3, "link")
    a, b, c = mesh.hosts
    with pytest.raises(ValueError):
        mesh.add_link(a, b, "10.1.2.0/24")  # only inside 198.18.0.0/15
    with pytest.raises(ValueError):
        mesh.add_link(a, b, "198.18.0.0/24")  # that is the bridge
    link = mesh.add_link(a, b, "198.19.1.0/24")
    assert (link.ip_a, link.ip_b) == ("198.19.1.1", "198.19.1.2")
    serve_echo(b)
    assert reach(a, [link.ip_b]) == {link.ip_b: True}
    assert reach(c, [link.ip_b], timeout=1) == {link.ip_b: False}  # c is not on that link

    send = (
        "import socket,sys,time\n"
        f"s=socket.create_connection((sys.argv[1], {PORT}), timeout=20); data=b'x'*(1<<20); t=time.monotonic()\n"
        "s.sendall(data); got=0\n"
        "while got < len(data): got += len(s.recv(1<<16))\n"
        "print(time.monotonic()-t)"
    )
    fast = float(a.run([sys.executable, "-c", send, link.ip_b], timeout=30).stdout)
    mesh.shape(a, link.dev_a, rate="8mbit")  # 1 MiB one way at 1 MB/s: about a second
    slow = float(a.run([sys.executable, "-c", send, link.ip_b], timeout=30).stdout)
    assert slow > 0.7 and slow > 5 * fast, (fast, slow)
    # the bridge path is not shaped
    fast_bridge = float(a.run([sys.executable, "-c", send, b.ip], timeout=30).stdout)
    assert fast_bridge < slow / 5, (fast_bridge, slow)


def test_a_delayed_link_is_slow_until_the_relay_is_taken_away(netns_mesh_factory):
    mesh = netns_mesh_factory(2, "delay")
    a, b = mesh.hosts
    serve_echo(b)
    rtt = (
        "import socket,sys,time\n"
        f"s=socket.create_connection((sys.argv[1], {PORT}), timeout=10); best=9.0\n"
        "for _ in range(5):\n"
        "    t=time.monotonic(); s.sendall(b'x'); s.recv(1); best=min(best, time.monotonic()-t)\n"
        "print(best)"
    )
    mesh.delay(b, 25.0)
    delayed = float(a.run([sys.executable, "-c", rtt, b.ip], timeout=30).stdout)
    mesh.undelay(b)
    direct = float(a.run([sys.executable, "-c", rtt, b.ip], timeout=30).stdout)
    assert delayed >= 0.045 and direct < 0.02, (delayed, direct)
    mesh.delay(b, 25.0)  # and again, as a soak's faults come and go
    assert float(a.run([sys.executable, "-c", rtt, b.ip], timeout=30).stdout) >= 0.045


def test_leftovers_of_dead_runs_are_removed_and_live_ones_kept():
    netns.prepare()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{netns.PREFIX}{dead.pid}-old0-h0"
    live = f"{netns.PREFIX}1-live0-h0"  # pid 1 is alive and started before this namespace
    made = []
    try:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
            made.append(ns)
        removed = netns.cleanup_leftovers()
        assert stale in removed and live not in removed
        assert stale not in netns.namespaces() and live in netns.namespaces()
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
