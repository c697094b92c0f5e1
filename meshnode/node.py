"""One running meshnode: model, scheduler, gRPC and HTTP servers, and the control plane.

Every node runs the same loop. It learns of peers (mDNS, static ``--peer`` addresses, and
gossip in heartbeat replies), heartbeats them, and keeps the set of live nodes. The oldest
live node coordinates: it plans (pure planner over the nodes' memory budgets) and publishes
each new plan with a higher epoch. Every node loads the shard the plan gives it and reports
the epoch it is ready for; the node holding the model's last layers (the head) runs each
generation, calling the other stages over gRPC. Any node serves HTTP: the head generates
locally, the others ask the head for tokens.

``run_node`` is what ``meshnode run`` calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import signal
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from mlx_lm.utils import load_config, load_tokenizer

from meshnode import __version__
from meshnode.api.server import ApiSettings, make_app
from meshnode.api.validation import ApiError, Limits
from meshnode.config import DATA_OFFSET, ECHO_OFFSET, TENSOR_PORTS, Settings
from meshnode.control.auth import ClusterAuth, SignedChannel
from meshnode.control import tls
from meshnode.control.echo import EchoServer
from meshnode.control.discovery import Discovery, NodeInfo, local_addresses
from meshnode.control.election import Candidate, choose_coordinator
from meshnode.control.epochs import EpochState
from meshnode.control.links import LinkProber, LinkStat, best_paths, probe_reply, ring_address
from meshnode.control.membership import Membership
from meshnode.control.messages import node_from_pb, node_to_pb, plan_from_pb, plan_to_pb
from meshnode.control.reachability import Reachability
from meshnode.control.planner import (LinkSpec, NodeSpec, Plan, PlanError, estimate as plan_estimate,
                                      plan as make_plan, supports_tensor)
from meshnode.data.compute import collective_overhead, layer_seconds, tensor_layer_seconds
from meshnode.data.profile import ModelProfile, profile_model
from meshnode.data.shard import Shard
from meshnode.data.holdings import holdings_to_json, layers_of
from meshnode.data.manifest import read_marker
from meshnode.data.sourcing import LayerSource, cached_metadata, holdings_of, metadata_from_peers
from meshnode.data.transfer import FetchError, ModelStore
from meshnode.control.browse import Browser
from meshnode.data.dataport import DataServer
from meshnode.data.hop import HopSession, serve_forward
from meshnode.data.refusals import (EPOCH_PENDING, FAULT, STAGE_FAULT, StageError, StageFault, StagePending,
                                    refusal_kind)
from meshnode.data.stage import RemoteStage, StageServer
from meshnode.data.tensor import TensorGroupError, TensorShard
from meshnode.engine import Engine
from meshnode.generation import (LocalStage, PipelineSource, PrefillOptions, SamplingParams, TokenScheduler,
                                 new_request_id)
from meshnode.identity import cluster_id as derive_cluster_id
from meshnode.identity import load_or_create_node_id
from meshnode.metrics import NodeMetrics, Progress
from meshnode.modelsource import ModelNotFound, resolve_model
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.resilience import (EpochPending, FailoverSource, GenerationFault, NotReady, PlacementLost,
                                 await_while_alive)
from meshnode import sysinfo

log = logging.getLogger(__name__)

MAX_GRPC_MESSAGE = 64 * 2**20
# A working plan is replaced only by one estimated this much faster per token (hysteresis).
REPLAN_GAIN = 0.15
# A node whose all-reduce cost is not measured yet is assumed this slow (above what a Linux CPU
# box measures): tensor groups must prove themselves rather than be formed on a guess.
UNMEASURED_COLLECTIVE_S = 250e-6
# How long a node configured with a model it does not hold waits for a peer that holds it.
MODEL_WAIT_S = 300.0


def _unavailable(message: str, retry_after: int = 2, code: str = "mesh_unavailable") -> ApiError:
    return ApiError(503, message, type="server_error", code=code, headers={"Retry-After": str(retry_after)})


def _gave_up(exc: BaseException) -> ApiError:
    """The client's error for a generation that cannot go on (an error event mid-stream)."""
    if isinstance(exc, GenerationFault):
        return _unavailable(f"a stage of the mesh failed on this request: {exc}", 5, "stage_fault")
    return _unavailable(f"the mesh lost this generation's placement and had no new plan ready in time ({exc})",
                        2, "placement_lost")


