"""Zero-configuration discovery over mDNS (python-zeroconf).

Each node announces ``<node_id>._meshnode._tcp.local.`` with its ports, memory, compute,
version and cluster id (derived from the cluster key, never the key) in TXT properties, and
browses for the others. Nodes of another cluster are ignored; a malformed announcement from
some other device on the LAN is logged and skipped. mDNS removals are reported as hints: the
membership layer decides liveness from heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from zeroconf import NonUniqueNameException, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)

SERVICE_TYPE = "_meshnode._tcp.local."


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    addresses: tuple[str, ...]
    http_port: int
    grpc_port: int
    memory_budget: int
    total_memory: int
    compute: float
    version: str
    cluster_id: str
    models: tuple[str, ...] = ()
    started_at: float = 0.0

    def to_properties(self) -> dict[str, str]:
        return {
            "id": self.node_id, "http": str(self.http_port), "grpc": str(self.grpc_port),
            "budget": str(self.memory_budget), "total": str(self.total_memory), "compute": f"{self.compute:.3f}",
            "version": self.version, "cluster": self.cluster_id, "models": ",".join(self.models),
            "started": f"{self.started_at:.6f}",
        }

    @classmethod
    def from_service_info(cls, info: AsyncServiceInfo) -> "NodeInfo | None":
        try:
            props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
            node = cls(
                node_id=props["id"], addresses=tuple(info.parsed_addresses()), http_port=int(props["http"]),
                grpc_port=int(props["grpc"]), memory_budget=int(props["budget"]), total_memory=int(props["total"]),
                compute=float(props["compute"]), version=props["version"], cluster_id=props["cluster"],
                models=tuple(m for m in props.get("models", "").split(",") if m),
                started_at=float(props.get("started", "0")),
            )
        except (KeyError, ValueError, UnicodeDecodeError, AttributeError) as exc:
            log.debug("ignoring a malformed meshnode announcement %s: %s", info.name, exc)
            return None
        if not node.node_id or not node.addresses or not (0 < node.grpc_port < 65536):
            return None
        return node


class Discovery:
    def __init__(self, me: NodeInfo, *, on_change: Callable[[str, NodeInfo | None], None] | None = None):
        self.me = me
        self.on_change = on_change or (lambda *_: None)
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._peers: dict[str, NodeInfo] = {}
        self._names: dict[str, str] = {}  # service name -> node id
        self.duplicates: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    def _service_info(self) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            SERVICE_TYPE, f"{self.me.node_id}.{SERVICE_TYPE}", port=self.me.grpc_port,
            properties=self.me.to_properties(), parsed_addresses=list(self.me.addresses),
            server=f"{self.me.node_id}.local.",
        )

    async def start(self) -> None:
        self._zc = AsyncZeroconf()
        self._info = self._service_info()
        try:
            await self._zc.async_register_service(self._info, allow_name_change=False)
        except NonUniqueNameException:
            log.error("another node on this LAN already announces node id %s; give one a different --node-id",
                      self.me.node_id)
            self.duplicates.add(self.me.node_id)
            await self._zc.async_register_service(self._info, allow_name_change=True)
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_state])

    async def update(self, me: NodeInfo) -> None:
        self.me = me
        if self._zc is not None:
            self._info = self._service_info()
            await self._zc.async_update_service(self._info)

    async def stop(self) -> None:
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._zc is not None:
            if self._info is not None:
                await self._zc.async_unregister_service(self._info)  # goodbye packets
            await self._zc.async_close()
        for task in self._tasks:
            task.cancel()

    def peers(self) -> dict[str, NodeInfo]:
        return dict(self._peers)

    def _on_state(self, zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            node_id = self._names.pop(name, None)
            if node_id and self._peers.pop(node_id, None) is not None:
                self.on_change(node_id, None)
            return
        task = asyncio.ensure_future(self._resolve(service_type, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, service_type: str, name: str) -> None:
        info = AsyncServiceInfo(service_type, name)
        if not await info.async_request(self._zc.zeroconf, 3000):
            return
        node = NodeInfo.from_service_info(info)
        if node is None:
            return
        if node.cluster_id != self.me.cluster_id:
            log.debug("ignoring %s: another cluster", node.node_id)
            return
        if node.node_id == self.me.node_id:
            if name != self._info.name or not set(node.addresses) <= set(self.me.addresses):
                if node.node_id not in self.duplicates:
                    log.error("two nodes use node id %s (the other at %s); give one a different --node-id",
                              node.node_id, ",".join(node.addresses))
                self.duplicates.add(node.node_id)
            return
        self._names[name] = node.node_id
        if self._peers.get(node.node_id) != node:
            self._peers[node.node_id] = node
            self.on_change(node.node_id, node)
