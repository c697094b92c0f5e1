"""A node's view of plan epochs, and the rules that keep one plan per number.

Two coordinators can publish under one number (nodes started together, a healed partition):

1. Adopt a plan only if its epoch is above ours, or it is the plan we withdrew (holding none
   since) offered by its own coordinator.
2. Another coordinator's plan of our epoch marks that epoch *contested*.
3. A coordinator whose epoch is contested republishes above every epoch seen.
4. Nobody publishes a first plan before ``grace`` seconds up unless it has heard of one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from meshnode.control.election import next_epoch

log = logging.getLogger(__name__)

MAX_EPOCH = 2**62  # leaves room to publish above any epoch seen


@dataclass(frozen=True)
class Published:
    """A plan as the epoch rule sees it."""

    epoch: int
    coordinator: str


class EpochState:
    """One node's view of plan epochs."""

    def __init__(self, grace: float = 0.0):
        self.grace = grace  # seconds up before publishing a first plan (rule 4)
        self.held: Published | None = None  # the plan this node holds
        self.withdrawn = 0  # the withdrawn plan's epoch: numbers never go back
        self.withdrawn_by = ""  # who published that plan
        self.max_seen = 0
        self.contested = 0  # an epoch two coordinators published

    @property
    def epoch(self) -> int:
        return self.held.epoch if self.held is not None else self.withdrawn

    def saw(self, epoch: int) -> None:
        """An epoch a peer holds; one past MAX_EPOCH is ignored (the next would overflow uint64)."""
        if 0 <= epoch <= MAX_EPOCH:
            self.max_seen = max(self.max_seen, epoch)

    def offered(self, epoch: int, coordinator: str, seen_at: str) -> bool:
        """Whether to adopt ``coordinator``'s plan of ``epoch``, seen at ``seen_at`` (rules 1, 2)."""
        if epoch > self.epoch:  # seen only once adopted: the plan may yet be invalid
            return epoch <= MAX_EPOCH
        if seen_at == coordinator and self.takes_back(epoch, coordinator):
            return True  # from its coordinator itself, not a minority's peer
        if self.held is not None and epoch == self.held.epoch and coordinator != self.held.coordinator:
            if self.contested != epoch:
                log.warning(
                    "epoch %d names two plans: %s's (held here) and %s's (held by %s)",
                    epoch,
                    self.held.coordinator,
                    coordinator,
                    seen_at,
                )
            self.contested = epoch
        return False

    def holds(self, epoch: int, coordinator: str) -> bool:
        """Whether this node already holds that plan."""
        return self.held == Published(epoch, coordinator)

    def refused(self, epoch: int, their_epoch: int, peer: str) -> None:
        """``peer``, holding ``their_epoch``, refused our Install of ``epoch``."""
        self.saw(their_epoch)
        if self.held is not None and their_epoch == epoch == self.held.epoch and self.contested != epoch:
            log.warning("epoch %d names two plans: %s holds another one", epoch, peer)
            self.contested = epoch

    def adopted(self, epoch: int, coordinator: str) -> None:
        self.held = Published(epoch, coordinator)
        self.saw(epoch)

    def withdraw(self) -> None:
        """The held plan no longer fits; the next is numbered above it."""
        if self.held is not None:
            self.withdrawn_by = self.held.coordinator
        self.withdrawn, self.held = self.epoch, None

    def takes_back(self, epoch: int, coordinator: str) -> bool:
        """Whether it is the plan this node withdrew, holding none since (rule 1)."""
        return self.held is None and epoch == self.withdrawn > 0 and coordinator == self.withdrawn_by

    def must_republish(self) -> bool:
        """The held epoch names two plans (rule 3)."""
        return self.held is not None and self.contested == self.held.epoch

    def may_publish_first(self, up_for: float) -> bool:
        """Whether a coordinator may publish now (rule 4)."""
        return self.held is not None or self.max_seen > 0 or up_for >= self.grace

    def next_epoch(self) -> int:
        return next_epoch(self.max_seen, self.epoch)
