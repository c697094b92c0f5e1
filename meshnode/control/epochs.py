"""One plan per epoch: what a node knows of plan epochs, and the rule that keeps the numbers honest.

A plan is named by its epoch everywhere, so an epoch must name one plan; yet two coordinators
can publish under one number (nodes started together, a healed partition). The rule, with no
timing in it:

1. A node adopts a plan only if its epoch is above its own, or it is the very plan this node
   withdrew (holding none since) offered by its own coordinator: a node cut off alone drops its
   plan, and no new epoch would bring it back.
2. A plan under the node's own epoch from another coordinator (in a heartbeat, an Install, or a
   peer's refusal) marks that epoch *contested*.
3. The elected coordinator republishes above every epoch seen once its epoch is contested; by
   rule 1 every node adopts it.
4. Nobody publishes a first plan before ``grace`` seconds up unless it has heard of one, so of
   nodes started together only one publishes.

tests/test_epochs.py checks every ordering of the messages ends on one plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from meshnode.control.election import next_epoch

log = logging.getLogger(__name__)

MAX_EPOCH = 2**62  # far past any real mesh's count; leaves room to publish above any epoch seen


@dataclass(frozen=True)
class Published:
    """A plan as the epoch rule sees it: its number and who published it."""

    epoch: int
    coordinator: str


class EpochState:
    """One node's view of plan epochs (see the module's rule)."""

    def __init__(self, grace: float = 0.0):
        self.grace = grace  # seconds up before publishing a first plan (rule 4)
        self.held: Published | None = None  # the plan this node holds
        self.withdrawn = 0  # the epoch of a plan withdrawn (no plan fits): numbers never go back
        self.withdrawn_by = ""  # who published that plan
        self.max_seen = 0  # the highest epoch seen anywhere
        self.contested = 0  # an epoch for which another coordinator's plan was seen

    @property
    def epoch(self) -> int:
        return self.held.epoch if self.held is not None else self.withdrawn

    def saw(self, epoch: int) -> None:
        """An epoch a peer holds. Numbers past MAX_EPOCH are ignored: the next would overflow uint64."""
        if 0 <= epoch <= MAX_EPOCH:
            self.max_seen = max(self.max_seen, epoch)

    def offered(self, epoch: int, coordinator: str, seen_at: str) -> bool:
        """A plan ``coordinator`` published under ``epoch``, seen at ``seen_at``: whether to adopt
        it (rule 1); marks the epoch contested if it is this node's own under another name (rule 2)."""
        if epoch > self.epoch:  # seen only once adopted: the plan may yet be invalid
            return epoch <= MAX_EPOCH
        if seen_at == coordinator and self.takes_back(epoch, coordinator):
            return True  # from its coordinator itself: heard again, not one of a minority's peers
        if self.held is not None and epoch == self.held.epoch and coordinator != self.held.coordinator:
            if self.contested != epoch:
                log.warning("epoch %d names two plans: %s's (held here) and %s's (held by %s)", epoch,
                            self.held.coordinator, coordinator, seen_at)
            self.contested = epoch
        return False

    def holds(self, epoch: int, coordinator: str) -> bool:
        """Whether this node holds that very plan already (its Install is accepted, not refused)."""
        return self.held == Published(epoch, coordinator)

    def refused(self, epoch: int, their_epoch: int, peer: str) -> None:
        """``peer`` refused this node's Install of ``epoch``, holding ``their_epoch``."""
        self.saw(their_epoch)
        if self.held is not None and their_epoch == epoch == self.held.epoch and self.contested != epoch:
            log.warning("epoch %d names two plans: %s holds another one", epoch, peer)
            self.contested = epoch

    def adopted(self, epoch: int, coordinator: str) -> None:
        self.held = Published(epoch, coordinator)
        self.saw(epoch)

    def withdraw(self) -> None:
        """The held plan no longer fits: no plan, and the next one is numbered above it."""
        if self.held is not None:
            self.withdrawn_by = self.held.coordinator
        self.withdrawn, self.held = self.epoch, None

    def takes_back(self, epoch: int, coordinator: str) -> bool:
        """Whether a plan a peer holds is the very one this node withdrew, holding none since (rule 1)."""
        return self.held is None and epoch == self.withdrawn > 0 and coordinator == self.withdrawn_by

    def must_republish(self) -> bool:
        """The held plan's epoch names two plans: the coordinator publishes again (rule 3)."""
        return self.held is not None and self.contested == self.held.epoch

    def may_publish_first(self, up_for: float) -> bool:
        """Whether a coordinator may publish now (rule 4)."""
        return self.held is not None or self.max_seen > 0 or up_for >= self.grace

    def next_epoch(self) -> int:
        return next_epoch(self.max_seen, self.epoch)