class HeadPlacement:
    """This node is the head of the plan: generate here, calling the other stages over gRPC."""

    def __init__(self, node: "Node", plan: Plan):
        self.epoch = plan.epoch
        # Bound now, while the plan is ready: a later plan swapping shards cannot pull them away.
        handles = node.stage_handles(plan)
        s = node.settings
        prefill = PrefillOptions(pipelined=s.pipelined_prefill, max_step=s.max_step_ms / 1000,
                                 max_chunk=s.prefill_step_size)
        self._source = PipelineSource(node.scheduler, lambda: handles, prefill_step_size=s.prefill_step_size,
                                      prefill=prefill)

    async def tokens(self, prompt: Sequence[int], params: SamplingParams):
        try:
            async for token in self._source.tokens(prompt, params):
                yield token
        except StagePending as exc:
            raise EpochPending(str(exc)) from None
        except StageFault as exc:
            raise GenerationFault(str(exc)) from None
        except (StageError, TensorGroupError) as exc:
            raise PlacementLost(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - this node's own layers raised on the input
            log.exception("epoch %d: the generation failed here", self.epoch)
            raise GenerationFault(f"{type(exc).__name__}: {exc}") from None


class RemoteHeadPlacement:
    """Another node is the head: ask it for tokens over a gRPC Generate stream."""

    def __init__(self, node: "Node", plan: Plan):
        self.node, self.epoch = node, plan.epoch
        self.head = _head(plan)

    async def tokens(self, prompt: Sequence[int], params: SamplingParams):
        node = self.node
        stub = mesh_pb2_grpc.MeshStub(node.data_channel(self.head))
        request = mesh_pb2.GenerateRequest(
            request_id=new_request_id(node.node_id), epoch=self.epoch, prompt=list(prompt),
            max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            has_seed=params.seed is not None, seed=params.seed or 0, offset=params.offset,
        )
        call = stub.Generate(request, wait_for_ready=True)
        # The head is waited for while it heartbeats, however long its prefill or a token takes
        # (a busy head is not a lost one); it reports its own stages' faults on this stream.
        alive = lambda: node.membership is None or node.membership.heard_within(self.head)  # noqa: E731
        lost = lambda waited: f"head {self.head} stopped heartbeating ({waited:.1f} s into a wait)"  # noqa: E731
        try:
            while True:
                reply = await await_while_alive(call.read(), alive, lost)
                if reply is grpc.aio.EOF:
                    code = await call.code()
                    if code != grpc.StatusCode.OK:
                        raise _head_failure(self.head, code, await call.details())
                    return
                yield reply.token
        except grpc.aio.AioRpcError as exc:
            raise _head_failure(self.head, exc.code(), exc.details()) from None
        finally:
            call.cancel()


def _head_failure(head: str, code: grpc.StatusCode, details: str) -> Exception:
    """What a remote head's error status means for the generation (the codes of meshnode.data.stage)."""
    kind = refusal_kind(code, details)
    as_generation = {StagePending: EpochPending, StageFault: GenerationFault}.get(kind, PlacementLost)
    return as_generation(f"head {head}: {code.name}: {details}")


class MeshServicer(mesh_pb2_grpc.MeshServicer):
    def __init__(self, node: "Node"):
        self.node = node

    async def Heartbeat(self, request, context):
        return await self.node.on_heartbeat(request, context)

    async def Install(self, request, context):
        return self.node.on_install(request)

    async def Leave(self, request, context):
        self.node.on_goodbye(request.node_id)
        return mesh_pb2.Ack()

    async def Forward(self, request_iterator, context):
        async for reply in self.node.stage_server.forward(request_iterator, context):
            yield reply

    async def Probe(self, request, context):
        if self.node.settings.inject_latency_us:
            await asyncio.sleep(self.node.settings.inject_latency_us * 1e-6)
        return probe_reply(request)

    async def Generate(self, request, context):
        async for reply in self.node.on_generate(request, context):
            yield reply

    async def Manifest(self, request, context):
        return await self.node.store.Manifest(request, context)

    async def Fetch(self, request, context):
        async for chunk in self.node.store.Fetch(request, context):
            yield chunk


class Backend:
    """What the HTTP API asks of the node."""

    def __init__(self, node: "Node"):
        self.node = node
        self.metrics = node.metrics

    def engine(self) -> Engine:
        return self.node.engine_for_request()

    def health(self) -> tuple[bool, dict[str, Any]]:
        ok = self.node.serving_ready()
        return ok, {"status": "ok" if ok else "unavailable", "node_id": self.node.node_id, "version": __version__,
                    "epoch": self.node.epoch}

    def mesh_status(self) -> dict[str, Any]:
        return self.node.status()


class Node:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.started_at = time.time()
        state_dir = settings.resolved_state_dir()
        self.node_id = load_or_create_node_id(state_dir, settings.node_id)
        self.cluster_id = derive_cluster_id(settings.cluster_key)
        self.auth = ClusterAuth(settings.cluster_key)  # every gRPC call in and out is signed
        # encrypt: mutual TLS with a certificate derived from the cluster key (meshnode/control/tls.py)
        self.tls = tls.derive_identity(settings.cluster_key) if settings.encrypt else None
        if not settings.authenticate:
            log.warning("authenticate = false: gRPC calls are not signed (tests and benchmarks only)")
        # Tensor-group members prove the key to each other with this (never the key itself).
        self._group_secret = hmac.new(settings.cluster_key.encode(), b"meshnode tensor group v1",
                                      hashlib.sha256).digest() if settings.cluster_key else b""
        self.memory_budget = sysinfo.memory_budget(settings)
        sysinfo.use_recommended_wired_limit()
        self.scheduler = TokenScheduler()
        self.loop: asyncio.AbstractEventLoop | None = None
        # Model (filled by load_model)
        self.model_id: str | None = None
        self.model_path = None
        self.profile: ModelProfile | None = None
        self.tokenizer = None
        self.vocab_size = 0
        self.store: ModelStore | None = None  # serves held models to peers (Manifest/Fetch)
        self.layer_source: LayerSource | None = None  # folders holding layer ranges, fetched when missing
        # Control plane state
        self.me: NodeInfo | None = None
        self.membership: Membership | None = None
        self.discovery: Discovery | None = None
        self.coordinator: str | None = None
        self.plan: Plan | None = None
        self.previous: Plan | None = None  # the last ready plan, served until the current one is ready
        self._plan_changed_at = 0.0
        self.plan_error = ""
        # Epoch numbers and the rule that keeps one plan per epoch (meshnode.control.epochs). Nodes
        # started together hear each other before either publishes (grace).
        self.epochs = EpochState(grace=max(1.0, 2 * settings.heartbeat_interval))
        self._control_since = 0.0
        self.ready_epoch = 0
        self._planned_for: frozenset[str] = frozenset()
        # started_at of each node of the plan this coordinator published: a node that restarts
        # comes back empty-handed, so its plan is published again under a new epoch (generations
        # that lost the old epoch wait for a newer one).
        self._plan_incarnations: dict[str, float] = {}
        self._planned_at = 0.0  # when the coordinator last weighed a plan
        self._pending: list | None = None  # a better layout seen at the last re-weighing, to confirm
        self._forced_note = ""  # why the configured strategy could not be used, last said
        # What this node holds, by stage key (see _stage_key): Shards, and its member of each
        # tensor group (a TensorShard supervising a worker process).
        self.shards: dict[tuple, Shard | TensorShard] = {}
        self._apply_task: asyncio.Task | None = None
        self._group_restart_at = 0.0
        self._placements: dict[int, Any] = {}
        self.engine: Engine | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._static_targets = list(settings.peers)
        self._tasks: list[asyncio.Task] = []
        self._stopping = threading.Event()  # set by stop(): work in threads ends early
        self.stage_server: StageServer | None = None
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self.http_port = settings.http_port
        self.grpc_port = settings.grpc_port
        self.events: list[dict[str, Any]] = []
        self.links = LinkProber(self.channel_to, interval=settings.link_probe_interval)
        self.peer_links: dict[str, tuple[LinkStat, ...]] = {}  # what each peer measured
        self.metrics = NodeMetrics(epoch=lambda: self.epoch,  # GET /metrics, and figures in /v1/mesh
                                   unreachable=lambda: len(self.reach.unreachable()))
        self.progress = Progress()  # model loading: a bar on a terminal, `progress` in /v1/mesh
        self._echo: EchoServer | None = None  # lets peers time the network without the RPC stack
        self._data: DataServer | None = None  # activations in bare TCP frames (meshnode.data.dataport)
        self._goodbyes: set[str] = set()  # peers that said goodbye (leave), as opposed to lost
        # Peers mDNS announces but heartbeats never reach (macOS Local Network privacy, a firewall).
        self.reach = Reachability(grace=max(10.0, 5 * settings.failure_timeout))

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self._load_model_metadata()
        self.stage_server = StageServer(self.scheduler, vocab_size=self.vocab_size,
                                        max_chunk=self.settings.prefill_step_size,
                                        max_context=self.settings.max_context,
                                        inject_latency=self.settings.inject_latency_us * 1e-6)
        await self._start_grpc()
        await self._start_http()
        tensor_port = self.settings.tensor_port or self.grpc_port + 1
        try:
            self._echo = EchoServer(self.settings.host or "0.0.0.0", tensor_port + ECHO_OFFSET,
                                    delay=self.settings.inject_latency_us * 1e-6)
        except OSError as exc:  # peers then time the link with gRPC calls, the RPC stack included
            log.warning("link echo not started on port %d: %s", tensor_port + ECHO_OFFSET, exc)
        if self.settings.fast_hops and self.tls is None:  # encrypted clusters keep activations on TLS
            try:
                self._data = DataServer(
                    self.settings.host or "0.0.0.0", tensor_port + DATA_OFFSET,
                    auth=self.auth, verify=self.settings.authenticate,
                    forward=lambda conn, opening, host: serve_forward(self.stage_server, self.scheduler.run_here,
                                                                      conn, opening, host))
            except OSError as exc:  # peers then send this node's activations over gRPC
                log.warning("data port not started on %d: %s; activations come over gRPC", tensor_port + DATA_OFFSET,
                            exc)
        self.me = NodeInfo(
            node_id=self.node_id, addresses=self._announced_addresses(), http_port=self.http_port,
            grpc_port=self.grpc_port,
            memory_budget=self.memory_budget, total_memory=sysinfo.total_memory(),
            compute=await asyncio.to_thread(sysinfo.compute_figure), version=__version__,
            cluster_id=self.cluster_id, models=(self.model_id,), started_at=self.started_at,
            tensor_port=tensor_port,
            layer_seconds=await self.scheduler.call(
                lambda: layer_seconds(self.model_path, self.profile.num_layers, self.settings.resolved_state_dir(),
                                      max(self.profile.layer_bytes, default=0))) if self._weights_local else 0.0,
            holdings=holdings_of(self.store),
        )
        self.membership = Membership(self.me, failure_timeout=self.settings.failure_timeout)
        if supports_tensor(self.profile) and self._weights_local:
            self._tasks.append(asyncio.create_task(self._measure_collectives(), name="meshnode-collective"))
        if self.settings.mdns:
            self.discovery = Discovery(self.me, on_change=self._on_discovery)
            await self.discovery.start()
        self._tasks.append(asyncio.create_task(self._control_loop(), name="meshnode-control"))
        self._tasks.append(asyncio.create_task(self.links.run(self._probe_targets), name="meshnode-links"))
        log.info("node %s up: HTTP :%d, gRPC :%d, budget %.2f GiB, cluster %s", self.node_id, self.http_port,
                 self.grpc_port, self.memory_budget / 2**30, self.cluster_id)

    def _announced_addresses(self) -> tuple[str, ...]:
        """Where peers can reach this node: the bind address if it is a specific one, else every
        address of the machine."""
        if self.settings.host not in ("0.0.0.0", "::", ""):
            return (self.settings.host,)
        return local_addresses() or ("127.0.0.1",)

    async def stop(self) -> None:
        self._stopping.set()  # a compute measurement still running in a thread kills its processes
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.membership is not None:
            await asyncio.gather(*(self._say_goodbye(p.target) for p in self.membership.alive_peers().values()),
                                 return_exceptions=True)
        if self.discovery is not None:
            await self.discovery.stop()
        if self._http is not None:
            await self._http.cleanup()
        for shard in self.shards.values():
            _close(shard)
        self.shards = {}
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        for channel in self._channels.values():
            await channel.close()
        if self._echo is not None:
            self._echo.close()
        if self._data is not None:
            self._data.close()
        self.scheduler.stop()

    async def _load_model_metadata(self) -> None:
        cache_dir = self.settings.resolved_cache_dir()
        peer_models = cache_dir / "peer-models"
        try:
            self.model_id, self.model_path = await asyncio.to_thread(resolve_model, self.settings.model, cache_dir)
        except ModelNotFound as exc:  # not on this disk: from a folder fetched earlier, or from peers
            if not self.settings.model or Path(self.settings.model).expanduser().is_absolute():
                raise
            self.model_id = self.settings.model
            self.model_path = cached_metadata(peer_models, self.model_id) or await self._metadata_from_peers(exc)
        # What this node serves to peers, and where its layers come from when its disk lacks them.
        self.store = ModelStore(peer_models)
        self.store.add(self.model_id, (self.model_path if self._weights_local
                                       else cached_metadata(peer_models, self.model_id) or self.model_path))
        self.profile = await asyncio.to_thread(profile_model, self.model_path, self.model_id)
        self.layer_source = LayerSource(self.model_id, self.model_path, peer_models, self.store, self.profile.num_layers)
        # As mlx_lm.load does: the model's own end-of-sequence ids (generation_config.json included).
        eos = (await asyncio.to_thread(load_config, self.model_path)).get("eos_token_id")
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model_path, eos_token_ids=eos)
        self.vocab_size = self.profile.vocab_size or len(self.tokenizer)
        source = FailoverSource(
            self.placement, deadline=self.settings.failover_deadline, on_retry=self.metrics.retry,
            give_up=_gave_up,
            same_epoch=self.placement_again)
        self.engine = Engine(self.model_id, self.tokenizer, source, max_context=self.settings.max_context,
                             vocab_size=self.vocab_size, metrics=self.metrics)

    @property
    def _weights_local(self) -> bool:
        """The configured model folder is complete (not metadata or a few layers from peers)."""
        return read_marker(self.model_path) is None

    async def _metadata_from_peers(self, exc: Exception) -> Path:
        """Wait for a peer that holds the model (static peers, mDNS announcements naming it) and
        fetch its small files, to profile it and load its tokenizer before announcing this node."""
        log.info("%s; asking peers for model %s", exc, self.model_id)
        browser = Browser(self.node_id, self.cluster_id) if self.settings.mdns else None
        if browser is not None:
            await browser.start()

        def candidates():
            found = [(t, self.channel_to(t)) for t in self._static_targets]
            for nid, info in (browser.peers() if browser is not None else {}).items():
                if self.model_id in info.models and info.addresses:
                    found.append((nid, self.channel_to(f"{info.addresses[0]}:{info.grpc_port}")))
            return found

        try:
            return await metadata_from_peers(self.model_id, self.settings.resolved_cache_dir() / "peer-models",
                                             candidates, deadline_s=MODEL_WAIT_S)
        except FetchError as err:
            raise ModelNotFound(str(err)) from err
        finally:
            if browser is not None:
                await browser.stop()

    async def _layers_folder(self, start: int, end: int) -> Path:
        """A folder holding layers [start, end): local, or fetched now from the live peers that
        announce them, or for a Hugging Face id downloaded from the Hub (only the weight files
        holding them; progress in ``self.progress``), then announced as held."""
        if (local := self.layer_source.local(start, end)) is not None:
            return local
        alive = self.membership.alive_infos() if self.membership is not None else {}
        peers = [(nid, self.channel_to(nid)) for nid, info in sorted(alive.items())
                 if nid != self.node_id and any(m == self.model_id for m, _, _ in info.holdings)]
        where = f"{len(peers)} peer(s)" if peers else "Hugging Face"  # (LayerSource: no peer -> the Hub)
        task = f"fetching layers {start}-{end - 1} of {self.model_id} from {where}"
        self._event("fetch", layers=[start, end], peers=[p for p, _ in peers])
        t0 = time.monotonic()
        try:
            path = await self.layer_source.folder(start, end, peers,
                                                  on_progress=lambda d, n: self.progress.update(task, d, n))
        finally:
            self.progress.finish()
        self._event("fetched", layers=[start, end], seconds=round(time.monotonic() - t0, 2))
        self._update_me(holdings=holdings_of(self.store))
        return path

    def _update_me(self, **changes) -> None:
        """Change what this node announces (sent with the next heartbeats)."""
        self.me = dataclasses.replace(self.me, **changes)
        if self.membership is not None:
            self.membership.me = self.me

    async def _start_grpc(self) -> None:
        options = [("grpc.max_receive_message_length", MAX_GRPC_MESSAGE),
                   ("grpc.max_send_message_length", MAX_GRPC_MESSAGE)]
        interceptors = [self.auth.server_interceptor()] if self.settings.authenticate else []
        self._grpc = grpc.aio.server(options=options, interceptors=interceptors)
        mesh_pb2_grpc.add_MeshServicer_to_server(MeshServicer(self), self._grpc)
        address = f"{self.settings.host}:{self.settings.grpc_port}"
        self.grpc_port = (self._grpc.add_secure_port(address, tls.server_credentials(self.tls)) if self.tls
                          else self._grpc.add_insecure_port(address))
        if not self.grpc_port:
            raise OSError(f"cannot listen for gRPC on {self.settings.host}:{self.settings.grpc_port}")
        await self._grpc.start()

    async def _start_http(self) -> None:
        s = self.settings
        api = ApiSettings(
            limits=Limits(max_tokens_limit=s.max_tokens_limit, default_max_tokens=s.default_max_tokens),
            max_body_bytes=s.max_body_bytes, max_concurrent_requests=s.max_concurrent_requests, api_key=s.api_key,
            cors_origins=s.cors_origins, access_log=s.access_log,
        )
        self._http = web.AppRunner(make_app(Backend(self), api), access_log=None, shutdown_timeout=2.0)
        await self._http.setup()
        site = web.TCPSite(self._http, s.host, s.http_port)
        await site.start()
        self.http_port = self._http.addresses[0][1]

    # ------------------------------------------------------------------ peers
    def channel_to(self, node_id_or_target: str) -> grpc.aio.Channel:
        target = node_id_or_target
        peer = self.membership.peers.get(node_id_or_target) if self.membership else None
        if peer is not None:
            target = peer.target
        channel = self._channels.get(target)
        if channel is None:
            options = [("grpc.max_receive_message_length", MAX_GRPC_MESSAGE),
                       ("grpc.max_send_message_length", MAX_GRPC_MESSAGE),
                       # A peer that was unreachable (link down, restarting) is tried again within a
                       # second, not after gRPC's default backoff of up to two minutes.
                       ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                       ("grpc.max_reconnect_backoff_ms", 1000)]
            if self.tls:
                channel = grpc.aio.secure_channel(target, tls.channel_credentials(self.tls),
                                                  options=options + tls.channel_options())
            else:
                channel = grpc.aio.insecure_channel(target, options=options)
            if self.settings.authenticate:  # signed when each call opens; nothing per message
                channel = SignedChannel(channel, self.auth, self.node_id)
            self._channels[target] = channel
        return channel

    def _on_discovery(self, node_id: str, info: NodeInfo | None) -> None:
        if info is None:
            log.info("mDNS says %s left; waiting for heartbeats to confirm", node_id)
            self.reach.withdrawn(node_id)
            return
        if info.cluster_id != self.cluster_id or node_id == self.node_id:
            return
        self.membership.add_target(info, f"{info.addresses[0]}:{info.grpc_port}")
        self.reach.announced(node_id, f"{info.addresses[0]}:{info.grpc_port}")

    def _probe_targets(self) -> dict[str, tuple[tuple[str, ...], int]]:
        if self.membership is None:
            return {}
        return {p.info.node_id: (p.info.addresses, p.info.grpc_port,
                                 p.info.tensor_port + ECHO_OFFSET if p.info.tensor_port else 0)
                for p in self.membership.alive_peers().values()}

    def data_port_of(self, node_id: str) -> tuple[str, int] | None:
        """Where to send a peer's activations in bare TCP frames (fast_hops): its data port on its
        fastest measured address; None where activations go over gRPC (encrypt, or fast_hops off)."""
        peer = self.membership.peers.get(node_id) if self.membership else None
        if self._data is None or peer is None or not peer.info.tensor_port:
            return None
        address = self.links.best_address(node_id) or peer.target.rsplit(":", 1)[0].strip("[]")
        return address, peer.info.tensor_port + DATA_OFFSET

    def data_channel(self, node_id: str) -> grpc.aio.Channel:
        """The channel for per-token traffic to a peer: over its fastest measured address."""
        peer = self.membership.peers.get(node_id) if self.membership else None
        address = self.links.best_address(node_id)
        if peer is None or address is None:
            return self.channel_to(node_id)
        return self.channel_to(f"{address}:{peer.info.grpc_port}")

    def _me_pb(self) -> mesh_pb2.NodeInfo:
        msg = node_to_pb(self.me)
        msg.links.extend(link.to_pb() for link in self.links.links())
        return msg

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"time": time.time(), "event": kind, **fields})
        del self.events[:-100]
        self.metrics.event(kind, fields)

    def _heartbeat_msg(self) -> mesh_pb2.HeartbeatRequest:
        msg = mesh_pb2.HeartbeatRequest(
            node=self._me_pb(), coordinator=self.coordinator or "", epoch=self.epoch,
            alive=sorted(self.membership.alive_infos()), ready_epoch=self.ready_epoch, plan_error=self.plan_error,
        )
        if self.plan is not None:
            msg.plan.CopyFrom(plan_to_pb(self.plan, self.plan_coordinator))
        return msg

    async def _heartbeat(self, target: str) -> None:
        stub = mesh_pb2_grpc.MeshStub(self.channel_to(target))
        try:
            reply = await stub.Heartbeat(self._heartbeat_msg(), timeout=self.settings.failure_timeout / 2)
        except grpc.aio.AioRpcError as exc:
            self.reach.failed(target, f"{exc.code().name}: {(exc.details() or '')[:200]}")
            if exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                log.warning("peer at %s refused us (another cluster key?): %s", target, exc.details())
            elif exc.code() == grpc.StatusCode.UNAVAILABLE and "refused" in (exc.details() or "").lower():
                # The host answered but nothing listens: the process is gone. No need to wait out
                # the failure timeout (a hung or unreachable peer still takes the full timeout).
                for peer in self.membership.alive_peers().values():
                    if peer.target == target:
                        log.warning("%s refuses connections: its process is gone", peer.info.node_id)
                        self.membership.goodbye(peer.info.node_id)
            return
        self.reach.answered(target)
        try:
            info = node_from_pb(reply.node)
        except ValueError as exc:
            log.warning("ignoring a bad heartbeat reply from %s: %s", target, exc)
            return
        if info.cluster_id != self.cluster_id:
            log.warning("peer at %s belongs to another cluster; ignoring it", target)
            return
        self._observe(info, target, reply)
        for known in reply.known:
            try:
                k = node_from_pb(known)
            except ValueError:
                continue
            if k.cluster_id == self.cluster_id and k.node_id != self.node_id and k.node_id not in self.membership.peers:
                self.membership.add_target(k, f"{k.addresses[0]}:{k.grpc_port}" if k.addresses else target)

    def _observe(self, info: NodeInfo, target: str, msg) -> None:
        try:
            self.peer_links[info.node_id] = tuple(LinkStat.from_pb(link) for link in msg.node.links[:256])
        except ValueError as exc:
            log.warning("ignoring bad link figures from %s: %s", info.node_id, exc)
        self.membership.observe(info, target=target, coordinator=msg.coordinator, epoch=msg.epoch,
                                alive_view=frozenset(msg.alive))
        peer = self.membership.peers[info.node_id]
        peer.ready_epoch = msg.ready_epoch
        peer.plan_error = msg.plan_error
        self.epochs.saw(msg.epoch)
        if msg.HasField("plan") and self.epochs.offered(msg.plan.epoch, msg.plan.coordinator, info.node_id):
            self._adopt_pb(msg.plan, source=info.node_id)

    @property
    def plan_coordinator(self) -> str:
        """Who published the plan held here."""
        return self.epochs.held.coordinator if self.epochs.held is not None else ""

    async def on_heartbeat(self, request: mesh_pb2.HeartbeatRequest, context) -> mesh_pb2.HeartbeatReply:
        try:
            info = node_from_pb(request.node)
        except ValueError as exc:
            log.warning("refused a malformed heartbeat from %s: %s", context.peer(), exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if info.cluster_id != self.cluster_id:
            log.warning("refused a heartbeat from %s (%s): other cluster", info.node_id, context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not a member of this cluster")
        if self.membership is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "starting")
        target = f"{info.addresses[0]}:{info.grpc_port}" if info.addresses else _peer_host(context, info.grpc_port)
        if info.node_id == self.node_id:
            if info.started_at != self.started_at:
                log.error("two nodes use node id %s (the other at %s); give one a different --node-id",
                          info.node_id, target)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"node id {info.node_id} is already in use")
        self._observe(info, target, request)
        reply = mesh_pb2.HeartbeatReply(
            node=self._me_pb(), coordinator=self.coordinator or "", epoch=self.epoch,
            alive=sorted(self.membership.alive_infos()), ready_epoch=self.ready_epoch, plan_error=self.plan_error,
            known=[node_to_pb(p.info) for p in self.membership.alive_peers().values()],
        )
        if self.plan is not None:
            reply.plan.CopyFrom(plan_to_pb(self.plan, self.plan_coordinator))
        return reply

    def on_goodbye(self, node_id: str) -> None:
        if self.membership is not None and node_id in self.membership.peers:
            log.info("%s said goodbye", node_id)
            self._goodbyes.add(node_id)
            self.membership.goodbye(node_id)

    async def _say_goodbye(self, target: str) -> None:
        stub = mesh_pb2_grpc.MeshStub(self.channel_to(target))
        await stub.Leave(mesh_pb2.Goodbye(node_id=self.node_id), timeout=1.0)

    # ------------------------------------------------------------------ control loop
    async def _heartbeat_all(self) -> None:
        targets = {p.target for p in self.membership.peers.values()} | set(self._static_targets)
        await asyncio.gather(*(self._heartbeat(t) for t in targets), return_exceptions=True)
        try:
            self._tick()
        except Exception:
            log.exception("control loop tick failed")

    async def _control_loop(self) -> None:
        self._control_since = time.monotonic()  # peers can find this node from now (rule 4 of epochs)
        while True:
            await self._heartbeat_all()
            await asyncio.sleep(self.settings.heartbeat_interval)

    def _tick(self) -> None:
        joined, left = self.membership.refresh()
        for nid in sorted(joined):
            log.info("peer %s joined (epoch %d)", nid, self.epoch)
            self._event("join", node_id=nid)
        for nid in sorted(left):
            log.warning("peer %s is gone (no heartbeat for %.1f s; epoch %d)", nid, self.settings.failure_timeout,
                        self.epoch)
            self._event("leave" if nid in self._goodbyes else "loss", node_id=nid)
        self._goodbyes -= joined | left
        for level, message, fields in self.reach.check():
            log.log(level, "%s", message)
            self._event("unreachable" if level > logging.INFO else "reachable", **fields)
        alive = self.membership.alive_infos()
        coordinator = choose_coordinator(Candidate(n.node_id, n.started_at) for n in alive.values())
        if coordinator != self.coordinator:
            log.info("coordinator is now %s (was %s)", coordinator, self.coordinator)
            self._event("coordinator", node_id=coordinator)
            self.coordinator = coordinator
        if coordinator == self.node_id and self.epochs.may_publish_first(time.monotonic() - self._control_since):
            self._coordinate(alive)
        self._ensure_applied()
        self._retire_previous()

    def _ensure_applied(self) -> None:
        """Keep trying to hold this node's part of the current plan: a load that failed (a group
        member not heard from yet, a ring that did not form in time) is tried again, and a tensor
        group whose worker died (a member's ring broke) is formed again; every member does the
        same. Not ready meanwhile, so the plan is not served half-loaded."""
        plan, task = self.plan, self._apply_task
        if task is not None and not task.done():
            return
        if task is not None and not task.cancelled():
            task.exception()  # _apply logged any failure; mark it seen
        if plan is None:
            return
        ready = self.ready_epoch >= plan.epoch
        if ready and self._groups_alive(plan):
            return
        if time.monotonic() - self._group_restart_at < 2 * self.settings.heartbeat_interval:
            return
        self._group_restart_at = time.monotonic()
        if ready:
            log.warning("epoch %d: a tensor group this node belongs to is down; forming it again", plan.epoch)
            self._event("group-down", epoch=plan.epoch)
            self.ready_epoch = plan.epoch - 1
        else:
            log.warning("epoch %d: loading this node's part again", plan.epoch)
        self._apply_task = asyncio.create_task(self._apply(plan))

    def _coordinate(self, alive: dict[str, NodeInfo]) -> None:
        members = frozenset(alive)
        plan_ok = self.plan is not None and set(self.plan.node_ids()) <= members
        restarted = sorted(n for n, t in self._plan_incarnations.items() if n in alive and alive[n].started_at != t)
        if plan_ok and restarted:
            log.info("%s restarted since epoch %d was planned: planning again", ", ".join(restarted), self.plan.epoch)
            plan_ok = False
        contested = plan_ok and self.epochs.must_republish()
        now = time.monotonic()
        # Re-plan on a membership change, and now and then with fresh link and compute figures.
        if (plan_ok and not contested and members == self._planned_for
                and now - self._planned_at < self.settings.link_probe_interval):
            return
        nodes = _node_specs(alive)
        links = self._link_specs(members)
        preferred = tuple(self.plan.node_ids()) if self.plan is not None else ()
        strategy = None if self.settings.strategy == "auto" else self.settings.strategy
        held = {nid: layers_of(info.holdings, self.model_id) for nid, info in alive.items()}  # reuse disks
        try:
            try:
                desired = make_plan(self.profile, nodes, max_context=self.settings.max_context, preferred=preferred,
                                    requests=self.settings.kv_requests,
                                    strategy=strategy, links=links, held=held)
            except PlanError as forced:
                if strategy is None:
                    raise
                # A configured strategy is a preference: serving some other way beats not serving.
                desired = make_plan(self.profile, nodes, max_context=self.settings.max_context, preferred=preferred,
                                    requests=self.settings.kv_requests,
                                    links=links, held=held)
                if self._forced_note != str(forced):
                    log.warning("strategy %s is impossible on this mesh (%s); using %s instead", strategy, forced,
                                desired.strategy)
                    self._forced_note = str(forced)
        except PlanError as exc:
            if self.plan_error != str(exc):
                log.error("no plan fits (epoch %d): %s", self.epoch, exc)
                self._event("no-plan", reason=str(exc))
            self.plan_error = str(exc)
            self._planned_for, self._planned_at = members, now
            if self.plan is not None and not plan_ok:
                self._drop_plan()
            return
        self.plan_error = ""
        desired = self._with_endpoints(desired, members)
        if plan_ok and not contested:
            # The current plan still works: move only for a real gain by today's figures, and not
            # sooner than rebalance_dwell after the last change (hysteresis: no flapping).
            current = plan_estimate(self.profile, nodes, self.plan.stages, max_context=self.settings.max_context,
                                    links=links)
            preferred_now = strategy is not None and desired.strategy == strategy != self.plan.strategy
            if _same_layout(desired, self.plan) or not (preferred_now or desired.estimate_s < current * (1 - REPLAN_GAIN)):
                self._planned_for, self._planned_at, self._pending = members, now, None
                return
            if members == self._planned_for and not preferred_now and self._pending != _layout(desired):
                # Same nodes, new figures: the move must win at two re-weighings in a row, so one
                # noisy measurement does not tear down a working tensor group.
                self._pending, self._planned_at = _layout(desired), now
                return
            if now - self._plan_changed_at < self.settings.rebalance_dwell:
                return  # look again on a later tick
            log.info("rebalancing: %s (est. %.2f ms/token) -> %s (est. %.2f ms/token): %s", _describe(self.plan),
                     current * 1e3, _describe(desired), desired.estimate_s * 1e3, desired.reason)
        if contested:
            log.info("another node published a different plan as epoch %d: publishing this mesh's plan again "
                     "under a new epoch", self.epoch)
        self._planned_for, self._planned_at, self._pending = members, now, None
        self._plan_incarnations = {n: alive[n].started_at for n in desired.node_ids()}
        epoch = self.epochs.next_epoch()
        desired = desired.with_epoch(epoch)
        log.info("publishing plan epoch %d: %s (%s)", epoch, _describe(desired), desired.reason)
        self._adopt(desired, coordinator=self.node_id, source="self")
        msg = plan_to_pb(desired, self.node_id)
        for peer in self.membership.alive_peers().values():
            asyncio.create_task(self._install(peer.target, msg))

    def _estimate_now(self) -> float | None:
        """Seconds per token of the current plan by today's compute and link figures (the plan's own
        estimate is from when it was made, often before the links were measured)."""
        if self.plan is None or self.membership is None or self.profile is None:
            return None
        alive = self.membership.alive_infos()
        if not set(self.plan.node_ids()) <= set(alive):
            return None
        try:
            return plan_estimate(self.profile, _node_specs(alive), self.plan.stages,
                                 max_context=self.settings.max_context, links=self._link_specs(frozenset(alive)))
        except (PlanError, ValueError, KeyError):
            return None

    async def _measure_collectives(self) -> None:
        """Time a few layers of the model split two ways over a loopback ring on this machine
        (cached; two short-lived processes), so the planner prices tensor groups by what their
        all-reduces and unhalved per-operation costs add here; announced with the next heartbeat."""
        split = await asyncio.to_thread(tensor_layer_seconds, self.model_path, self.profile.num_layers,
                                        self.settings.resolved_state_dir(), max(self.profile.layer_bytes, default=0),
                                        self._stopping)
        value = collective_overhead(self.me.layer_seconds, split)
        if value > 0:
            self._update_me(collective_seconds=value)

    def _measured(self) -> list[tuple[str, LinkStat]]:
        """Every link figure this node knows: its own probes and what peers reported."""
        out = [(self.node_id, stat) for stat in self.links.links()]
        out += [(nid, stat) for nid, stats in self.peer_links.items() for stat in stats]
        return out

    def _link_specs(self, members) -> dict[tuple[str, str], LinkSpec]:
        """The planner's view of the links: the fastest measured path between each pair, its
        network round trip and what the RPC stack adds to it (a pipeline hop pays both)."""
        return {tuple(sorted(pair)): LinkSpec(rtt_s=stat.rtt_us * 1e-6, bandwidth_Bps=stat.bandwidth,
                                              overhead_s=max(stat.rpc_rtt_us - stat.rtt_us, 0.0) * 1e-6)
                for pair, (_, stat) in best_paths(self._measured(), members).items()}

    def _with_endpoints(self, plan: Plan, members) -> Plan:
        """Name, for each tensor group member, the address its ring should use: the one the other
        members reach fastest (a Thunderbolt bridge rather than Wi-Fi), else its first announced."""
        if all(len(s.nodes) == 1 for s in plan.stages):
            return plan
        measured = self._measured()
        alive = self.membership.alive_infos()
        stages = []
        for stage in plan.stages:
            if len(stage.nodes) > 1:
                hosts = tuple(ring_address(measured, n, stage.nodes) or alive[n].addresses[0] for n in stage.nodes)
                stage = dataclasses.replace(stage, endpoints=hosts)
            stages.append(stage)
        return dataclasses.replace(plan, stages=tuple(stages))

    async def _install(self, target: str, msg: mesh_pb2.Plan) -> None:
        stub = mesh_pb2_grpc.MeshStub(self.channel_to(target))
        try:
            reply = await stub.Install(msg, timeout=self.settings.failure_timeout)
        except grpc.aio.AioRpcError as exc:
            log.info("installing epoch %d at %s failed (%s); heartbeats will carry it", msg.epoch, target,
                     exc.code().name)
            return
        if not reply.accepted:
            log.info("%s refused epoch %d: %s", target, msg.epoch, reply.error)
            self.epochs.refused(msg.epoch, reply.epoch, target)

    def on_install(self, msg: mesh_pb2.Plan) -> mesh_pb2.InstallReply:
        if self.epochs.holds(msg.epoch, msg.coordinator):  # heartbeats brought it first
            return mesh_pb2.InstallReply(accepted=True, epoch=self.epoch)
        if not self.epochs.offered(msg.epoch, msg.coordinator, msg.coordinator):
            log.info("refused plan epoch %d from %s: current epoch is %d", msg.epoch, msg.coordinator, self.epoch)
            return mesh_pb2.InstallReply(accepted=False, error=f"stale epoch (current {self.epoch})", epoch=self.epoch)
        try:
            self._adopt_pb(msg, source=msg.coordinator)
        except ValueError as exc:
            return mesh_pb2.InstallReply(accepted=False, error=str(exc), epoch=self.epoch)
        return mesh_pb2.InstallReply(accepted=True, epoch=self.epoch)

    @property
    def epoch(self) -> int:
        return self.epochs.epoch

    def _adopt_pb(self, msg: mesh_pb2.Plan, source: str) -> None:
        try:
            plan = plan_from_pb(msg, self.profile.num_layers)
        except ValueError as exc:
            log.warning("ignoring an invalid plan from %s: %s", source, exc)
            raise
        if plan.model != self.model_id:
            raise ValueError(f"plan is for model {plan.model!r}; this node serves {self.model_id!r}")
        self._adopt(plan, coordinator=msg.coordinator, source=source)

    def _adopt(self, plan: Plan, *, coordinator: str, source: str) -> None:
        if plan.epoch <= self.epoch:
            return
        if self.plan is not None and self._ready(self.plan):
            # Make before break: keep serving the ready plan until the new one is ready everywhere.
            self.previous = self.plan
        self.plan = plan
        self.epochs.adopted(plan.epoch, coordinator)
        self._plan_changed_at = time.monotonic()
        self.plan_error = ""
        log.info("epoch %d adopted (from %s): %s", plan.epoch, source, _describe(plan))
        self._event("plan", epoch=plan.epoch, stages=_describe(plan))
        if self._apply_task is not None:
            self._apply_task.cancel()
        self._apply_task = asyncio.create_task(self._apply(plan))

    def _drop_plan(self) -> None:
        self.epochs.withdraw()
        log.warning("epoch %d withdrawn: %s", self.epoch, self.plan_error)
        self.plan = None
        self.previous = None
        self._placements.clear()

    async def _apply(self, plan: Plan) -> None:
        """Load this node's shards for the plan (make before break), then serve them."""
        wanted: dict[tuple, Shard | TensorShard] = {}
        launching: list[TensorShard] = []
        try:
            for stage in plan.stages:
                if self.node_id not in stage.nodes:
                    continue
                key = _stage_key(stage)
                shard = self.shards.get(key)
                if isinstance(shard, TensorShard) and not shard.alive():
                    shard = None  # its worker died: start the group again
                if shard is None and len(stage.nodes) == 1:
                    log.info("loading layers [%d, %d) for epoch %d", key[0], key[1], plan.epoch)
                    t0 = time.monotonic()
                    task = f"loading layers {key[0]}-{key[1] - 1} of {self.model_id}"
                    path = await self._layers_folder(key[0], key[1])
                    try:
                        shard = await self.scheduler.call(lambda k=key, t=task, p=path: Shard(
                            p, k[0], k[1], progress=lambda d, n: self.progress.update(t, d, n)))
                    finally:
                        self.progress.finish()
                    log.info("layers [%d, %d) loaded in %.2f s", key[0], key[1], time.monotonic() - t0)
                elif shard is None:
                    shard = self._tensor_shard(stage, await self._layers_folder(key[0], key[1]))
                    launching.append(shard)
                    t0 = time.monotonic()
                    await asyncio.to_thread(shard.launch, self.settings.group_ready_timeout)
                    launching.remove(shard)
                    self._event("group-ready", layers=[key[0], key[1]], nodes=list(stage.nodes),
                                seconds=round(time.monotonic() - t0, 2))
                wanted[key] = shard
        except BaseException as exc:
            for shard in launching:
                shard.close()  # unblocks the launching thread
            if not isinstance(exc, asyncio.CancelledError):
                log.error("epoch %d: could not load this node's part: %s", plan.epoch, exc)
                self._event("load-failed", epoch=plan.epoch, error=str(exc))
            raise
        if self.plan is not plan:
            for key, shard in wanted.items():
                if key not in self.shards:
                    _close(shard)
            return
        replaced = [v for k, v in self.shards.items() if k in wanted and v is not wanted[k]]
        self.shards = {**self.shards, **wanted}
        for shard in replaced:
            _close(shard)
        served = {(s.start_layer, s.end_layer): wanted[_stage_key(s)] for s in plan.stages if s.nodes[0] == self.node_id}
        self.stage_server.serve(plan.epoch, served)
        self.ready_epoch = plan.epoch
        log.info("ready for epoch %d", plan.epoch)
        asyncio.create_task(self._heartbeat_all())  # tell the mesh now, not at the next beat

    def _tensor_shard(self, stage, path: Path) -> TensorShard:
        """This node's member of the stage's tensor group: ring endpoints every member derives alike."""
        alive = self.membership.alive_infos() if self.membership is not None else {}
        key = f"{stage.start_layer}-{stage.end_layer}-{','.join(stage.nodes)}"
        offset = zlib.crc32(key.encode()) % TENSOR_PORTS
        endpoints, controls = [], []
        for node_id in stage.nodes:
            info = self.me if node_id == self.node_id else alive.get(node_id)
            if info is None or not info.tensor_port:
                raise TensorGroupError(f"group member {node_id} is unknown or has no tensor port")
            host = _endpoint_host(stage, node_id, info)
            endpoints.append(f"{host}:{info.tensor_port + offset}")
            controls.append(f"{host}:{info.tensor_port + TENSOR_PORTS + offset}")
        return TensorShard(path, stage.start_layer, stage.end_layer, self.profile.num_layers,
                           rank=stage.nodes.index(self.node_id), endpoints=endpoints, control=controls[0],
                           secret=self._group_secret, hop_timeout=self.settings.failure_timeout,
                           inject_latency=self.settings.inject_latency_us * 1e-6,
                           members_alive=lambda: self.membership is not None and all(
                               self.membership.heard_within(n) for n in stage.nodes))

    def _retire_previous(self) -> None:
        """Once the current plan is ready on every node, stop serving older epochs and free them."""
        plan = self.plan
        if plan is None or not self._ready(plan):
            return
        if self.previous is None and list(self.stage_server.epochs) == [plan.epoch]:
            return
        keep = {_stage_key(s) for s in plan.stages if self.node_id in s.nodes}
        for key, shard in self.shards.items():
            if key not in keep:
                _close(shard)
        self.shards = {k: v for k, v in self.shards.items() if k in keep}
        self.stage_server.retire_before(plan.epoch)
        if self.previous is not None:
            log.info("epoch %d is ready everywhere; epoch %d retired", plan.epoch, self.previous.epoch)
        self.previous = None

    # ------------------------------------------------------------------ serving
    def placement_again(self, epoch: int, since: float):
        """The placement of ``epoch`` again after a generation lost it at ``since`` (monotonic), if
        no newer plan is known and every node of it was heard from since (nothing failed, so no
        one is re-planning: meshnode.resilience.FailoverSource); else None."""
        plan = self.serving_plan()
        if plan is None or plan.epoch != epoch or self.plan is None or self.plan.epoch != epoch:
            return None
        if not all(self.membership is not None and self.membership.heard_since(n, since) for n in plan.node_ids()):
            return None
        return self.placement_for(plan)

    def _ready(self, plan: Plan) -> bool:
        """Every node of the plan is alive and has loaded its shard for it."""
        alive = self.membership.alive_peers() if self.membership is not None else {}
        for node_id in plan.node_ids():
            if node_id == self.node_id:
                if self.ready_epoch < plan.epoch or plan.epoch not in self.stage_server.epochs:
                    return False
                if not self._groups_alive(plan):
                    return False
            else:
                peer = alive.get(node_id)
                if peer is None or peer.ready_epoch < plan.epoch:
                    return False
        return True

    def _groups_alive(self, plan: Plan) -> bool:
        for stage in plan.stages:
            if self.node_id in stage.nodes and len(stage.nodes) > 1:
                shard = self.shards.get(_stage_key(stage))
                if shard is None or not shard.alive():
                    return False
        return True

    def serving_plan(self) -> Plan | None:
        """The plan requests use now: the current one once ready, else the previous one still up."""
        if self.plan is not None and self._ready(self.plan):
            return self.plan
        if self.plan is not None and self.previous is not None and self._ready(self.previous):
            return self.previous
        return None

    def serving_ready(self) -> bool:
        return self.serving_plan() is not None

    def engine_for_request(self) -> Engine:
        """The engine, after checking that the current plan can serve (else a 503)."""
        self.placement(None)
        return self.engine

    def placement(self, after_epoch: int | None):
        """The placement of the current plan; with ``after_epoch``, only a newer, ready one."""
        plan = self.plan
        waiting = after_epoch is not None
        if plan is None:
            if self.plan_error:
                raise _unavailable(f"the model does not fit on the nodes available: {self.plan_error}", 5,
                                   "insufficient_capacity")
            if waiting:
                raise NotReady("no plan yet")
            raise _unavailable("the mesh is still forming; no plan yet")
        serving = self.serving_plan()
        if serving is None or (waiting and serving.epoch <= after_epoch):
            if waiting:
                raise NotReady(f"epoch {plan.epoch} is loading")
            raise _unavailable(f"loading the model's shards for epoch {plan.epoch}")
        return self.placement_for(serving)

    def placement_for(self, plan: Plan):
        placement = self._placements.get(plan.epoch)
        if placement is None:
            kind = HeadPlacement if _head(plan) == self.node_id else RemoteHeadPlacement
            placement = self._placements[plan.epoch] = kind(self, plan)
            for epoch in [e for e in self._placements if e < plan.epoch - 1]:
                del self._placements[epoch]
        return placement

    def stage_handles(self, plan: Plan):
        handles = []
        for stage in plan.stages:
            node_id = stage.nodes[0]
            key = _stage_key(stage)
            if node_id == self.node_id:
                shard = self.shards.get(key)
                if shard is None:
                    raise RuntimeError(f"layers [{key[0]}, {key[1]}) are not loaded here")
                handles.append(LocalStage(shard))
            else:
                handles.append(RemoteStage(
                    node_id=node_id, channel=self.data_channel(node_id), loop=self.loop,
                    start=stage.start_layer, end=stage.end_layer, epoch=plan.epoch,
                    hidden_size=self.profile.hidden_size, dtype=self._activation_dtype(),
                    hop_timeout=self.settings.failure_timeout, observe=self.metrics.hop_observer(node_id),
                    data_port=self.data_port_of(node_id), auth=self.auth, caller=self.node_id,
                    alive=lambda nid=node_id: self.membership is not None and self.membership.heard_within(nid),
                    data_session=HopSession,
                ))
        return handles

    def _activation_dtype(self):
        shard = next(iter(self.shards.values()))
        return shard.dtype

    async def on_generate(self, request: mesh_pb2.GenerateRequest, context):
        serving = self.serving_plan()
        if serving is None or serving.epoch != request.epoch:
            # Not switched yet (the plan is adopted but not ready here, or not adopted yet): the
            # caller tries again shortly. Older than this node's plan: superseded, it waits for that.
            pending = request.epoch > self.epoch or (request.epoch == self.epoch and self.plan is not None)
            await context.abort(EPOCH_PENDING if pending else grpc.StatusCode.FAILED_PRECONDITION,
                                f"epoch {request.epoch} is not the epoch served here "
                                f"({serving.epoch if serving else 'none'}{' yet' if pending else ''})")
        if _head(serving) != self.node_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node is not the head of the plan")
        prompt = list(request.prompt)
        if not prompt or len(prompt) >= self.settings.max_context or max(prompt) >= self.vocab_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty, too long or out of vocabulary")
        if not (1 <= request.max_tokens <= self.settings.max_tokens_limit) or not (0 <= request.temperature <= 2) \
                or not (0 < request.top_p <= 1):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling parameters out of range")
        params = SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                                top_p=request.top_p, seed=request.seed if request.has_seed else None,
                                offset=request.offset)
        try:
            async for token in self.placement_for(serving).tokens(prompt, params):
                yield mesh_pb2.GenerateReply(token=token)
        except EpochPending as exc:
            await context.abort(EPOCH_PENDING, str(exc))
        except PlacementLost as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except GenerationFault as exc:
            await context.abort(STAGE_FAULT, f"{FAULT}{exc}")

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        nodes = []
        if self.membership is not None:
            for nid, info in sorted(self.membership.alive_infos().items()):
                nodes.append({
                    "node_id": nid, "address": info.addresses[0] if info.addresses else "",
                    "addresses": list(info.addresses), "http_port": info.http_port, "grpc_port": info.grpc_port,
                    "memory_budget": info.memory_budget, "total_memory": info.total_memory,
                    "compute": info.compute, "version": info.version,
                    "tensor_port": info.tensor_port, "layer_seconds": info.layer_seconds,
                    "collective_seconds": info.collective_seconds,
                    "holdings": holdings_to_json(info.holdings),
                    "data_address": self.links.best_address(nid) if nid != self.node_id else None,
                    "links": [link.to_dict() for link in
                              (self.links.links() if nid == self.node_id else self.peer_links.get(nid, ()))],
                    "role": "coordinator" if nid == self.coordinator else "member",
                })
        plan = None
        if self.plan is not None:
            plan = {"epoch": self.plan.epoch, "model": self.plan.model, "strategy": self.plan.strategy,
                    "reason": self.plan.reason, "max_context": self.plan.max_context,
                    "estimate_s": self.plan.estimate_s or None, "tokens_per_s": self.plan.tokens_per_s or None,
                    "tokens_per_s_now": round(1 / now, 3) if (now := self._estimate_now()) else None,
                    "alternatives": list(self.plan.alternatives),
                    "stages": [{"start_layer": s.start_layer, "end_layer": s.end_layer, "nodes": list(s.nodes),
                                "bytes": s.bytes, "endpoints": list(s.endpoints)}
                               for s in self.plan.stages]}
        return {
            "node_id": self.node_id, "version": __version__, "model": self.model_id,
            "coordinator": self.coordinator, "epoch": self.epoch, "ready_epoch": self.ready_epoch,
            "healthy": self.serving_ready(), "plan_error": self.plan_error or None,
            "unreachable": self.reach.report(),
            "nodes": nodes, "plan": plan, "events": self.events[-20:],
            "progress": self.progress.current, "metrics": self.metrics.summary(),
        }


