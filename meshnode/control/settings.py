"""The control plane's options as typed objects, built from :class:`meshnode.config.Settings`
(where the options and their meaning live)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshnode.config import Settings, StrategySetting


@dataclass(frozen=True)
class ControlSettings:
    """What the control loop and its heartbeats read."""

    heartbeat_interval: float
    failure_timeout: float
    keep_alive: Mapping[str, float]

    @classmethod
    def of(cls, s: Settings) -> ControlSettings:
        return cls(heartbeat_interval=s.heartbeat_interval, failure_timeout=s.failure_timeout, keep_alive=s.keep_alive)


@dataclass(frozen=True)
class PeerSettings:
    """What :class:`meshnode.control.peers.Peers` reads."""

    peers: tuple[str, ...]
    mdns: bool
    authenticate: bool
    failure_timeout: float
    stall_timeout: float
    link_probe_interval: float

    @classmethod
    def of(cls, s: Settings) -> PeerSettings:
        return cls(
            peers=s.peers,
            mdns=s.mdns,
            authenticate=s.authenticate,
            failure_timeout=s.failure_timeout,
            stall_timeout=s.stall_timeout,
            link_probe_interval=s.link_probe_interval,
        )


@dataclass(frozen=True)
class PlanSettings:
    """What a model's coordinator reads."""

    strategy: StrategySetting
    plan_layout: str | None
    rebalance_dwell: float
    link_probe_interval: float
    failure_timeout: float
    max_context: int
    kv_requests: int
    kv_bits: int

    @classmethod
    def of(cls, s: Settings) -> PlanSettings:
        return cls(
            strategy=s.strategy,
            plan_layout=s.plan_layout,
            rebalance_dwell=s.rebalance_dwell,
            link_probe_interval=s.link_probe_interval,
            failure_timeout=s.failure_timeout,
            max_context=s.max_context,
            kv_requests=s.kv_requests,
            kv_bits=s.kv_bits,
        )
