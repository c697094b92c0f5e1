"""Several models on one mesh: a *lane* per model, with its own plan and epochs, so a re-plan of one
never moves another; each lane is planned into the memory the others leave."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshnode.control.adoption import Adoption
    from meshnode.control.coordinator import Coordinator
    from meshnode.serving.modelfiles import Holders
    from meshnode.serving.served import ServedModel

log = logging.getLogger(__name__)

RETRY_S = 30.0  # retry loading a peer's model whose files failed here


@dataclass
class Lane:
    """One model as this node takes part in serving it."""

    served: ServedModel
    adoption: Adoption
    coordinator: Coordinator
    offered: bool  # this node announces the model

    @property
    def model_id(self) -> str:
        """Known once its metadata is loaded (a lane is used only then)."""
        model_id = self.served.model_id
        assert model_id is not None, "the lane's model is loaded"
        return model_id


class Lanes:
    """This node's lanes: the models it offers, and those it learns of from peers."""

    def __init__(
        self,
        make: Callable[[str | None, bool], Lane],
        offered: tuple[str | None, ...],
        withdrawn: frozenset[str] = frozenset(),
    ):
        """``offered``: the first is the primary; ``withdrawn``: ids no longer offered."""
        self._make = make
        self._offered, self._withdrawn = offered, withdrawn
        self.primary: Lane = make(offered[0], True)  # "" names it on the wire
        self._lanes: dict[str, Lane] = {}
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._failed: dict[str, float] = {}  # model -> when its metadata failed to load

    async def start(self, holders: Holders) -> None:
        """Load the offered models: the first must load; others that cannot are left out."""
        await self.primary.served.load(holders)
        self._lanes[self.primary.model_id] = self.primary
        for spec in self._offered[1:]:
            try:
                assert spec is not None, "only the first model offered may be the demo"
                await self.offer(spec, holders)
            except Exception as exc:  # noqa: BLE001 - a bad extra model must not stop the node
                log.error("model %s is not served: %s", spec, exc)
        for lane in self:
            lane.offered = lane.model_id not in self._withdrawn

    async def offer(self, spec: str, holders: Holders) -> Lane:
        """Offer one more model (a folder or an id); raises if it cannot load."""
        lane = self._lanes.get(spec)
        if lane is None:
            lane = self._make(spec, True)
            await lane.served.load(holders)
            lane = self._lanes.setdefault(lane.model_id, lane)
            self._failed.pop(lane.model_id, None)
        lane.offered = True
        return lane

    def __iter__(self) -> Iterator[Lane]:
        """The loaded lanes, primary first, then by id (the coordinator's planning order)."""
        yield self.primary
        for model_id in sorted(m for m in self._lanes if m != self.primary.model_id):
            yield self._lanes[model_id]

    def get(self, model: str) -> Lane | None:
        """The loaded lane of ``model`` ("": the primary)."""
        if not model:
            return self.primary if self.primary.served.model_id is not None else None
        return self._lanes.get(model)

    def offered_ids(self) -> tuple[str, ...]:
        return tuple(lane.model_id for lane in self if lane.offered)

    def learn(self, model_ids: Iterable[str], holders: Holders) -> None:
        """Start loading each model peers announce that has no lane here yet."""
        for model_id in model_ids:
            failed_at = self._failed.get(model_id)
            if (
                not model_id
                or model_id in self._lanes
                or model_id in self._loading
                or (failed_at is not None and time.monotonic() - failed_at < RETRY_S)
            ):
                continue
            self._loading[model_id] = asyncio.create_task(
                self._load(model_id, holders), name=f"meshnode-lane-{model_id}"
            )

    async def _load(self, model_id: str, holders: Holders) -> None:
        lane = self._make(model_id, False)
        try:
            await lane.served.load(holders)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - logged; peers serve it without this node
            log.error(
                "model %s (offered by a peer) cannot be served here (trying again in %.0f s): %s",
                model_id,
                RETRY_S,
                exc,
            )
            self._failed[model_id] = time.monotonic()
            return
        finally:
            self._loading.pop(model_id, None)
        log.info("model %s (offered by a peer) is known here now; it may be placed on this node", model_id)
        self._lanes[model_id] = lane

    def used_by_others(self, model_id: str | None) -> dict[str, int]:
        """Bytes each node holds for the plans of the models other than ``model_id``."""
        used: dict[str, int] = {}
        for lane in self:
            plan = lane.served.plan
            if lane.model_id == model_id or plan is None:
                continue
            for stage in plan.stages:
                for node_id in stage.nodes:
                    used[node_id] = used.get(node_id, 0) + stage.bytes
        return used

    def longest_step(self) -> float:
        """Seconds taken so far by the longest step running now on any lane's stage server."""
        servers = (lane.served.stage_server for lane in self)
        return max((server.steps.longest() for server in servers if server is not None), default=0.0)

    async def close(self) -> None:
        for task in list(self._loading.values()):
            task.cancel()
        await asyncio.gather(*self._loading.values(), return_exceptions=True)
        for lane in self:
            lane.served.close()
