"""Who coordinates: one node per connected group, chosen the same way by everyone.

Rule: among the nodes alive in a group, the one that has been running longest coordinates
(smallest ``started_at``, ties broken by node id). It is deterministic (every node that sees
the same group picks the same one) and stable: a node that joins later, however big, is
younger and never deposes a healthy coordinator. When the coordinator dies, the next oldest
takes over; when two partitions merge, the older coordinator of the two wins.

Epochs fence stale plans: a coordinator always publishes ``max(epoch seen anywhere) + 1``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    node_id: str
    started_at: float

    def rank(self) -> tuple[float, str]:
        return (self.started_at, self.node_id)


def choose_coordinator(candidates: Iterable[Candidate]) -> str | None:
    best = min(candidates, key=Candidate.rank, default=None)
    return best.node_id if best else None


def next_epoch(*seen: int) -> int:
    return max(seen, default=0) + 1
