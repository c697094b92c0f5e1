"""Real hosts for multi-host tests: Linux network namespaces on a private bridge.

``netns_mesh(n)`` creates a "switch" namespace holding a bridge and n host namespaces, each
joined to the bridge by a veth pair and addressed in 198.18.0.0/24 (a benchmarking range,
used only inside these namespaces). Nothing is added to the machine's own network namespace.
Everything is removed on exit, also when the test fails; leftovers of crashed runs (same name
prefix) are removed before a new mesh is built.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "mnt"  # every namespace and link this harness makes starts with it


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=20)


def available() -> str | None:
    """None when namespaces can be used here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces)"
    try:
        _ip("netns", "list")
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"iproute2 is not usable: {exc}"
    return None


def cleanup_leftovers() -> None:
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX + "-"):
            _kill_all(name)
            _ip("netns", "del", name, check=False)


def _kill_all(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@dataclass
class NetHost:
    name: str
    ns: str
    ip: str
    dev: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def exec_args(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *cmd]

    def run(self, cmd: list[str], timeout: float = 20, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_args(cmd), capture_output=True, text=True, timeout=timeout, check=check)

    def popen(self, cmd: list[str], env: dict | None = None, log_path: Path | None = None) -> subprocess.Popen:
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        proc = subprocess.Popen(self.exec_args(cmd), env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def link_down(self) -> None:
        self.run(["ip", "link", "set", self.dev, "down"])

    def link_up(self) -> None:
        self.run(["ip", "link", "set", self.dev, "up"])

    def block_multicast(self) -> None:
        """Drop multicast (mDNS) on this host: a route that refuses 224.0.0.0/4."""
        self.run(["ip", "route", "replace", "prohibit", "224.0.0.0/4"])


class Mesh:
    def __init__(self, n: int):
        self.tag = f"{PREFIX}-{uuid.uuid4().hex[:5]}"
        self.switch = f"{self.tag}-sw"
        self.hosts: list[NetHost] = []
        _ip("netns", "add", self.switch)
        self._in_switch("ip", "link", "add", "br0", "type", "bridge")
        self._in_switch("ip", "link", "set", "br0", "up")
        self._in_switch("ip", "link", "set", "lo", "up")
        for i in range(n):
            self.add_host(f"h{i}")

    def _in_switch(self, *cmd: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.switch, *cmd], check=True, capture_output=True, timeout=20)

    def add_host(self, short: str) -> NetHost:
        i = len(self.hosts)
        ns = f"{self.tag}-{short}"
        host = NetHost(name=f"node-{short}", ns=ns, ip=f"198.18.0.{10 + i}", dev="eth0")
        _ip("netns", "add", ns)
        # Create the pair inside the switch namespace, then move one end into the host.
        self._in_switch("ip", "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._in_switch("ip", "link", "set", f"p{i}", "master", "br0")
        self._in_switch("ip", "link", "set", f"p{i}", "up")
        host.run(["ip", "link", "set", "lo", "up"])
        host.run(["ip", "addr", "add", f"{host.ip}/24", "dev", "eth0"])
        host.run(["ip", "link", "set", "eth0", "up"])
        host.run(["ip", "route", "add", "224.0.0.0/4", "dev", "eth0"])
        self.hosts.append(host)
        return host

    def stop(self, proc: subprocess.Popen, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time (the whole process group)."""
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        except ProcessLookupError:
            pass

    def kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)

    def freeze(self, proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGSTOP)

    def close(self) -> None:
        for host in self.hosts:
            for proc in host.procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGCONT)
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    try:
                        proc.wait(5)
                    except subprocess.TimeoutExpired:
                        pass
            _kill_all(host.ns)
            _ip("netns", "del", host.ns, check=False)
        _kill_all(self.switch)
        _ip("netns", "del", self.switch, check=False)


@contextmanager
def netns_mesh(n: int):
    reason = available()
    if reason:
        import pytest

        pytest.skip(reason)
    cleanup_leftovers()
    mesh = Mesh(n)
    try:
        yield mesh
    finally:
        mesh.close()
        time.sleep(0.1)
