"""What the planner is given (nodes, links) and what it returns (a plan of stages, or why none fits)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

from meshnode.errors import MeshnodeError
from meshnode.ids import NodeId
from meshnode.values import STRATEGIES, Strategy

# A model served but held nowhere now (no room, or idle): loaded when a request asks.
UNLOADED: Final = "unloaded"
# A plan's strategy: how it splits the model, or that it holds it nowhere.
PlanStrategy = Strategy | Literal["unloaded"]
_PLAN_STRATEGIES: dict[str, PlanStrategy] = {**{s: s for s in STRATEGIES}, UNLOADED: UNLOADED}


def as_plan_strategy(text: str) -> PlanStrategy:
    """``text`` as a plan's strategy; ValueError where it names none."""
    try:
        return _PLAN_STRATEGIES[text]
    except KeyError:
        raise ValueError(f"unknown plan strategy {text!r}") from None


# A normal round trip's p95 is its median plus 0.64 of its p90 - p10 spread.
TAIL_SPREADS = 0.64


def tail_round_trip(median: float, spread: float) -> float:
    """A round trip at the link's slow moments (p95), from its median and p90 - p10 spread."""
    return median + TAIL_SPREADS * spread


@dataclass(frozen=True)
class NodeSpec:
    node_id: NodeId
    memory_budget: int  # bytes offered for weights + KV cache
    compute: float = 1.0  # relative speed; used only when layer_seconds is unknown
    address: str = ""
    layer_seconds: float | None = None  # measured decode step of an average layer (None/0: unknown)
    collective_s: float | None = None  # measured all-reduce cost beyond the wire (None/0: not counted)


@dataclass(frozen=True)
class LinkSpec:
    """A measured link between two nodes (symmetric)."""

    rtt_s: float  # network round trip of a small message, median (what a ring collective pays)
    bandwidth_Bps: float
    overhead_s: float = 0.0  # what the RPC stack adds to a round trip (pipeline hops pay it)
    jitter_s: float = 0.0  # spread of its round trips, p90 - p10

    @property
    def tail_rtt_s(self) -> float:
        """The round trip at the link's slow moments (p95), which the plans are costed with: every
        token waits for each hop, so a link that wanders slows decoding more than its median says."""
        return tail_round_trip(self.rtt_s, self.jitter_s)


@dataclass(frozen=True)
class Stage:
    start_layer: int
    end_layer: int  # exclusive
    nodes: tuple[NodeId, ...]  # one node for a pipeline stage
    bytes: int = 0
    endpoints: tuple[str, ...] = ()  # tensor group: ring address by rank

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer


@dataclass(frozen=True)
class Plan:
    """Which nodes hold which layers of a model, by stage, with its estimate and reasons."""

    model: str
    strategy: PlanStrategy
    stages: tuple[Stage, ...]
    epoch: int = 0
    reason: str = ""
    max_context: int = 0
    estimate_s: float = 0.0  # estimated seconds per decoded token (0: not estimated)
    alternatives: tuple[dict[str, Any], ...] = ()  # each other strategy's best plan, or why it has none
    kv_bits: int = 0  # KV cache quantization bits; 0: unquantized

    @property
    def unloaded(self) -> bool:
        return self.strategy == UNLOADED

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.estimate_s if self.estimate_s > 0 else 0.0

    def node_ids(self) -> list[str]:
        """Every node of the plan, in stage order."""
        return [n for s in self.stages for n in s.nodes]

    def stage_of(self, node_id: str) -> Stage | None:
        return next((s for s in self.stages if node_id in s.nodes), None)

    def with_epoch(self, epoch: int) -> Plan:
        return replace(self, epoch=epoch)

    def check(self, num_layers: int) -> None:
        """Raise ValueError unless the stages tile [0, num_layers) with distinct nodes."""
        edge = 0
        for s in self.stages:
            if s.start_layer != edge or s.end_layer <= s.start_layer or not s.nodes:
                raise ValueError(f"plan epoch {self.epoch}: stages do not tile the model's layers")
            edge = s.end_layer
        if edge != num_layers:
            raise ValueError(f"plan epoch {self.epoch} covers {edge} of {num_layers} layers")
        ids = self.node_ids()
        if len(set(ids)) != len(ids):
            raise ValueError(f"plan epoch {self.epoch} names a node twice")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "strategy": self.strategy,
            "epoch": self.epoch,
            "reason": self.reason,
            "max_context": self.max_context,
            "kv_bits": self.kv_bits,
            "estimate_s": self.estimate_s,
            "alternatives": [dict(a) for a in self.alternatives],
            "stages": [
                {
                    "start_layer": s.start_layer,
                    "end_layer": s.end_layer,
                    "nodes": list(s.nodes),
                    "bytes": s.bytes,
                    **({"endpoints": list(s.endpoints)} if s.endpoints else {}),
                }
                for s in self.stages
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        stages = tuple(
            Stage(
                int(s["start_layer"]),
                int(s["end_layer"]),
                tuple(NodeId(str(n)) for n in s["nodes"]),
                int(s.get("bytes", 0)),
                tuple(str(a) for a in s.get("endpoints") or ()),
            )
            for s in d["stages"]
        )
        return cls(
            model=str(d["model"]),
            strategy=as_plan_strategy(str(d["strategy"])),
            stages=stages,
            epoch=int(d.get("epoch", 0)),
            reason=str(d.get("reason", "")),
            max_context=int(d.get("max_context", 0)),
            kv_bits=int(d.get("kv_bits", 0) or 0),
            estimate_s=float(d.get("estimate_s", 0.0) or 0.0),
            alternatives=tuple(dict(a) for a in d.get("alternatives") or () if isinstance(a, dict)),
        )


class PlanError(MeshnodeError):
    """No plan fits; ``reasons`` says why, one sentence each."""

    def __init__(self, reasons: Sequence[str] | str):
        self.reasons = [reasons] if isinstance(reasons, str) else list(reasons)
        super().__init__("; ".join(self.reasons))


def human_bytes(n: float) -> str:
    """31.2 GiB, 512.0 MiB, 300 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def describe_context(ctx: int, requests: int = 1, kv_bits: int = 0) -> str:
    each = f" for each of {requests} requests at once" if requests > 1 else ""
    quant = f" in a {kv_bits}-bit KV cache" if kv_bits else ""
    return f"for {ctx} token{'s' if ctx != 1 else ''} of context{quant}{each}"
