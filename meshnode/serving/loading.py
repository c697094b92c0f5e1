"""Loading this node's part of a plan: its shards or tensor group member, fetching layers this disk
lacks from peers first; swapped in only once all are loaded (make before break)."""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import mlx.core as mx

from meshnode.config import TENSOR_PORTS
from meshnode.model.shard import Shard
from meshnode.model.tensor import TensorGroupError, TensorShard
from meshnode.serving.mtp_heads import load_for_plan
from meshnode.serving.settings import ServingSettings

if TYPE_CHECKING:
    from meshnode.planner.plans import Plan, Stage
    from meshnode.serving.mesh import Mesh
    from meshnode.serving.modelfiles import ModelFiles

log = logging.getLogger(__name__)

# The ServedModel (serving/served.py) whose part these functions load: that module imports this
# one, and its parts are optional until loaded, which its callers here take as given.
Served = Any

# What a node holds for a stage: (start, end) layers, and for a tensor group its members too.
StageKey: TypeAlias = "tuple[int, int] | tuple[int, int, tuple[str, ...]]"


def stage_key(stage: Stage) -> StageKey:
    """What a node holds for a stage: its layers, and for a tensor group its members."""
    if len(stage.nodes) == 1:
        return (stage.start_layer, stage.end_layer)
    return (stage.start_layer, stage.end_layer, tuple(stage.nodes))


def part_of(plan: Plan, node_id: str) -> tuple[int, frozenset[StageKey]]:
    """This node's stage keys in the plan, and the KV cache kind its groups' workers build."""
    return plan.kv_bits, frozenset(stage_key(s) for s in plan.stages if node_id in s.nodes)


def close_shard(shard: Shard | TensorShard) -> None:
    if isinstance(shard, TensorShard):
        shard.close()


def tensor_member(
    stage: Stage,
    path: Path,
    *,
    node_id: str,
    mesh: Mesh,
    num_layers: int,
    settings: ServingSettings,
    secret: bytes,
    kv_bits: int = 0,
    model: str = "",
) -> TensorShard:
    """This node's member of the stage's tensor group; every member derives the endpoints alike."""
    alive = mesh.alive_infos()
    # The model too: two models' groups on the same nodes and layers need rings of their own.
    key = f"{model}/{stage.start_layer}-{stage.end_layer}-{','.join(stage.nodes)}"
    offset = zlib.crc32(key.encode()) % TENSOR_PORTS
    endpoints, controls = [], []
    for member in stage.nodes:
        info = mesh.me if member == node_id else alive.get(member)
        if info is None or not info.tensor_port:
            raise TensorGroupError(f"group member {member} is unknown or has no tensor port")
        # The plan's address (the fastest path), else the member's first announced one.
        chosen = getattr(stage, "endpoints", ())
        host = chosen[stage.nodes.index(member)] if chosen else info.addresses[0]
        endpoints.append(f"{host}:{info.tensor_port + offset}")
        controls.append(f"{host}:{info.tensor_port + TENSOR_PORTS + offset}")
    return TensorShard(
        path,
        stage.start_layer,
        stage.end_layer,
        num_layers,
        rank=stage.nodes.index(node_id),
        endpoints=endpoints,
        control=controls[0],
        secret=secret,
        hop_timeout=settings.failure_timeout,
        inject_latency=settings.inject_latency_us * 1e-6,
        kv_bits=kv_bits,
        members_alive=lambda: all(mesh.heard_within(n) for n in stage.nodes),
    )


