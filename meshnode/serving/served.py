"""One served model on this node: its plan, its shards, and where its requests run."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshnode.errors import ApiError
from meshnode.ids import ModelId
from meshnode.model.prefix_disk import PrefixDisk
from meshnode.model.prefixes import PrefixStore
from meshnode.model.shard import Shard
from meshnode.model.tensor import TensorShard
from meshnode.nodeinfo import MAX_FAULT_TEXT
from meshnode.planner.context import UNKNOWN
from meshnode.serving.drafting import load_draft
from meshnode.serving.engine import Engine
from meshnode.serving.loading import StageKey, close_shard, load_part, part_of, stage_key
from meshnode.serving.local_stage import LocalStage
from meshnode.serving.modelfiles import ModelFiles
from meshnode.serving.placements import HeadPlacement, RemoteHeadPlacement, gave_up, head_of, unavailable
from meshnode.serving.promptcache import PrefixIndex
from meshnode.serving.resilience import FailoverSource, NotReady
from meshnode.serving.settings import ServingSettings
from meshnode.serving.usage import CountedSource, UseCounter
from meshnode.transport.hop import HopSession
from meshnode.transport.remote_stage import RemoteStage
from meshnode.transport.stage_server import StageServer
from meshnode.weights.manifest import weights_identity

if TYPE_CHECKING:
    from meshnode.metrics import NodeMetrics, Progress
    from meshnode.model.pace import Pace
    from meshnode.model.scheduler import Baton, TokenScheduler
    from meshnode.planner.plans import Plan
    from meshnode.serving.drafting import DraftModel
    from meshnode.serving.mesh import Mesh
    from meshnode.serving.modelfiles import Holders
    from meshnode.serving.usage import Use
    from meshnode.trust.auth import ClusterAuth
    from meshnode.weights.profile import ModelProfile
    from meshnode.weights.store import ModelStore

log = logging.getLogger(__name__)

READY_POLL_S = 0.1  # how often a request waiting for a plan to load looks again


class ServedModel:
    """One model as this node serves it: loads this node's part of each plan adoption hands it
    (make before break: the previous plan serves until the new one is ready everywhere), serves its
    stages to peers, and finds a request's placement. It decides nothing about plans."""

    def __init__(
        self,
        settings: ServingSettings,
        node_id: str,
        *,
        scheduler: TokenScheduler,
        metrics: NodeMetrics,
        progress: Progress,
        mesh: Mesh,
        auth: ClusterAuth | None,
        group_secret: bytes,
        event: Callable[..., None],
        on_ready: Callable[[], object],
        model: str | None = None,
        store: ModelStore | None = None,
        learned: bool = False,
        pace: Pace | None = None,
    ) -> None:
        """``model``: a folder or an id (None: the demo); ``learned``: a peer's model."""
        self.settings, self.node_id, self.scheduler, self.metrics = settings, node_id, scheduler, metrics
        self.progress, self.mesh, self.auth, self.group_secret = progress, mesh, auth, group_secret
        self.event, self.on_ready, self.pace = event, on_ready, pace
        self.files = ModelFiles(settings, progress, event, model=model, store=store, learned=learned)
        self.engine: Engine | None = None
        self.stage_server: StageServer | None = None
        self.prefixes: PrefixStore | None = None  # the prompt cache
        self.prefix_index: PrefixIndex | None = None
        self.plan: Plan | None = None
        self.previous: Plan | None = None  # the last ready plan, served until the current one is
        self.plan_error = ""
        self.ready_epoch = 0
        # By stage key: Shards and TensorShards.
        self.shards: dict[StageKey, Shard | TensorShard] = {}
        self._apply_task: asyncio.Task[None] | None = None
        self._applying: Plan | None = None  # the plan _apply_task loads
        self._group_restart_at = 0.0
        self._placements: dict[int, Any] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.faults, self.last_fault = 0, ""
        self.use = UseCounter()  # requests for the model that came to this node
        self.draft: DraftModel | None = None

    async def load(self, holders: Holders) -> None:
        """The model's metadata and tokenizer (from peers if need be), engine and stage server."""
        self.loop = loop = asyncio.get_running_loop()
        await self.files.load(holders)
        s, f = self.settings, self.files
        model_id, tokenizer = f.model_id, f.tokenizer
        assert model_id is not None and tokenizer is not None, "the files' load() reads them"
        failover = FailoverSource(
            self.placement,
            deadline=s.failover_deadline,
            on_retry=self.metrics.retry,
            give_up=gave_up,
            same_epoch=self.placement_again,
        )
        source = CountedSource(
            failover,
            self.use,
            on_demand=self.on_demand,
            loaded=self.loaded,
            model=model_id,
            deadline=lambda: s.load_timeout,
            give_up=lambda exc: unavailable(str(exc), 5, "model_not_loaded"),
        )
        self.engine = Engine(
            model_id, tokenizer, source, max_context=self.context, vocab_size=f.vocab_size, metrics=self.metrics
        )
        self.engine.arrivals = self.scheduler.arrivals
        # What this node's stages keep, and as a head what it asked them to keep.
        weights = f"{model_id}-{weights_identity(f.path)[:12]}"
        self.prefixes, self.prefix_index = prompt_cache(s, self.metrics, self.context, weights, self.scheduler.baton)
        self.stage_server = StageServer(
            self.scheduler,
            vocab_size=f.vocab_size,
            max_chunk=s.placement.prefill_step_size,
            max_context=self.context,
            inject_latency=s.inject_latency_us * 1e-6,
            prefixes=self.prefixes,
            pace=self.pace,
            model=model_id,
            on_fault=lambda error: loop.call_soon_threadsafe(self.fault, error),  # from the MLX thread
        )

    async def load_draft(self, name: str | None) -> int:
        """The draft model ``name`` this model's requests guess with; the bytes it holds (0: none loaded)."""
        self.draft = await load_draft(name, self.scheduler, self.model_id, self.files.vocab_size)
        return self.draft.nbytes if self.draft is not None else 0

    @property
    def model_id(self) -> ModelId | None:
        return self.files.model_id

    @property
    def profile(self) -> Any:
        return self.files.profile

    @property
    def context(self) -> int:
        """Tokens of context a request gets: the plan's, else the setting's or the model's own."""
        return request_context(self.plan, self.settings, self.files.profile)

    def close(self) -> None:
        for shard in self.shards.values():
            close_shard(shard)
        self.shards = {}
        if self.prefixes is not None and self.prefixes.disk is not None:
            self.prefixes.disk.close()  # the prefixes still queued are written first

    def fault(self, error: str) -> None:
        """This node's computation raised: announced, so the coordinator stops placing the model here
        after ``FAULT_LIMIT``. A restart clears it."""
        self.faults, self.last_fault = self.faults + 1, error[:MAX_FAULT_TEXT]
        others = tuple(f for f in me.faults if f[0] != self.model_id) if (me := self.mesh.me) is not None else ()
        self.mesh.update_me(faults=(*others, (self.model_id, self.faults, self.last_fault)))
        self.event("fault", model=self.model_id, count=self.faults, error=self.last_fault)

    # ------------------------------------------------------------------ plans
    def take(self, plan: Plan) -> None:
        """A newer plan from adoption (loaded by :meth:`apply_soon`)."""
        if self.plan is not None and self.ready(self.plan):
            # Make before break.
            self.previous = self.plan
        self.plan = plan
        self.plan_error = ""

    def apply_soon(self, plan: Plan) -> None:
        task, loading = self._apply_task, self._applying
        if (
            task is not None
            and not task.done()
            and loading is not None
            and part_of(loading, self.node_id) == part_of(plan, self.node_id)
        ):
            # The newer plan wants what is loading: let it finish rather than drop a tensor group's
            # worker the other members may have formed their ring with.
            self._apply_task, self._applying = asyncio.create_task(self._load_after(task, plan)), plan
            return
        if task is not None:
            task.cancel()
        self._apply_task, self._applying = asyncio.create_task(load_part(self, plan)), plan

    async def _load_after(self, task: asyncio.Task[None], plan: Plan) -> None:
        # gather: cancelling this cancels the load too.
        await asyncio.gather(task, return_exceptions=True)  # a failure was logged; this plan tries anew
        await load_part(self, plan)

    def drop(self) -> None:
        self.plan = None
        self.previous = None
        self._placements.clear()

    def ensure_applied(self) -> None:
        """Retry a failed load, re-form a broken tensor group; not ready meanwhile, so the plan is never
        served half-loaded."""
        plan, task = self.plan, self._apply_task
        if task is not None and not task.done():
            return
        if task is not None and not task.cancelled():
            task.exception()  # _apply logged any failure; mark it seen
        if plan is None:
            return
        ready = self.ready_epoch >= plan.epoch
        if ready and _groups_alive(self.node_id, self.shards, plan):
            return
        if time.monotonic() - self._group_restart_at < 2 * self.settings.heartbeat_interval:
            return
        self._group_restart_at = time.monotonic()
        if ready:
            log.warning("epoch %d: a tensor group this node belongs to is down; forming it again", plan.epoch)
            self.event("group-down", epoch=plan.epoch)
            self.ready_epoch = plan.epoch - 1
        else:
            log.warning("epoch %d: loading this node's part again", plan.epoch)
        self._apply_task, self._applying = asyncio.create_task(load_part(self, plan)), plan

    def stage_server_now(self) -> StageServer:
        assert self.stage_server is not None, "load() made the stage server"
        return self.stage_server

    # ------------------------------------------------------------------ readiness
    def ready(self, plan: Plan) -> bool:
        """Every node of the plan is alive and has loaded its shard for it."""
        membership = self.mesh.membership
        alive = membership.alive_peers() if membership is not None else {}
        for node_id in plan.node_ids():
            if node_id == self.node_id:
                if self.ready_epoch < plan.epoch or plan.epoch not in self.stage_server_now().epochs:
                    return False
                if not _groups_alive(self.node_id, self.shards, plan):
                    return False
            else:
                peer = alive.get(node_id)
                if peer is None or self.model_id is None or peer.ready_epochs.get(self.model_id, 0) < plan.epoch:
                    return False
        return True

    def serving_plan(self) -> Plan | None:
        """The plan requests use now: the current one once ready, else the previous one still up."""
        if self.plan is not None and self.ready(self.plan):
            return self.plan
        if self.plan is not None and self.previous is not None and self.ready(self.previous):
            return self.previous
        return None

    def serving_ready(self) -> bool:
        return self.serving_plan() is not None

    # ------------------------------------------------------------------ placements
    def engine_for_request(self) -> Engine:
        """The engine, once the current plan can serve (else a 503)."""
        if not self.on_demand():
            self.placement(None)
        assert self.engine is not None, "load() made the engine"
        return self.engine

    async def engine_when_ready(self) -> Engine:
        """The engine once the current plan can serve. A plan loading or a mesh forming (a node
        restarted, a re-plan) is waited out for up to failover_deadline, as a generation in flight
        waits for its new placement; then, or for a model that does not fit, the 503."""
        until = time.monotonic() + self.settings.failover_deadline
        while True:
            try:
                return self.engine_for_request()
            except ApiError as err:
                if err.code != "mesh_unavailable" or time.monotonic() >= until:
                    raise
            await asyncio.sleep(READY_POLL_S)

    def on_demand(self) -> bool:
        """Requests wait for the mesh to load the model (unloaded, or reloading)."""
        if self.plan is None:
            return False
        serving = self.serving_plan()
        return self.plan.unloaded or (serving is not None and serving.unloaded)

    def planned(self, why_not: str = "") -> bool:
        """The coordinator's verdict: a plan fits (""), or why none does; True when that is news."""
        news, self.plan_error = why_not != self.plan_error, why_not
        return news

    def unplaced_because(self) -> str:
        """Why no plan fits, as the coordinator said; "" if none is known."""
        return self.plan_error or (self.mesh.plan_error_of(self.model_id) if self.model_id is not None else "")

    def use_now(self) -> Use:
        """This node's requests; one whose model was unloaded under it counts as waiting, so the
        coordinator loads it again."""
        use = self.use.now()
        if use.active and self.on_demand():
            use = dataclasses.replace(use, waiting=use.waiting + use.active)
        return use

    def loaded(self) -> bool:
        serving = self.serving_plan()
        return serving is not None and not serving.unloaded

    def placement(self, after_epoch: int | None) -> HeadPlacement | RemoteHeadPlacement:
        """The placement of the current plan; with ``after_epoch``, only a newer, ready one."""
        plan = self.plan
        waiting = after_epoch is not None
        if plan is None:
            if error := self.unplaced_because():
                raise unavailable(f"the model does not fit on the nodes available: {error}", 5, "insufficient_capacity")
            if waiting:
                raise NotReady("no plan yet")
            raise unavailable("the mesh is still forming; no plan yet")
        serving: Any = self.serving_plan()  # Any: below, `waiting` means after_epoch is an int; mypy cannot tell
        if serving is not None and serving.unloaded:
            if waiting:
                raise NotReady(f"model {self.model_id} is not loaded")
            raise unavailable(f"model {self.model_id} is not loaded now ({serving.reason})")
        if serving is None or (waiting and serving.epoch <= after_epoch):
            if waiting:
                raise NotReady(f"epoch {plan.epoch} is loading")
            raise unavailable(f"loading the model's shards for epoch {plan.epoch}")
        return self.placement_for(serving)

    def placement_again(self, epoch: int, since: float) -> HeadPlacement | RemoteHeadPlacement | None:
        """``epoch``'s placement again after a generation lost it at ``since``, if no newer plan is
        known and every node was heard from since; else None."""
        plan = self.serving_plan()
        if plan is None or plan.epoch != epoch or self.plan is None or self.plan.epoch != epoch:
            return None
        if not all(self.mesh.heard_since(n, since) for n in plan.node_ids()):
            return None
        return self.placement_for(plan)

    def placement_for(self, plan: Plan) -> HeadPlacement | RemoteHeadPlacement:
        """``plan``'s placement, made once per epoch (the two newest epochs' are kept)."""
        placement = self._placements.get(plan.epoch)
        if placement is None:
            placement = self._placements[plan.epoch] = new_placement(self, plan)
            for epoch in [e for e in self._placements if e < plan.epoch - 1]:
                del self._placements[epoch]
        return placement


