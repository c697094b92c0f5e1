"""Who coordinates: the longest-running live node (smallest ``started_at``, then node id), so
every node picks the same one and a newcomer never deposes a healthy coordinator."""

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
