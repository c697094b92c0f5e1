"""The multi-host harness itself: hosts reach each other, nothing outside, and leave no trace."""

import subprocess
import sys

import pytest

from tests.netns import PREFIX, netns_mesh

pytestmark = pytest.mark.netns

ECHO_SERVER = "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);" \
              "s.bind(('0.0.0.0',9000));s.listen();c,_=s.accept();c.sendall(c.recv(64));c.close()"


def can_connect(host, ip, port=9000, timeout=2) -> bool:
    code = f"import socket;s=socket.create_connection(('{ip}',{port}),timeout={timeout});s.sendall(b'hi');" \
           f"assert s.recv(64)==b'hi'"
    return host.run([sys.executable, "-c", code], check=False, timeout=timeout + 5).returncode == 0


def wait_listening(host, port=9000):
    for _ in range(50):
        if f":{port}" in host.run(["ss", "-ltn"], check=False).stdout:
            return
        import time
        time.sleep(0.1)


def namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_hosts_talk_and_teardown_is_clean():
    with netns_mesh(3) as mesh:
        a, b, c = mesh.hosts
        mesh_ns = [h.ns for h in mesh.hosts]
        a.popen([sys.executable, "-c", ECHO_SERVER])
        wait_listening(a)
        assert can_connect(b, a.ip)
        # isolated: no route to anything but the mesh's own subnet
        assert b.run(["ip", "route", "get", "1.1.1.1"], check=False).returncode != 0
        a.popen([sys.executable, "-c", ECHO_SERVER])
        wait_listening(a)
        a.link_down()
        assert not can_connect(c, a.ip, timeout=1)
        a.link_up()
    left = namespaces()
    assert not any(ns in left for ns in mesh_ns)
    assert f"{PREFIX}-" not in left
