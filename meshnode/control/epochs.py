"""One plan per epoch: what a node knows of plan epochs, and the rule that keeps the numbers honest.

A plan is named by its epoch everywhere (the data path, readiness, failover), so an epoch must
name one plan. Two nodes can still publish under one number: each coordinated for a moment
before it heard the other (nodes started together, a healed partition), or a new coordinator
published before the last plan of the one it replaces reached it. The rule, the same on every
node and with no timing in it:

1. A node adopts a plan only if its epoch is higher than the node's own (stale plans are fenced),
   or if it is the very plan (epoch and coordinator) this node withdrew and holds none since, and
   its coordinator itself offers it: a node cut off alone finds that no plan fits on it and drops
   the plan it held; once it hears the mesh again, the mesh still holds that plan, and no new
   epoch comes to bring it back. (From the coordinator only: a peer cut off with this node may
   still hold the plan, and taking it back from that peer would only be dropped again.)
2. A plan seen under the node's own epoch from a coordinator other than the one that published
   the node's plan marks that epoch *contested*: in a heartbeat, in an Install, or in the reply
   of a peer that refused this node's Install because it holds another plan under that epoch
   (a peer that already holds the very plan, brought by heartbeats, accepts the Install).
3. The elected coordinator (meshnode.control.election) publishes its plan again, above every
   epoch it has seen, as soon as its epoch is contested. By rule 1 every node then adopts it,
   whichever of the two plans it held.
4. Nobody publishes a first plan before ``grace`` seconds of being up unless it has heard of a
   plan already: nodes started together hear each other first, so only one of them publishes.

tests/test_epochs.py drives several nodes' states through every ordering of their messages
and checks that they always end on one plan.
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
        """An epoch a peer holds (its heartbeat, its refusal). Numbers past MAX_EPOCH are a peer's
        garbage: taking them would make the next epoch overflow the wire's uint64."""
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
        """Whether this node holds that very plan already (an Install after the heartbeats brought
        it is accepted, not refused: a refusal of one's own epoch means another plan)."""
        return self.held == Published(epoch, coordinator)

    def refused(self, epoch: int, their_epoch: int, peer: str) -> None:
        """``peer`` refused this node's Install of ``epoch``, holding ``their_epoch`` (a peer that
        holds this very plan accepts it: see :meth:`holds`)."""
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
