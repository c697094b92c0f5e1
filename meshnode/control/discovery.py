"""Zero-configuration discovery over mDNS: each node announces its NodeInfo and cluster id (never
the key) and browses for the others. Removals are only hints; heartbeats decide liveness.
``python -m meshnode.control.discovery`` prints what it sees."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
from collections.abc import Callable
from dataclasses import replace

from zeroconf import BadTypeInNameException, InterfaceChoice, NonUniqueNameException, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from meshnode.identity import VALID_ID
from meshnode.logonce import Once
from meshnode.nodeinfo import Announcement, NodeInfo, ordered_addresses

__all__ = ["SERVICE_TYPE", "NodeInfo", "Discovery", "local_addresses"]  # NodeInfo: meshnode.nodeinfo

log = logging.getLogger(__name__)

SERVICE_TYPE = "_meshnode._tcp.local."
RESOLVE_TIMEOUT_MS = 3000


def announced_addresses(host: str) -> tuple[str, ...]:
    """Where peers can reach a node bound to ``host``: that address, else every address of the machine."""
    if host not in ("0.0.0.0", "::", ""):
        return (host,)
    return local_addresses() or ("127.0.0.1",)


def local_addresses() -> tuple[str, ...]:
    """This host's non-loopback IPv4 addresses (link-local ones only if there is nothing else)."""
    import ifaddr  # zeroconf's own dependency

    found = [
        ip.ip
        for adapter in ifaddr.get_adapters()
        for ip in adapter.ips
        if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback
    ]
    routable = [a for a in found if not ipaddress.ip_address(a).is_link_local]
    return tuple(dict.fromkeys(routable or found))