def _groups_alive(node_id: str, shards: dict[StageKey, Shard | TensorShard], plan: Plan) -> bool:
    """Every tensor group of ``plan`` that ``node_id`` is a member of has its worker up."""
    for stage in plan.stages:
        if node_id in stage.nodes and len(stage.nodes) > 1:
            shard = shards.get(stage_key(stage))
            if not isinstance(shard, TensorShard) or not shard.alive():
                return False
    return True


def new_placement(served: ServedModel, plan: Plan) -> HeadPlacement | RemoteHeadPlacement:
    """Where ``plan``'s requests run from this node: here, where it holds the plan's head, else on the head."""
    if head_of(plan) != served.node_id:
        assert served.model_id is not None, "load() named the model"
        return RemoteHeadPlacement(
            plan.epoch,
            head_of(plan),
            served.node_id,
            served.mesh.data_channel,
            served.mesh.heard_within,
            model=served.model_id,
        )
    metrics = served.metrics
    return HeadPlacement(
        plan.epoch,
        served.scheduler,
        stage_handles(served, plan),
        served.settings.placement,
        prefixes=served.prefix_index,
        tokenizer=served.files.tokenizer,
        on_fault=served.fault,
        on_lockstep_round=metrics.lockstep_round,
        on_speculated=metrics.speculated,
        on_spec_costs=metrics.pass_costs,
        draft=served.draft,
        mtp=served.files.mtp,
        lockstep=not plan.kv_bits and all(len(s.nodes) == 1 for s in plan.stages),
    )


