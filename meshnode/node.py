"""One running meshnode: the composition root. ``run_node`` is what ``meshnode run`` calls.

The parts and where they live: docs/architecture.md, "Where things live".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc
from aiohttp import web

from meshnode import blas, sysinfo
from meshnode.api.app import make_app
from meshnode.api.core import ApiSettings
from meshnode.api.unservable import refuse_until
from meshnode.config import DATA_OFFSET, ECHO_OFFSET, Settings
from meshnode.control import budget, pacing
from meshnode.control.adoption import Adoption
from meshnode.control.budget import Budget
from meshnode.control.coordinator import Coordinator
from meshnode.control.discovery import Discovery, announced_addresses
from meshnode.control.echo import EchoServer
from meshnode.control.lanes import Lane, Lanes
from meshnode.control.links import probe_reply
from meshnode.control.offers import Offers, read_offers, write_offers
from meshnode.control.peers import Peers
from meshnode.control.plane import ControlPlane
from meshnode.control.settings import ControlSettings, PeerSettings, PlanSettings
from meshnode.control.status import mesh_status, model_state
from meshnode.errors import ApiError
from meshnode.hooks import NodeHooks
from meshnode.identity import cluster_id as derive_cluster_id
from meshnode.identity import load_or_create_node_id
from meshnode.metrics import EventLog, NodeMetrics, Progress
from meshnode.model.compute import collective_overhead, layer_seconds, tensor_layer_seconds
from meshnode.model.pace import Pace
from meshnode.model.scheduler import TokenScheduler
from meshnode.nodeinfo import NodeInfo
from meshnode.planner import supports_tensor
from meshnode.proto import mesh_pb2
from meshnode.serving.engine import Engine
from meshnode.serving.placements import serve_generate
from meshnode.serving.served import ServedModel
from meshnode.serving.settings import ServingSettings
from meshnode.transport.dataport import DataServer
from meshnode.transport.routing import StageRouter, not_served
from meshnode.transport.service import Handlers, start_server
from meshnode.transport.stage_server import StageServer
from meshnode.trust import tls
from meshnode.trust.auth import ClusterAuth, tensor_group_secret
from meshnode.version import PROTOCOL, describe
from meshnode.weights.modelsource import ModelNotFound
from meshnode.weights.profile import ModelProfile
from meshnode.weights.store import ModelStore

log = logging.getLogger(__name__)


class NodeBackend:
    """What the HTTP API asks of the node."""

    def __init__(self, node: Node):
        self.node = node
        self.metrics = node.metrics

    def engine(self, model: str) -> Engine:
        return self._served(model).engine_for_request()

    async def ready_engine(self, model: str) -> Engine:
        return await self._served(model).engine_when_ready()

    def _served(self, model: str) -> ServedModel:
        offered = self.node.offered_models()
        served = self.node.models.get(model) if model in offered else None
        if served is None:
            raise ApiError(
                404,
                f"model '{model}' is not served here; this mesh serves "
                f"{', '.join(repr(m) for m in self.node.models if m in offered)}",
                param="model",
                code="model_not_found",
            )
        return served

    def models(self) -> list[dict[str, Any]]:
        """Every model the mesh serves: ready, loading, on demand or does not fit."""
        offered = self.node.offered_models()
        return [
            {
                "id": model_id,
                "state": model_state(served),
                "context_length": served.context if served.files.profile is not None else None,
            }
            for model_id, served in self.node.models.items()
            if model_id in offered
        ]

    async def add_model(self, spec: str) -> dict[str, Any]:
        """Offer one more model from now on (and after a restart): the mesh then serves it too."""
        node = self.node
        try:
            lane = await node.lanes.offer(spec, node.holders)
        except Exception as exc:  # noqa: BLE001 - the caller's model: ModelNotFound, a bad folder, ...
            raise ApiError(400, f"cannot offer model {spec!r}: {exc}", param="add", code="model_not_loadable") from None
        await node.announce_models(node.offers.add(spec, lane.model_id), f"offering model {lane.model_id}")
        return {"model": lane.model_id, "offered": True, "offered_here": list(node.lanes.offered_ids())}

    async def remove_model(self, model_id: str) -> dict[str, Any]:
        """Stop offering a model (the mesh stops serving it once no live node offers it)."""
        node = self.node
        lane = node.lanes.get(model_id)
        if lane is None or not lane.offered:
            raise ApiError(
                404,
                f"model {model_id!r} is not offered by this node; it offers "
                f"{', '.join(node.lanes.offered_ids()) or 'none'}",
                param="remove",
                code="model_not_found",
            )
        lane.offered = False
        offers = node.offers.remove(model_id, lane.served.files.spec)
        await node.announce_models(offers, f"no longer offering model {model_id}")
        return {"model": model_id, "offered": False, "offered_here": list(node.lanes.offered_ids())}

    def model_profile(self, model: str) -> ModelProfile | None:
        """The served model's shape and sizes (the Ollama surface's details), None before they are known."""
        served = self.node.models.get(model)
        return served.profile if served is not None else None

    def health(self) -> tuple[bool, dict[str, Any]]:
        ok = self.node.serving_ready()
        return ok, {
            "status": "ok" if ok else "unavailable",
            "node_id": self.node.node_id,
            "version": describe(),
            "epoch": self.node.epoch,
        }

    def mesh_status(self) -> dict[str, Any]:
        node = self.node
        return mesh_status(node.control, node.events, node.progress, node.metrics, node.measuring)


def _lane(
    node: Node,
    serving: ServingSettings,
    planning: PlanSettings,
    store: ModelStore,
    group_secret: bytes,
    model: str | None,
    offered: bool,
) -> Lane:
    """One served model of ``node``: its files and stages, plan adoption and coordinator."""
    served = ServedModel(
        serving,
        node.node_id,
        scheduler=node.scheduler,
        metrics=node.metrics,
        progress=node.progress,
        mesh=node.peers,
        auth=node.auth,
        group_secret=group_secret,
        event=node.events,
        on_ready=lambda: node.control.beat_now(),
        model=model,
        store=store,
        learned=not offered,
        pace=node.pace,
    )
    adoption = Adoption(served, grace=max(1.0, 2 * node.settings.heartbeat_interval), event=node.events)
    coordinator = Coordinator(
        planning,
        node.node_id,
        node.peers,
        adoption,
        event=node.events,
        used_by_others=lambda: node.lanes.used_by_others(served.model_id),
    )
    return Lane(served, adoption, coordinator, offered)


class Node:
    """Builds a node's parts, wires them, starts and stops them, and decides nothing itself."""

    def __init__(self, settings: Settings, hooks: NodeHooks | None = None):
        hooks = hooks or NodeHooks()
        self.settings = settings
        self.started_at = time.time()
        self.node_id = load_or_create_node_id(settings.resolved_state_dir(), settings.node_id)
        self.cluster_id = derive_cluster_id(settings.cluster_key)
        self.auth = ClusterAuth(settings.cluster_key)  # every gRPC call in and out is signed
        # encrypt: mutual TLS with a certificate derived from the cluster key
        self.tls = tls.derive_identity(settings.cluster_key) if settings.encrypt else None
        if not settings.authenticate:
            log.warning("authenticate = false: gRPC calls are not signed (tests and benchmarks only)")
        group_secret = tensor_group_secret(settings.cluster_key)
        self.memory_budget = sysinfo.memory_budget(settings)
        sysinfo.use_recommended_wired_limit()
        self.scheduler = TokenScheduler()
        self.metrics = NodeMetrics(
            epoch=lambda: self.epoch,  # GET /metrics
            unreachable=lambda: len(self.peers.reach.unreachable()),
        )
        self.progress = Progress()  # model loading
        self.measuring: str | None = None  # what it times now (requests run slower)
        # How fast this node computes now against its measured figure (None: slow_factor = 0).
        self.pace = Pace(settings.slow_factor, settings.slow_dwell) if settings.slow_factor else None
        self.events = EventLog(self.metrics)
        self.peers = Peers(PeerSettings.of(settings), self.node_id, self.auth, self.tls, stalled_for=self._stalled_for)
        # Every model this node serves is a lane, sharing one store of held models.
        store = ModelStore(settings.resolved_cache_dir() / "peer-models")
        serving, planning = ServingSettings.of(settings), PlanSettings.of(settings)
        if hooks.drafters is not None:
            serving = dataclasses.replace(
                serving, placement=dataclasses.replace(serving.placement, drafters=hooks.drafters)
            )

        lane = functools.partial(_lane, self, serving, planning, store, group_secret)
        self.offers = read_offers(settings.resolved_state_dir())  # `meshnode models add|remove` since
        self.lanes = Lanes(lane, self.offers.offered(settings.offered_models()), frozenset(self.offers.withdrawn))
        self.served = self.lanes.primary.served  # the first model's
        self.control = ControlPlane(
            ControlSettings.of(settings),
            self.node_id,
            self.cluster_id,
            self.started_at,
            self.peers,
            self.lanes,
            event=self.events,
            holders=self.holders,
        )
        self.router = StageRouter(self._stage_server_of, self.scheduler.run_here, stream_hook=hooks.stream_hook)
        self.discovery: Discovery | None = None
        self.http_port, self.grpc_port = settings.http_port, settings.grpc_port
        self._grpc = None
        self._http: web.AppRunner | None = None
        self._echo: EchoServer | None = None  # lets peers time the network without the RPC stack
        self._data: DataServer | None = None  # activations in bare TCP frames
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = threading.Event()  # set by stop(): work in threads ends early

    # ------------------------------------------------------------------ what tests and the API read
    @property
    def model_id(self) -> str | None:
        return self.served.model_id

    @property
    def stage_server(self) -> StageServer | None:
        return self.served.stage_server

    @property
    def epoch(self) -> int:
        return self.control.adoption.epoch

    @property
    def models(self) -> dict[str, ServedModel]:
        """The served models by id (requests find theirs here), the first model first."""
        return {lane.model_id: lane.served for lane in self.lanes if lane.model_id is not None}

    async def announce_models(self, offers: Offers, what: str) -> None:
        """Keep ``offers`` (they hold after a restart) and tell the mesh which models this node offers now."""
        self.offers = offers
        write_offers(self.settings.resolved_state_dir(), offers)
        me = self.peers.update_me(models=self.lanes.offered_ids(), holdings=self.served.files.holdings())
        if self.discovery is not None:
            await self.discovery.update(me)
        log.info("%s (offered here: %s)", what, ", ".join(self.lanes.offered_ids()) or "none")
        self.events("models", offered=list(self.lanes.offered_ids()))
        await self.control.beat_now()

    def offered_models(self) -> set[str]:
        """The models the mesh serves: those its live nodes offer (this node's before it has peers)."""
        return self.peers.offered_models() if self.peers.membership is not None else set(self.models)

    def holders(
        self, model_id: str
    ) -> contextlib.AbstractAsyncContextManager[Callable[[], list[tuple[str, grpc.aio.Channel]]]]:
        return self.peers.holders_of(model_id, self.cluster_id)

    def _stage_server_of(self, model: str) -> StageServer | None:
        lane = self.lanes.get(model)
        return lane.served.stage_server if lane is not None else None

    def serving_ready(self) -> bool:
        return self.served.serving_ready()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        s, served = self.settings, self.served
        await self.lanes.start(self.holders)
        if s.speculative == "draft_model":
            self.memory_budget = max(0, self.memory_budget - await served.load_draft(s.draft_model))
        handlers = Handlers(
            heartbeat=self.control.heartbeats.on_heartbeat,
            install=self.control.on_install,
            goodbye=self.control.heartbeats.on_goodbye,
            generate=self._on_generate,
            stage_server=self.router,
            store=served.files.store,
            probe=probe_reply,
            probe_delay_s=s.inject_latency_us * 1e-6,
        )
        self._grpc, self.grpc_port = await start_server(
            handlers,
            s.host,
            s.grpc_port,
            interceptors=[self.auth.server_interceptor()] if s.authenticate else (),
            identity=self.tls,
        )
        await self._start_http()
        tensor_port = s.tensor_port or self.grpc_port + 1
        self._start_side_ports(tensor_port)
        files, profile = served.files, served.files.loaded_profile
        me = NodeInfo(
            node_id=self.node_id,
            addresses=announced_addresses(s.host),
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            memory_budget=self.memory_budget,
            total_memory=sysinfo.total_memory(),
            compute=await asyncio.to_thread(sysinfo.compute_figure),
            version=describe(),
            protocol=PROTOCOL,
            cluster_id=self.cluster_id,
            models=self.lanes.offered_ids(),
            started_at=self.started_at,
            tensor_port=tensor_port,
            layer_seconds=await self.scheduler.call(
                lambda: layer_seconds(
                    files.path, profile.num_layers, s.resolved_state_dir(), max(profile.layer_bytes, default=0)
                )
            )
            if files.weights_local
            else 0.0,
            holdings=files.holdings(),
        )
        self.peers.start(me)
        if self.pace is not None:
            self._tasks.append(pacing.start(self.pace, self.scheduler, self.peers, self.lanes, self.events))
        if s.memory_margin:
            offer = Budget(self.memory_budget, s.memory_margin, s.memory_dwell)
            self._tasks.append(budget.start(offer, self.peers, self.events))
        # a node set to plan single or pipeline only makes no tensor group: it times none
        if supports_tensor(profile) and files.weights_local and s.strategy not in ("single", "pipeline"):
            self._tasks.append(asyncio.create_task(self._measure_collectives(me), name="meshnode-collective"))
        if s.mdns:
            self.discovery = Discovery(
                me, on_change=lambda nid, info: self.peers.on_discovery(nid, info, self.cluster_id)
            )
            await self.discovery.start()
        self._tasks.append(asyncio.create_task(self.control.run(), name="meshnode-control"))
        self._tasks.append(asyncio.create_task(self.peers.links.run(self.peers.probe_targets), name="meshnode-links"))
        log.info(
            "node %s up: HTTP :%d, gRPC :%d, budget %.2f GiB, cluster %s, CPU matmuls: %s",
            self.node_id,
            self.http_port,
            self.grpc_port,
            self.memory_budget / 2**30,
            self.cluster_id,
            blas.in_use(),
        )
        if blas.problem:
            log.error("%s; MLX's own BLAS computes instead", blas.problem)

    def _start_side_ports(self, tensor_port: int) -> None:
        """The link echo and the data port, next to gRPC (each optional: peers fall back to gRPC)."""
        s = self.settings
        try:
            self._echo = EchoServer(s.host or "0.0.0.0", tensor_port + ECHO_OFFSET, delay=s.inject_latency_us * 1e-6)
        except OSError as exc:  # peers then time the link with gRPC calls, the RPC stack included
            log.warning("link echo not started on port %d: %s", tensor_port + ECHO_OFFSET, exc)
        if s.fast_hops and self.tls is None:  # encrypted clusters keep activations on TLS
            try:
                self._data = DataServer(
                    s.host or "0.0.0.0",
                    tensor_port + DATA_OFFSET,
                    auth=self.auth,
                    verify=s.authenticate,
                    forward=self.router.data,
                )
            except OSError as exc:  # peers then send this node's activations over gRPC
                log.warning(
                    "data port not started on %d: %s; activations come over gRPC", tensor_port + DATA_OFFSET, exc
                )
        self.peers.data_port_open = self._data is not None

    def _stalled_for(self) -> float:
        """Seconds the longest model step here has run, once past stall_timeout (0: none is stalled)."""
        longest = self.lanes.longest_step()
        return longest if longest >= self.settings.stall_timeout else 0.0

    async def _start_http(self) -> None:
        s = self.settings
        app = make_app(NodeBackend(self), ApiSettings.of(s))
        self._http = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._http.setup()
        site = web.TCPSite(self._http, s.host, s.http_port)
        await site.start()
        self.http_port = self._http.addresses[0][1]

    async def stop(self) -> None:
        self._stopping.set()  # a compute measurement still running in a thread kills its processes
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.peers.membership is not None:
            await asyncio.gather(
                *(self.control.heartbeats.say_goodbye(p.target) for p in self.peers.membership.alive_peers().values()),
                return_exceptions=True,
            )
        if self.discovery is not None:
            await self.discovery.stop()
        if self._http is not None:
            await self._http.cleanup()
        await self.lanes.close()
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        await self.peers.close()
        if self._echo is not None:
            self._echo.close()
        if self._data is not None:
            self._data.close()
        self.scheduler.stop()

    async def _on_generate(
        self, request: mesh_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[mesh_pb2.GenerateReply, None]:
        lane = self.lanes.get(request.model)
        if lane is None:
            refusal = not_served(request.model)
            await context.abort(refusal.code, str(refusal))
            return  # abort raises; the checker cannot see it in grpc's untyped API
        async with contextlib.aclosing(serve_generate(lane.served, request, context, lane.adoption.epoch)) as replies:
            async for reply in replies:  # closed in turn when this stream is
                yield reply

    async def _measure_collectives(self, me: NodeInfo) -> None:
        """Once a peer is there to group with (not for a node alone), time a layer split two ways over
        a loopback ring here (cached), so the planner prices tensor groups."""
        while self.peers.membership is None or not self.peers.membership.alive_peers():
            await asyncio.sleep(1.0)
        files, profile = self.served.files, self.served.files.loaded_profile
        self.measuring = "a layer split two ways (what tensor parallelism costs here)"
        try:
            split = await asyncio.to_thread(
                tensor_layer_seconds,
                files.path,
                profile.num_layers,
                self.settings.resolved_state_dir(),
                max(profile.layer_bytes, default=0),
                self._stopping,
            )
        finally:
            self.measuring = None
        value = collective_overhead(me.layer_seconds, split)
        if value > 0:
            self.peers.update_me(collective_seconds=value)


async def serve(settings: Settings, hooks: NodeHooks | None = None) -> None:
    node = Node(settings, hooks)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await node.start()
    except ModelNotFound as exc:  # nothing started yet: the model comes first
        log.error(
            "%s. Until the model is fixed and the node restarted, it answers every request with this reason (HTTP 503)",
            exc,
        )
        await refuse_until(stop, settings.host, settings.http_port, str(exc))
        return
    try:
        await stop.wait()
    finally:
        log.info("stopping: saying goodbye to peers")
        await node.stop()


def run_node(settings: Settings, hooks: NodeHooks | None = None) -> int:
    asyncio.run(serve(settings, hooks))
    return 0
