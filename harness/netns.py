"""Real hosts for multi-host tests: Linux network namespaces on a private bridge.

``netns_mesh(n)`` builds a "switch" namespace holding a bridge ``br0`` and n host namespaces,
each joined to the bridge by a veth pair (``eth0`` in the host, ``p<i>`` on the switch) and
addressed 198.18.0.(10+i)/24 -- a benchmarking range, used only inside these namespaces. Every
link is created inside a namespace: nothing at all is added to the machine's own namespace, and
a host has no route anywhere but its own subnets.

Names are ``mn<pid>-<tag>-<host>`` (pid of the process that built the mesh). Everything is removed
on exit, also when the test fails or is interrupted; meshes whose builder process is gone (a
crashed or killed run) are removed before a new mesh is built. Meshes of live processes -- a
parallel run -- are never touched.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "mn"  # every namespace this harness makes is named mn<pid>-...
_OURS = re.compile(r"^mn(\d+)-")
_LEGACY = "mnt-"  # the harness's older naming (no pid)
NETNS_DIR = Path("/var/run/netns")
MESH_NET = ipaddress.ip_network("198.18.0.0/24")
ALLOWED = ipaddress.ip_network("198.18.0.0/15")
_seq = itertools.count()
_open: set[Mesh] = set()


def _ip(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=timeout)


def _in(ns: str, *cmd: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *cmd], check=check, capture_output=True, text=True, timeout=timeout
    )


def available() -> str | None:
    """None when namespaces can be used here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces)"
    if shutil.which("ip") is None:
        return "multi-host tests need iproute2 (`ip`)"
    try:
        _ip("netns", "list")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"iproute2 is not usable: {exc}"
    return None


def namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()]


def _pids(ns: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]


