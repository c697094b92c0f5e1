"""The mesh as a served model sees it: the control layer's peers, named by what serving reads of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import grpc

    from meshnode.nodeinfo import NodeInfo


class ReadyPeer(Protocol):
    @property
    def ready_epochs(self) -> Mapping[str, int]:
        """By model: the plan epoch whose shards the peer has loaded."""
        ...


class AliveMembers(Protocol):
    def alive_peers(self) -> Mapping[str, ReadyPeer]: ...


class Mesh(Protocol):
    """This node's peers (meshnode.control.peers.Peers): who is alive, and the channels to them."""

    @property
    def me(self) -> NodeInfo | None:
        """What this node announces (None: not started)."""
        ...

    @property
    def membership(self) -> AliveMembers | None: ...

    def update_me(self, **changes: Any) -> NodeInfo:
        """Change what this node announces with the next heartbeats."""
        ...

    def alive_infos(self) -> dict[str, NodeInfo]: ...

    def heard_within(self, node_id: str) -> bool: ...

    def heard_since(self, node_id: str, since: float) -> bool: ...

    def plan_error_of(self, model_id: str) -> str: ...

    def channel_to(self, node_id_or_target: str) -> grpc.aio.Channel: ...

    def data_channel(self, node_id: str) -> grpc.aio.Channel: ...

    def data_port_of(self, node_id: str) -> tuple[str, int] | None: ...