class Discovery:
    """Announce ``me`` and track the cluster's peers; ``on_change(node_id, info)`` hears of each
    peer added, changed or gone (``info=None``)."""

    def __init__(
        self,
        me: NodeInfo,
        *,
        interfaces: InterfaceChoice | list[str] | None = None,
        on_change: Callable[[str, NodeInfo | None], None] | None = None,
    ) -> None:
        self._interfaces = interfaces if interfaces is not None else InterfaceChoice.All
        self.me = self._with_addresses(me)
        self.on_change = on_change or (lambda *_: None)
        self.duplicates: dict[str, set[str]] = {}  # node id -> the nodes sharing it
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._by_name: dict[str, NodeInfo] = {}  # service name -> node (our cluster, not us)
        self._peers: dict[str, NodeInfo] = {}
        self._resolving: dict[str, asyncio.Task[None]] = {}
        self._quiet = Once()  # names logged as foreign or malformed
        self._server = f"{self.me.node_id}.local."

    def _with_addresses(self, me: NodeInfo) -> NodeInfo:
        if me.addresses:
            return me
        if isinstance(self._interfaces, list | tuple):  # explicit interface addresses: announce those
            found: list[str] = []
            for a in self._interfaces:
                try:
                    ip = ipaddress.ip_address(a) if isinstance(a, str) else None
                except ValueError:
                    ip = None
                if ip is not None and not ip.is_loopback:
                    found.append(str(ip))
            addrs = ordered_addresses(found)
        else:
            addrs = local_addresses()
        return replace(me, addresses=addrs)

    @property
    def name(self) -> str:
        """Our service instance name (it differs from "<node_id>.<type>" after a name conflict)."""
        return self._info.name if self._info else f"{self.me.node_id}.{SERVICE_TYPE}"

    def _service_info(self, name: str | None = None) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            SERVICE_TYPE,
            name or f"{self.me.node_id}.{SERVICE_TYPE}",
            port=self.me.grpc_port,
            properties=self.me.to_properties(),
            parsed_addresses=list(self.me.addresses),
            server=self._server,
        )

    async def start(self) -> None:
        if not VALID_ID.match(self.me.node_id):
            raise ValueError(f"node id {self.me.node_id!r} cannot be announced over mDNS")
        self._zc = AsyncZeroconf(interfaces=self._interfaces)
        self._info = self._service_info()
        try:
            await self._zc.async_register_service(self._info, allow_name_change=False)
        except NonUniqueNameException:
            self._duplicate(self.me.node_id, "another node announced it first")
            # our own host name too, so peers never mix our address records with the other's
            self._server = f"{self.me.node_id}-{secrets.token_hex(3)}.local."
            self._info = self._service_info()
            await self._zc.async_register_service(self._info, allow_name_change=True)
            log.warning("announcing as %s instead", self._info.name)
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_state])

    async def update(self, me: NodeInfo) -> None:
        """Re-announce changed properties (e.g. a new memory budget)."""
        me = self._with_addresses(me)
        if me.node_id != self.me.node_id:
            raise ValueError("the node id cannot change while announced")
        self.me = me
        if self._zc is not None and self._info is not None:
            self._info = self._service_info(self._info.name)
            await self._zc.async_update_service(self._info)

    async def stop(self) -> None:
        """Say goodbye (so peers drop us at once) and close."""
        for task in self._resolving.values():
            task.cancel()
        await asyncio.gather(*self._resolving.values(), return_exceptions=True)
        self._resolving.clear()
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        if self._zc is not None:
            try:
                if self._info is not None:
                    await asyncio.wait_for(await self._zc.async_unregister_service(self._info), 5)
            except (TimeoutError, OSError) as exc:
                log.debug("mDNS goodbye not sent: %s", exc)
            finally:
                await self._zc.async_close()
                self._zc = None

    def peers(self) -> dict[str, NodeInfo]:
        """The peers of our cluster known now, by node id."""
        return dict(self._peers)

    # -- browsing
    def _on_state(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if (task := self._resolving.pop(name, None)) is not None:
            task.cancel()
        if state_change is ServiceStateChange.Removed:
            self._forget(name)
            return
        task = asyncio.ensure_future(self._resolve(service_type, name))
        self._resolving[name] = task
        task.add_done_callback(lambda t: self._resolving.pop(name, None) if self._resolving.get(name) is t else None)

    async def _resolve(self, service_type: str, name: str) -> None:
        try:
            info = AsyncServiceInfo(service_type, name)
            assert self._zc is not None, "names are resolved once discovery has started"
            if not await info.async_request(self._zc.zeroconf, RESOLVE_TIMEOUT_MS):
                log.debug("could not resolve %s", name)
                return
        except (BadTypeInNameException, OSError, ValueError) as exc:
            log.debug("could not resolve %s: %s", name, exc)
            return
        self._accept(name, info)

    def _accept(self, name: str, info: Announcement) -> None:
        """A resolved announcement (separate from the network for tests)."""
        node = NodeInfo.from_service_info(info, quiet=name in self._quiet)
        if name == self.name:  # our own records: someone else claims them if they differ from ours
            if node is not None and (
                not set(node.addresses) <= set(self.me.addresses)
                or node.grpc_port != self.me.grpc_port
                or f"{node.started_at:.6f}" != f"{self.me.started_at:.6f}"
            ):
                self._duplicate(self.me.node_id, f"{name} also answers from " + _endpoint(node))
            return
        if node is None:  # from_service_info said why: at warning level the first time only
            self._quiet.first(name)
            self._forget(name)
            return
        if node.cluster_id != self.me.cluster_id:
            if self._quiet.first(name):
                log.debug("ignoring %s (%s): another cluster", name, node.node_id)
            self._forget(name)
            return
        if node.node_id == self.me.node_id:
            self._duplicate(node.node_id, f"{name} at {_endpoint(node)}")
            return
        self._by_name[name] = node
        self._recompute()

    def _forget(self, name: str) -> None:
        if self._by_name.pop(name, None) is not None:
            self._recompute()

    def _duplicate(self, node_id: str, where: str) -> None:
        seen = self.duplicates.setdefault(node_id, set())
        if where not in seen:
            seen.add(where)
            log.error("two nodes use node id %s: %s; give one of them another --node-id", node_id, where)

    def _recompute(self) -> None:
        """Peers by node id; of announcements sharing an id, the earliest started keeps it."""
        groups: dict[str, list[tuple[str, NodeInfo]]] = {}
        for name, node in self._by_name.items():
            groups.setdefault(node.node_id, []).append((name, node))
        new: dict[str, NodeInfo] = {}
        for node_id, entries in groups.items():
            entries.sort(key=lambda e: (e[1].started_at, e[0]))
            if len(entries) > 1:
                self._duplicate(node_id, " and ".join(f"{name} at {_endpoint(n)}" for name, n in entries))
            new[node_id] = entries[0][1]
        old, self._peers = self._peers, new
        for node_id in old.keys() - self._peers.keys():
            self.on_change(node_id, None)
        for node_id, node in self._peers.items():
            if old.get(node_id) != node:
                self.on_change(node_id, node)


def _endpoint(node: NodeInfo) -> str:
    return f"{node.addresses[0]}:{node.grpc_port}" if node.addresses else f"?:{node.grpc_port}"


# ---------------------------------------------------------------------------------- standalone use
def _main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os
    import signal
    import sys
    import threading
    import time
    from dataclasses import asdict

    from meshnode import __version__
    from meshnode.identity import cluster_id

    p = argparse.ArgumentParser(
        prog="python -m meshnode.control.discovery",
        description="Announce a meshnode over mDNS and print the peers seen (JSON lines).",
    )
    p.add_argument("--node-id", required=True)
    p.add_argument("--cluster-key", default=os.environ.get("MESHNODE_CLUSTER_KEY"))
    p.add_argument("--seconds", type=float, default=30.0, help="exit after this long")
    p.add_argument("--http-port", type=int, default=8470)
    p.add_argument("--grpc-port", type=int, default=8471)
    p.add_argument("--memory-budget", type=int, default=2**30)
    p.add_argument("--address", action="append", default=[], help="address to announce (default: all IPv4)")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def emit(event: str, **fields: object) -> None:
        print(json.dumps({"event": event, "t": round(time.time(), 3), **fields}), flush=True)

    async def run() -> None:
        me = NodeInfo(
            node_id=args.node_id,
            addresses=tuple(args.address),
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            memory_budget=args.memory_budget,
            total_memory=args.memory_budget,
            compute=1.0,
            version=__version__,
            cluster_id=cluster_id(args.cluster_key),
            started_at=time.time(),
        )
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)

        def read_stdin() -> None:  # stdin lines: "quit" ends the run, "budget N" re-announces a new budget
            for line in sys.stdin:
                words = line.split()
                if words[:1] in (["quit"], ["stop"]):
                    loop.call_soon_threadsafe(done.set)
                    return
                if len(words) == 2 and words[0] == "budget" and words[1].isdigit():
                    new = replace(disc.me, memory_budget=int(words[1]))
                    loop.call_soon_threadsafe(asyncio.ensure_future, disc.update(new))

        disc: Discovery

        def changed(node_id: str, info: NodeInfo | None) -> None:
            emit(
                "peers",
                change=node_id,
                gone=info is None,
                peers={k: asdict(v) for k, v in sorted(disc.peers().items())},
                duplicates={k: sorted(v) for k, v in disc.duplicates.items()},
            )

        disc = Discovery(me, on_change=changed)
        await disc.start()
        threading.Thread(target=read_stdin, daemon=True).start()
        emit("up", node=asdict(disc.me), name=disc.name, duplicates={k: sorted(v) for k, v in disc.duplicates.items()})
        try:
            await asyncio.wait_for(done.wait(), args.seconds)
        except TimeoutError:
            pass
        await disc.stop()
        emit("down", peers=sorted(disc.peers()), duplicates={k: sorted(v) for k, v in disc.duplicates.items()})

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