async def load_part(served: Served, plan: Plan) -> None:
    """Load this node's shards for the plan (make before break), then serve them."""
    wanted: dict[StageKey, Shard | TensorShard] = {}
    launching: list[TensorShard] = []
    try:
        for stage in plan.stages:
            if served.node_id not in stage.nodes:
                continue
            key = stage_key(stage)
            shard = served.shards.get(key)
            if isinstance(shard, TensorShard) and not shard.alive():
                shard = None  # its worker died: start the group again
            elif isinstance(shard, TensorShard) and shard.kv_bits != plan.kv_bits:
                # Its worker builds the other cache kind: close it (freeing its ports), start anew.
                log.info(
                    "epoch %d: kv_bits %d (was %d): starting the tensor group for layers [%d, %d) again",
                    plan.epoch,
                    plan.kv_bits,
                    shard.kv_bits,
                    key[0],
                    key[1],
                )
                shard.close()
                shard = None
            if shard is None and len(stage.nodes) == 1:
                log.info("loading layers [%d, %d) for epoch %d", key[0], key[1], plan.epoch)
                t0 = time.monotonic()
                task = f"loading layers {key[0]}-{key[1] - 1} of {served.model_id}"
                path = await layers_folder(served, key[0], key[1])
                try:
                    shard = await served.scheduler.call(
                        lambda k=key, t=task, p=path: Shard(
                            p, k[0], k[1], progress=lambda d, n: served.progress.update(t, d, n)
                        )
                    )
                finally:
                    served.progress.finish()
                log.info("layers [%d, %d) loaded in %.2f s", key[0], key[1], time.monotonic() - t0)
            elif shard is None:
                shard = tensor_member(
                    stage,
                    await layers_folder(served, key[0], key[1]),
                    node_id=served.node_id,
                    mesh=served.mesh,
                    num_layers=served.profile.num_layers,
                    settings=served.settings,
                    secret=served.group_secret,
                    kv_bits=plan.kv_bits,
                    model=served.model_id,
                )
                launching.append(shard)
                t0 = time.monotonic()
                await asyncio.to_thread(shard.launch, served.settings.group_ready_timeout)
                launching.remove(shard)
                served.event(
                    "group-ready",
                    layers=[key[0], key[1]],
                    nodes=list(stage.nodes),
                    seconds=round(time.monotonic() - t0, 2),
                )
            if isinstance(shard, Shard):  # its requests' caches from now on: the plan's
                shard.kv_bits = plan.kv_bits
            wanted[key] = shard
    except BaseException as exc:
        for shard in launching:
            shard.close()  # unblocks the launching thread
        if not isinstance(exc, asyncio.CancelledError):
            log.error("epoch %d: could not load this node's part: %s", plan.epoch, exc)
            served.event("load-failed", epoch=plan.epoch, error=str(exc))
        raise
    await load_for_plan(served, plan, wanted)  # before the plan serves: its placement drafts with the head
    if served.plan is not plan:
        keep_for_newer(served, wanted)
        return
    replaced = [v for k, v in served.shards.items() if k in wanted and v is not wanted[k]]
    served.shards = {**served.shards, **wanted}
    for shard in replaced:
        close_shard(shard)
    mine = {(s.start_layer, s.end_layer): wanted[stage_key(s)] for s in plan.stages if s.nodes[0] == served.node_id}
    served.stage_server.serve(plan.epoch, mine)
    use_context(served, served.context)
    served.ready_epoch = plan.epoch
    log.info("ready for epoch %d", plan.epoch)
    asyncio.create_task(served.on_ready())  # tell the mesh now, not at the next beat


def retire_previous(served: Served) -> None:
    """Once ``served``'s current plan is ready everywhere, free its older epochs' shards."""
    plan = served.plan
    if plan is None or not served.ready(plan):
        return
    if served.previous is None and list(served.stage_server_now().epochs) == [plan.epoch]:
        return
    keep = {stage_key(s) for s in plan.stages if served.node_id in s.nodes}
    for key, shard in served.shards.items():
        if key not in keep:
            close_shard(shard)
    closed = len(served.shards) > len(keep & served.shards.keys())
    served.shards = {k: v for k, v in served.shards.items() if k in keep}
    served.stage_server_now().retire_before(plan.epoch)
    if closed:
        mx.clear_cache()  # the machine gets the memory back, not only MLX's buffer cache
    if served.previous is not None:
        log.info("epoch %d is ready everywhere; epoch %d retired", plan.epoch, served.previous.epoch)
    served.previous = None


def keep_for_newer(served: Served, loaded: dict[StageKey, Shard | TensorShard]) -> None:
    """A newer plan came while this load ran: keep what it wants too, close the rest."""
    newer = part_of(served.plan, served.node_id)[1] if served.plan is not None else frozenset()
    held = dict(served.shards)
    for key, shard in loaded.items():
        old = held.get(key)
        if old is shard:
            continue
        if key in newer and (old is None or isinstance(old, TensorShard) and not old.alive()):
            if old is not None:
                close_shard(old)
            held[key] = shard
        else:
            close_shard(shard)
    served.shards = held


async def layers_folder(served: Served, start: int, end: int) -> Path:
    """The layers' folder, fetched from peers if missing, then announced as held."""
    files: ModelFiles = served.files
    if (local := files.local_layers(start, end)) is not None:
        return local
    alive = served.mesh.alive_infos()
    peers = [
        (nid, served.mesh.channel_to(nid))
        for nid, info in sorted(alive.items())
        if nid != served.node_id and any(m == served.model_id for m, _, _ in info.holdings)
    ]
    path = await files.fetch_layers(start, end, peers)
    served.mesh.update_me(holdings=files.holdings())
    return path


def use_context(served: Served, context: int) -> None:
    """Apply the plan's context to the API, the stages and the kept prefixes."""
    served.engine.max_context = served.stage_server.max_context = context
    if served.prefixes is not None:
        served.prefixes.capacity = served.settings.kv_requests * context