def stage_handles(served: ServedModel, plan: Plan) -> list[LocalStage | RemoteStage]:
    """Each stage of ``plan`` as this node reaches it: its own shard, or a peer."""
    handles: list[LocalStage | RemoteStage] = []
    loop, model_id = served.loop, served.model_id
    assert loop is not None and model_id is not None, "the model is loaded"
    for stage in plan.stages:
        node_id = stage.nodes[0]
        key = stage_key(stage)
        if node_id == served.node_id:
            shard = served.shards.get(key)
            if shard is None:
                raise RuntimeError(f"layers [{key[0]}, {key[1]}) are not loaded here")
            # A tensor group's member runs its layers as a Shard does.
            handles.append(LocalStage(shard, served.prefixes if shard.keeps_prefixes else None))
        else:
            handles.append(
                RemoteStage(
                    node_id=node_id,
                    channel=served.mesh.data_channel(node_id),
                    loop=loop,
                    start=stage.start_layer,
                    end=stage.end_layer,
                    epoch=plan.epoch,
                    hidden_size=served.profile.hidden_size,
                    hop_timeout=served.settings.failure_timeout,
                    observe=served.metrics.hop_observer(node_id),
                    data_port=functools.partial(served.mesh.data_port_of, node_id),
                    auth=served.auth,
                    caller=served.node_id,
                    alive=functools.partial(served.mesh.heard_within, node_id),
                    data_session=HopSession,
                    model=model_id,
                )
            )
    return handles


