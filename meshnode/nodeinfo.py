"""What a node announces of itself: :class:`NodeInfo`, in mDNS TXT properties (the short form,
meshnode.control.discovery) and in heartbeats (all of it, meshnode.control.messages).

A plain dataclass with no dependency on zeroconf, gRPC or MLX, so every part (the planner's
inputs, the control plane, status) can use it.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from meshnode.identity import VALID_ID  # a node id fits one DNS label
from meshnode.ids import NodeId

if TYPE_CHECKING:  # it imports protobuf, which `meshnode install` does without
    from meshnode.weights.holdings import Holding

log = logging.getLogger(__name__)


class Announcement(Protocol):
    """An mDNS record as zeroconf's ServiceInfo gives it: TXT properties and addresses."""

    @property
    def properties(self) -> Mapping[bytes, bytes | None] | None: ...

    def parsed_addresses(self) -> list[str]: ...


MAX_FAULT_TEXT = 1000  # characters of a fault's error a node announces and its peers keep

_MAX_TXT_ENTRY = 255  # bytes per "key=value" (RFC 6763)
_MAX_TEXT = 128


def _text(props: Mapping[str, str], key: str, limit: int = _MAX_TEXT) -> str:
    value = props[key]
    if len(value) > limit or not value.isprintable():
        raise ValueError(f"{key!r} is not a short printable string")
    return value


def _int(props: Mapping[str, str], key: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    value = int(props[key])
    if not lo <= value <= hi:
        raise ValueError(f"{key}={value} out of range")
    return value


def _float(props: Mapping[str, str], key: str, default: str | None = None) -> float:
    value = float(props[key] if default is None else props.get(key) or default)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{key}={value} is not a finite, non-negative number")
    return value


def ordered_addresses(addresses: Iterable[str]) -> tuple[str, ...]:
    """Valid, distinct addresses, IPv4 first (order otherwise kept)."""
    parsed: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for a in addresses:
        ip = ipaddress.ip_address(a)
        if str(ip) not in {str(p) for p in parsed}:
            parsed.append(ip)
    return tuple(str(ip) for ip in sorted(parsed, key=lambda ip: ip.version))


def speed_note(node_id: str, slowdown: float, since: float) -> str:
    """How ``meshnode status`` and a plan's reason say a node is slower than it measured."""
    when = time.strftime("%H:%M", time.localtime(since)) if since > 0 else "now"
    return f"{node_id} runs at {1 / slowdown:.2g}x its measured speed since {when}"


@dataclass(frozen=True)
class NodeInfo:
    """A node's identity, addresses, ports, memory, measured speed, models and holdings, as it announces them."""

    node_id: NodeId
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
    tensor_port: int = 0  # first of the node's mx.distributed ring ports (0 = none)
    layer_seconds: float = 0.0  # measured decode time of one layer of the served model (0 = unknown)
    collective_seconds: float = 0.0  # measured time of one ring all-reduce of an activation (0 = unknown)
    # Models on disk, in full or in part: (model id, complete, layer ranges); heartbeats only, not TXT.
    holdings: tuple[Holding, ...] = ()
    # Served models whose computation raised here: (model id, count, last error, MAX_FAULT_TEXT at most);
    # heartbeats only.
    faults: tuple[tuple[str, int, str], ...] = ()
    # Seconds a model step here has run past stall_timeout (0 = none): stalled, not busy; heartbeats only.
    stalled_for: float = 0.0
    # Its steps' measured time over its plans' estimate while that has held (1.0 = as measured), and
    # the wall-clock time the slowdown began (meshnode.model.pace); heartbeats only.
    slowdown: float = 1.0
    slow_since: float = 0.0
    protocol: int = 0  # the wire protocol version it speaks (meshnode.version); heartbeats only

    def to_properties(self) -> dict[str, str]:
        props = {
            "id": self.node_id,
            "http": str(self.http_port),
            "grpc": str(self.grpc_port),
            "budget": str(self.memory_budget),
            "total": str(self.total_memory),
            "compute": f"{self.compute:.3f}",
            "version": self.version,
            "cluster": self.cluster_id,
            "started": f"{self.started_at:.6f}",
            "tensor": str(self.tensor_port),
            "layer": f"{self.layer_seconds:.9f}",
        }
        models: list[str] = []
        for m in self.models:  # one TXT entry holds at most 255 bytes: announce the models that fit
            if len(("models=" + ",".join([*models, m])).encode()) > _MAX_TXT_ENTRY:
                log.warning(
                    "announcing %d of %d models: the mDNS record has no room for more", len(models), len(self.models)
                )
                break
            models.append(m)
        props["models"] = ",".join(models)
        return props

    @classmethod
    def from_properties(
        cls, props: Mapping[bytes, bytes | None] | Mapping[str, str | None], addresses: Iterable[str]
    ) -> NodeInfo:
        """Parse TXT properties; raises ValueError (or TypeError) for anything malformed."""
        text: dict[str, str] = {}
        for k, v in props.items():
            k = k.decode("utf-8") if isinstance(k, bytes) else k
            v = v.decode("utf-8") if isinstance(v, bytes) else v
            if not isinstance(k, str) or not isinstance(v, str | None):
                raise TypeError(f"property {k!r} is not text")
            text[k] = v or ""
        try:
            node_id = text["id"]
            if not VALID_ID.match(node_id):
                raise ValueError(f"invalid node id {node_id!r}")
            models = tuple(m for m in _text(text, "models", _MAX_TXT_ENTRY).split(",") if m) if "models" in text else ()
            addrs = ordered_addresses(addresses)
            if not addrs:
                raise ValueError("no addresses")
            return cls(
                node_id=NodeId(node_id),
                addresses=addrs,
                http_port=_int(text, "http", 1, 65535),
                grpc_port=_int(text, "grpc", 1, 65535),
                memory_budget=_int(text, "budget"),
                total_memory=_int(text, "total"),
                compute=_float(text, "compute"),
                version=_text(text, "version"),
                cluster_id=_text(text, "cluster", 64),
                models=models,
                started_at=_float(text, "started", default="0"),
                tensor_port=_int(text, "tensor", 0, 65535) if text.get("tensor") else 0,
                layer_seconds=_float(text, "layer", default="0"),
            )
        except KeyError as exc:
            raise ValueError(f"missing property {exc.args[0]!r}") from None

    @classmethod
    def from_service_info(cls, info: Announcement, *, quiet: bool = False) -> NodeInfo | None:
        """The node an mDNS announcement describes, or None (logged unless ``quiet``) if malformed."""
        try:
            return cls.from_properties(info.properties or {}, info.parsed_addresses())  # IPv4 first: _ordered
        except Exception as exc:  # noqa: BLE001 -- whatever some device on the LAN sends, never crash
            log.log(
                logging.DEBUG if quiet else logging.WARNING,
                "ignoring a malformed meshnode announcement %s: %s",
                getattr(info, "name", "?"),
                exc,
            )
            return None