def _peer_host(context, port: int) -> str:
    peer = context.peer()  # "ipv4:1.2.3.4:5678"
    host = peer.split(":")[1] if peer.startswith("ipv4:") else "127.0.0.1"
    return f"{host}:{port}"


def _stage_key(stage) -> tuple:
    """What a node holds for a stage: its layers, plus the group's members for a tensor group
    (the same layers shared with other nodes are a different thing to load)."""
    if len(stage.nodes) == 1:
        return (stage.start_layer, stage.end_layer)
    return (stage.start_layer, stage.end_layer, tuple(stage.nodes))


def _endpoint_host(stage, node_id: str, info: NodeInfo) -> str:
    """The address a group member's ring listens on: the plan's choice (the coordinator picks the
    fastest measured path), else the member's first announced address."""
    endpoints = getattr(stage, "endpoints", ())
    if endpoints:
        return endpoints[stage.nodes.index(node_id)]
    return info.addresses[0]


def _close(shard) -> None:
    if isinstance(shard, TensorShard):
        shard.close()


def _head(plan: Plan) -> str:
    """The node holding the model's last layers: it runs each generation of the plan."""
    return plan.stages[-1].nodes[0]


def _layout(plan: Plan) -> list:
    return [(s.start_layer, s.end_layer, tuple(s.nodes)) for s in plan.stages]


def _node_specs(alive: dict[str, NodeInfo]) -> list[NodeSpec]:
    """What the planner needs of each live node, from what it announces."""
    return [NodeSpec(node_id=n.node_id, memory_budget=n.memory_budget, compute=n.compute,
                     layer_seconds=n.layer_seconds or None,
                     collective_s=n.collective_seconds or UNMEASURED_COLLECTIVE_S) for n in alive.values()]


def _same_layout(a: Plan, b: Plan) -> bool:
    return _layout(a) == _layout(b)


def _describe(plan: Plan) -> str:
    return ", ".join(f"[{s.start_layer},{s.end_layer})@{'+'.join(s.nodes)}" for s in plan.stages)


async def serve(settings: Settings) -> None:
    node = Node(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await node.start()
        await stop.wait()
    finally:
        log.info("stopping: saying goodbye to peers")
        await node.stop()


def run_node(settings: Settings) -> int:
    asyncio.run(serve(settings))
    return 0
