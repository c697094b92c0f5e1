"""Browse mDNS without announcing: a node lacking its model finds a peer that holds it first."""

from __future__ import annotations

from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

from meshnode.control.discovery import SERVICE_TYPE, Discovery
from meshnode.ids import NodeId
from meshnode.nodeinfo import NodeInfo


class Browser(Discovery):
    """Discovery that browses only: ``peers()`` without a registration of our own."""

    def __init__(self, node_id: NodeId, cluster_id: str):
        me = NodeInfo(
            node_id=node_id,
            addresses=("0.0.0.0",),
            http_port=0,
            grpc_port=0,
            memory_budget=0,
            total_memory=0,
            compute=0.0,
            version="",
            cluster_id=cluster_id,
        )
        super().__init__(me)

    async def start(self) -> None:
        self._zc = AsyncZeroconf(interfaces=self._interfaces)
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_state])