def _kill_all(ns: str, timeout: float = 5) -> None:
    """SIGKILL every process inside ``ns`` and wait (bounded) until they are gone."""
    deadline = time.monotonic() + timeout
    while (pids := _pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _delete(ns: str) -> None:
    _kill_all(ns)
    _ip("netns", "del", ns, check=False)


def _started_at(pid: int) -> float | None:
    """Wall-clock start time of a live process, None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        btime = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
    except (OSError, StopIteration, ValueError):
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def cleanup_leftovers() -> list[str]:
    """Remove namespaces of this harness whose builder process is gone; returns their names."""
    removed = []
    legacy: dict[str, list[str]] = {}
    for ns in namespaces():
        if ns.startswith(_LEGACY):
            legacy.setdefault(ns[: ns.find("-", len(_LEGACY))], []).append(ns)
            continue
        m = _OURS.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            if any(ns in mesh.names for mesh in _open):
                continue
        else:
            started = _started_at(pid)
            try:
                made = (NETNS_DIR / ns).stat().st_mtime
            except OSError:
                made = None
            # alive and older than the namespace: its builder is still running
            if started is not None and (made is None or started <= made + 1):
                continue
        _delete(ns)
        removed.append(ns)
    # Old-style names carry no pid: remove a group only when no process lives in it and it is old.
    for group in legacy.values():
        try:
            old = all(time.time() - (NETNS_DIR / ns).stat().st_mtime > 900 for ns in group)
        except OSError:
            old = False
        if old and not any(_pids(ns) for ns in group):
            for ns in group:
                _delete(ns)
                removed.append(ns)
    return removed


@dataclass(eq=False)  # hashable, compared by identity
class NetHost:
    """One host: a network namespace with ``dev`` (veth) on the mesh bridge at ``ip``."""

    name: str
    ns: str
    ip: str
    dev: str = "eth0"
    switch_ns: str = ""
    switch_port: str = ""  # the bridge-side end of this host's veth (in switch_ns)
    procs: list[subprocess.Popen] = field(default_factory=list)
    # Enter only the network namespace, keeping the machine's /sys: `ip netns exec` mounts a sysfs
    # of its own, which hides /sys/fs/cgroup, so a node could not read its cgroup's memory limit.
    machine_sysfs: bool = False

    def exec_args(self, cmd: list[str]) -> list[str]:
        if self.machine_sysfs:
            return ["nsenter", f"--net={NETNS_DIR / self.ns}", "--", *cmd]
        return ["ip", "netns", "exec", self.ns, *cmd]

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside this host (captured text output, 20 s timeout, check=True by default)."""
        kw = {"capture_output": True, "text": True, "timeout": 20, "check": True, **kw}
        return subprocess.run(self.exec_args(cmd), **kw)

    def popen(
        self, cmd: list[str], env: dict | None = None, log_path: Path | str | None = None, **kw
    ) -> subprocess.Popen:
        """Start ``cmd`` inside this host in its own process group (stdout+stderr to ``log_path``);
        the mesh kills it on exit if it still runs."""
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            kw = {"stdout": out, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL, **kw}
            proc = subprocess.Popen(self.exec_args(cmd), env=env, start_new_session=True, **kw)
        finally:
            if log_path:
                out.close()
        self.procs.append(proc)
        return proc

    def link_down(self) -> None:
        self.run(["ip", "link", "set", self.dev, "down"])

    def link_up(self) -> None:
        self.run(["ip", "link", "set", self.dev, "up"])

    def block_multicast(self) -> None:
        """Drop all IPv4 multicast (so mDNS) to and from this host; unicast is untouched.

        A route (``prohibit 224.0.0.0/4``) does not do it: a socket that names its multicast
        interface, as zeroconf does, bypasses the routing table for 224.0.0.x. The kernel here
        has no tc drop action and no iptables/nft tools, so multicast is steered by a u32 filter
        into an HTB class whose queue holds nothing (``pfifo limit 0``): on this host's eth0 for
        what it sends and on its bridge port for what it would receive.
        """
        _drop_multicast(self.ns, self.dev)
        _drop_multicast(self.switch_ns, self.switch_port)

    def unblock_multicast(self) -> None:
        for ns, dev in ((self.ns, self.dev), (self.switch_ns, self.switch_port)):
            _in(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def drop_tcp_out(self, dst_ip: str, port: int) -> None:
        """Silently drop every TCP packet this host sends to ``dst_ip:port`` (connection attempts
        time out, as when macOS Local Network privacy or a firewall's DROP rule blocks them);
        replies to connections that the other host opens still flow, and so does everything else.
        Same means as ``block_multicast`` (u32 filter into an HTB class that holds nothing)."""
        _blackhole(self.ns, self.dev)
        _in(
            self.ns,
            "tc",
            "filter",
            "replace",
            "dev",
            self.dev,
            "parent",
            "1:",
            "protocol",
            "ip",
            "prio",
            "2",
            "u32",
            "match",
            "ip",
            "protocol",
            "6",
            "0xff",
            "match",
            "ip",
            "dst",
            f"{dst_ip}/32",
            "match",
            "ip",
            "dport",
            str(port),
            "0xffff",
            "flowid",
            "1:20",
        )

    def allow_tcp_out(self) -> None:
        """Undo ``drop_tcp_out``."""
        _in(self.ns, "tc", "filter", "del", "dev", self.dev, "parent", "1:", "prio", "2", check=False)

    def cut_off(self, ips) -> None:
        """A partition: drop everything this host sends to ``ips``, and all its multicast (mDNS),
        in both directions' send paths (do it on both sides). Undo with ``rejoin``."""
        _blackhole(self.ns, self.dev)
        for ip in ips:
            _in(
                self.ns,
                "tc",
                "filter",
                "add",
                "dev",
                self.dev,
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "3",
                "u32",
                "match",
                "ip",
                "dst",
                f"{ip}/32",
                "flowid",
                "1:20",
            )
        self.block_multicast()

    def rejoin(self) -> None:
        """Undo ``cut_off``."""
        _in(self.ns, "tc", "filter", "del", "dev", self.dev, "parent", "1:", "prio", "3", check=False)
        self.unblock_multicast()


def _blackhole(ns: str, dev: str) -> None:
    """An HTB root on ``dev`` whose default class passes everything and whose class 1:20 drops
    what filters steer into it (its queue holds nothing); idempotent."""
    if shutil.which("tc") is None:
        raise RuntimeError("dropping traffic needs tc (iproute2)")
    if "htb 1: " not in _in(ns, "tc", "qdisc", "show", "dev", dev, "root").stdout:  # htb cannot be replaced
        _in(ns, "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
    _in(ns, "tc", "class", "replace", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit")
    _in(ns, "tc", "class", "replace", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", "1mbit")
    _in(ns, "tc", "qdisc", "replace", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")


def _drop_multicast(ns: str, dev: str) -> None:
    _blackhole(ns, dev)
    _in(
        ns,
        "tc",
        "filter",
        "replace",
        "dev",
        dev,
        "parent",
        "1:",
        "protocol",
        "ip",
        "prio",
        "1",
        "u32",
        "match",
        "ip",
        "dst",
        "224.0.0.0/4",
        "flowid",
        "1:20",
    )


@dataclass
class Link:
    """An extra direct veth pair between two hosts, on its own subnet."""

    a: NetHost
    b: NetHost
    dev_a: str
    dev_b: str
    ip_a: str
    ip_b: str


class Mesh:
    """n hosts on one bridge; see the module docstring. Use ``netns_mesh`` to get one."""

    def __init__(self, n: int, prefix: str | None = None):
        label = re.sub(r"[^a-z0-9]", "", (prefix or "").lower())[:8]
        self.tag = f"{PREFIX}{os.getpid()}-{label}{next(_seq)}{secrets.token_hex(2)}"
        self.switch = f"{self.tag}-sw"
        self.hosts: list[NetHost] = []
        self.links: list[Link] = []
        self._relays: dict[str, tuple[subprocess.Popen, str]] = {}  # host -> (harness/jitter.py, its inner veth)
        self._relay_seq = itertools.count()
        self.names: list[str] = []
        self._closed = False
        _open.add(self)
        try:
            self._add_ns(self.switch)
            self._sw("ip", "link", "set", "lo", "up")
            self._sw("ip", "link", "add", "br0", "type", "bridge")
            self._sw("ip", "link", "set", "br0", "up")
            for i in range(n):
                self.add_host(f"h{i}")
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        self.names.append(ns)
        _ip("netns", "add", ns)

    def _sw(self, *cmd: str) -> None:
        _in(self.switch, *cmd)

    def add_host(self, short: str | None = None) -> NetHost:
        """A new host on the bridge at 198.18.0.(10+i)."""
        i = len(self.hosts)
        short = short or f"h{i}"
        host = NetHost(
            name=f"node-{short}",
            ns=f"{self.tag}-{short}",
            ip=str(MESH_NET[10 + i]),
            switch_ns=self.switch,
            switch_port=f"p{i}",
        )
        self._add_ns(host.ns)
        # Create the pair inside the switch namespace and move one end into the host.
        self._sw("ip", "link", "add", host.switch_port, "type", "veth", "peer", "name", host.dev, "netns", host.ns)
        self._sw("ip", "link", "set", host.switch_port, "master", "br0")
        self._sw("ip", "link", "set", host.switch_port, "up")
        host.run(["ip", "link", "set", "lo", "up"])
        host.run(["ip", "addr", "add", f"{host.ip}/{MESH_NET.prefixlen}", "dev", host.dev])
        host.run(["ip", "link", "set", host.dev, "up"])
        # no default route: multicast (mDNS) needs a route of its own
        host.run(["ip", "route", "add", "224.0.0.0/4", "dev", host.dev])
        self.hosts.append(host)
        return host

    def add_link(self, a: NetHost, b: NetHost, subnet: str = "198.19.0.0/24") -> Link:
        """A second, direct veth pair between ``a`` (.1) and ``b`` (.2) on ``subnet``."""
        net = ipaddress.ip_network(subnet)
        if not net.subnet_of(ALLOWED) or net.overlaps(MESH_NET):
            raise ValueError(f"{subnet} must lie in {ALLOWED} outside the bridge's {MESH_NET}")
        if any(ipaddress.ip_interface(f"{lk.ip_a}/{net.prefixlen}").network.overlaps(net) for lk in self.links):
            raise ValueError(f"{subnet} is already used by another link")
        k = len(self.links)
        dev_a = dev_b = f"l{k}"  # device names are per namespace
        link = Link(a, b, dev_a, dev_b, str(net[1]), str(net[2]))
        _in(a.ns, "ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b, "netns", b.ns)
        for host, dev, ip in ((a, dev_a, link.ip_a), (b, dev_b, link.ip_b)):
            host.run(["ip", "addr", "add", f"{ip}/{net.prefixlen}", "dev", dev])
            host.run(["ip", "link", "set", dev, "up"])
        self.links.append(link)
        return link

    def shape(
        self, host: NetHost, dev: str | None = None, rate: str = "10mbit", burst: str = "32kbit", latency: str = "50ms"
    ) -> None:
        """Limit what ``host`` sends on ``dev`` (default: its bridge veth) to ``rate`` (tc tbf)."""
        if shutil.which("tc") is None:
            raise RuntimeError("shaping links needs tc (iproute2), which is not installed")
        host.run(
            [
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev or host.dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                burst,
                "latency",
                latency,
            ]
        )

    def delay(self, host: NetHost, delay_ms: float, jitter_ms: float = 0.0, every_ms: float = 0.0) -> subprocess.Popen:
        """Hold every frame to and from ``host`` for ``delay_ms`` +- ``jitter_ms`` (uniform, drawn anew
        every ``every_ms``) each way, in a relay between its bridge port and the bridge
        (harness/jitter.py); FIFO, so no reordering."""
        assert host.name not in self._relays, f"{host.name}'s link is delayed already"
        port, k = host.switch_port, next(self._relay_seq)
        inner, outer = f"j{k}", f"k{k}"  # outer joins the bridge in the host's place; the relay joins inner to its port
        self._sw("ip", "link", "set", port, "nomaster")
        self._sw("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        self._sw("ip", "link", "set", outer, "master", "br0")
        for dev in (port, inner, outer):
            self._sw("ip", "link", "set", dev, "promisc", "on", "up")
        shape = (delay_ms, jitter_ms, every_ms)
        args = [sys.executable, "-m", "harness.jitter", port, inner, *map(str, shape)]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, *args],
            cwd=Path(__file__).resolve().parent.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._relays[host.name] = (proc, inner)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"relaying", "the relay did not start"
        return proc

    def undelay(self, host: NetHost) -> None:
        """Take ``delay``'s relay away: the host's port joins the bridge again directly."""
        proc, inner = self._relays.pop(host.name)
        self.stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()
        self._sw("ip", "link", "del", inner)  # and its peer, the bridge's end
        self._sw("ip", "link", "set", host.switch_port, "promisc", "off")
        self._sw("ip", "link", "set", host.switch_port, "master", "br0")

    # -- processes
    def stop(self, proc: subprocess.Popen, timeout: float = 10) -> None:
        """SIGTERM its process group, then SIGKILL if it does not exit in time."""
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
        except ProcessLookupError:
            pass

    def kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def freeze(self, proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGSTOP)

    def thaw(self, proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """Kill every process of every host and delete all namespaces (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            for proc, _ in self._relays.values():
                if proc.poll() is None:
                    self.kill(proc)
                if proc.stdout is not None:
                    proc.stdout.close()
            for host in self.hosts:
                for proc in host.procs:
                    if proc.poll() is None:
                        self.kill(proc)
                    for pipe in (proc.stdin, proc.stdout, proc.stderr):
                        if pipe is not None:
                            pipe.close()
            for ns in reversed(self.names):  # deleting a host's namespace removes its veths too
                _delete(ns)
        finally:
            _open.discard(self)


def _close_all() -> None:
    for mesh in list(_open):
        mesh.close()


atexit.register(_close_all)


def _on_sigterm(signum, frame):  # turn SIGTERM into an exception so `finally` blocks clean up
    raise SystemExit(128 + signum)


def prepare() -> None:
    """Before building meshes: skip the test if namespaces cannot be made here, make SIGTERM run
    the clean-up, and remove what crashed runs left behind."""
    reason = available()
    if reason:
        import pytest

        pytest.skip(reason)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
    cleanup_leftovers()


@contextmanager
def netns_mesh(n: int, prefix: str | None = None):
    """A Mesh of ``n`` hosts, removed on exit. Skips the test where namespaces cannot be made."""
    prepare()
    mesh = Mesh(n, prefix)
    try:
        yield mesh
    finally:
        mesh.close()