def request_context(plan: Plan | None, settings: ServingSettings, profile: ModelProfile | None) -> int:
    if plan is not None and plan.max_context:
        return plan.max_context
    return settings.max_context or (profile.trained_context if profile is not None else 0) or UNKNOWN


def prompt_cache(
    settings: ServingSettings, metrics: NodeMetrics, context: int, model: str, baton: Baton
) -> tuple[PrefixStore | None, PrefixIndex | None]:
    """A node's prompt cache (off: None, None), sized to the KV the plan reserves, and on disk
    when ``prompt_cache_disk`` allows."""
    if not settings.prompt_cache:
        return None, None
    disk = None  # ``model``: the model id and its weights' identity, which names the folder
    if settings.prompt_cache_disk > 0:
        disk = PrefixDisk(
            settings.cache_dir / "prompt-cache",
            model,
            settings.prompt_cache_disk,
            on_write=metrics.prompt_cache_written,
        )
    index = PrefixIndex(disk=disk)
    # A prefix gone from this node is gone from at least this stage: the head stops offering it.
    store = PrefixStore(
        settings.kv_requests * context,
        on_resume=metrics.prompt_cache_resumed,
        on_drop=lambda key: index.forget(key, "given up for room"),
        disk=disk,
        mlx_turn=baton.turn,
    )
    return store, index


def plan_status(plan: Plan | None, estimate_now: float | None) -> dict[str, Any] | None:
    """The plan as ``/v1/mesh`` shows it."""
    if plan is None:
        return None
    return {
        "epoch": plan.epoch,
        "model": plan.model,
        "strategy": plan.strategy,
        "reason": plan.reason,
        "max_context": plan.max_context,
        "kv_bits": plan.kv_bits,
        "estimate_s": plan.estimate_s or None,
        "tokens_per_s": plan.tokens_per_s or None,
        "tokens_per_s_now": round(1 / estimate_now, 3) if estimate_now else None,
        "alternatives": list(plan.alternatives),
        "stages": [
            {
                "start_layer": s.start_layer,
                "end_layer": s.end_layer,
                "nodes": list(s.nodes),
                "bytes": s.bytes,
                "endpoints": list(s.endpoints),
            }
            for s in plan.stages
        ],
    }
