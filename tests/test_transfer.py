"""Models from peers (meshnode.weights.manifest, meshnode.weights.transfer): real grpc.aio servers on
127.0.0.1 with cluster-key auth, each serving a ModelStore; fetched folders load as shards that
give outputs identical to shards of the full model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import namedtuple
from pathlib import Path

import grpc
import mlx.core as mx
import pytest

from meshnode.model.build import build_model
from meshnode.model.shard import Shard
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.trust.auth import ClusterAuth
from meshnode.trust.signed import client_interceptors
from meshnode.weights import transfer
from meshnode.weights.manifest import (
    CACHE_NAME,
    PARTIAL_MARKER,
    build_manifest,
    layers_held,
    tensors_for_layers,
    validate_manifest,
)
from meshnode.weights.store import ModelStore
from meshnode.weights.transfer import DiskSpaceError, fetch_layers

KEY = "transfer tests key"
LAYERS = 6
CHUNK = 16 << 10
MODEL = "tiny"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    kw = dict(num_layers=LAYERS, hidden_size=128, dtype="float32", max_file_size_mb=1)
    return {
        "untied": build_model(root / "untied", "llama", tie_word_embeddings=False, **kw),
        "tied": build_model(root / "tied", "llama", tie_word_embeddings=True, **kw),
    }


class StoreServicer(mesh_pb2_grpc.MeshServicer):
    """Delegates Manifest/Fetch to a ModelStore; can corrupt chunks or stop its server."""

    def __init__(self, store: ModelStore, corrupt: bool = False, stop_after: int | None = None):
        self.store, self.corrupt, self.stop_after = store, corrupt, stop_after
        self.chunks = 0
        self.paths: list[str] = []
        self.server = None

    async def Manifest(self, request, context):
        return await self.store.Manifest(request, context)

    async def Fetch(self, request, context):
        self.paths.append(request.path)
        async for chunk in self.store.Fetch(request, context):
            self.chunks += 1
            if self.stop_after is not None and self.chunks > self.stop_after:
                asyncio.get_running_loop().create_task(self.server.stop(None))
                await asyncio.sleep(30)
            if self.corrupt:
                data = bytearray(chunk.data)
                data[len(data) // 2] ^= 0x40
                chunk = mesh_pb2.Chunk(offset=chunk.offset, data=bytes(data))
            yield chunk


@contextlib.asynccontextmanager
async def serving(*servicers: StoreServicer):
    auth = ClusterAuth(KEY)
    servers, peers = [], []
    try:
        for i, servicer in enumerate(servicers):
            srv = grpc.aio.server(interceptors=[auth.server_interceptor()])
            mesh_pb2_grpc.add_MeshServicer_to_server(servicer, srv)
            port = srv.add_insecure_port("127.0.0.1:0")
            await srv.start()
            servicer.server, servicer.port = srv, port
            servers.append(srv)
            ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client_interceptors(auth, "me"))
            peers.append((f"peer{i}", ch))
        yield peers
    finally:
        for _, ch in peers:
            await ch.close()
        for srv in servers:
            await srv.stop(None)


def store(path: Path) -> ModelStore:
    return ModelStore(None, {MODEL: path}, chunk_size=CHUNK)


def same_outputs(full: Path, part: Path, start: int, end: int) -> bool:
    a, b = Shard(full, start, end), Shard(part, start, end)
    if start == 0:
        x = mx.array([[3, 17, 42, 99, 7, 250, 31]])
    else:
        x = mx.random.normal((1, 7, 128), key=mx.random.key(start))
    ya, yb = a.forward(x, a.make_cache()), b.forward(x, b.make_cache())
    return ya.shape == yb.shape and mx.array_equal(ya, yb).item()


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def test_manifest_is_cached_and_valid(models):
    path = models["untied"]
    m = build_manifest(path, MODEL)
    validate_manifest(m, MODEL)
    assert (path / CACHE_NAME).is_file()
    assert len([f for f in m.files if f.path.endswith(".safetensors")]) > 2
    assert build_manifest(path, MODEL) == m  # from the cache
    assert layers_held(path) == [(0, LAYERS)]
    names = {t.name for _, t in tensors_for_layers(m, 2, 5, LAYERS)}
    assert names and all(any(f"layers.{i}." in n for i in (2, 3, 4)) for n in names)
    last = {t.name for _, t in tensors_for_layers(m, 4, 6, LAYERS)}
    assert "lm_head.weight" in last and "model.norm.weight" in last and "model.embed_tokens.weight" not in last
    tied = build_manifest(models["tied"], MODEL)
    assert "model.embed_tokens.weight" in {t.name for _, t in tensors_for_layers(tied, 4, 6, LAYERS)}


@pytest.mark.parametrize(
    "kind,start,end", [("untied", 2, 5), ("untied", 0, 2), ("untied", 4, 6), ("tied", 4, 6), ("tied", 0, 3)]
)
async def test_fetch_only_the_stage_and_it_loads(models, tmp_path, kind, start, end):
    full = models[kind]
    dest = tmp_path / "stage"
    seen = []
    async with serving(StoreServicer(store(full))) as peers:
        result = await fetch_layers(peers, MODEL, start, end, dest, on_progress=lambda d, t: seen.append((d, t)))
    assert result.path == dest and (dest / PARTIAL_MARKER).is_file() and not dest.with_name("stage.partial").exists()
    assert seen[-1] == (result.total_bytes, result.total_bytes)
    assert layers_held(dest) == [(start, end)]
    share = weight_bytes(dest) / weight_bytes(full)
    if (start, end) == (2, 5):
        assert 0.3 < share < 0.6, share
    assert result.fetched_bytes == result.total_bytes < weight_bytes(full) + 10 << 20
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dest / f).read_bytes() == (full / f).read_bytes()
    assert same_outputs(full, dest, start, end)


async def test_spreads_over_peers_and_survives_a_peer_stopping(models, tmp_path):
    full = models["untied"]
    good, dying = StoreServicer(store(full)), StoreServicer(store(full), stop_after=20)
    async with serving(dying, good) as peers:
        result = await fetch_layers(peers, MODEL, 0, LAYERS, tmp_path / "m", chunk_timeout=5)
    assert result.by_peer.get("peer0", 0) > 0 and result.by_peer.get("peer1", 0) > 0, result.by_peer
    assert result.refetched >= 1
    assert same_outputs(full, tmp_path / "m", 1, 4)


async def test_corrupted_chunks_are_refetched_from_a_good_peer(models, tmp_path, caplog):
    full = models["untied"]
    bad, good = StoreServicer(store(full), corrupt=True), StoreServicer(store(full))
    caplog.set_level(logging.WARNING, logger="meshnode.weights.transfer")
    async with serving(bad, good) as peers:
        result = await fetch_layers(peers, MODEL, 2, 5, tmp_path / "m", max_peer_failures=100)
    assert bad.chunks > 0
    assert "peer0" not in result.by_peer and result.refetched >= 1
    assert any("peer0" in r.message and "sha256 mismatch" in r.message for r in caplog.records)
    assert same_outputs(full, tmp_path / "m", 2, 5)


async def test_interrupted_transfer_resumes(models, tmp_path):
    full = models["untied"]
    dest = tmp_path / "m"
    half = asyncio.Event()
    total = {}

    def progress(done, t):
        total["t"] = t
        if done > t // 2:
            half.set()

    async with serving(StoreServicer(store(full))) as peers:
        task = asyncio.create_task(
            fetch_layers(peers, MODEL, 0, LAYERS, dest, on_progress=progress, streams_per_peer=1)
        )
        await half.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not dest.exists() and dest.with_name("m.partial").is_dir()
        result = await fetch_layers(peers, MODEL, 0, LAYERS, dest)
    assert result.reused_bytes > total["t"] // 3
    assert result.fetched_bytes < total["t"] * 2 // 3
    assert result.fetched_bytes + result.reused_bytes == result.total_bytes
    assert same_outputs(full, dest, 0, LAYERS)


async def test_not_enough_disk_space_fails_before_downloading(models, tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(transfer.shutil, "disk_usage", lambda p: Usage(10 << 20, 10 << 20, 1 << 20))
    servicer = StoreServicer(store(models["untied"]))
    async with serving(servicer) as peers:
        with pytest.raises(DiskSpaceError, match="MiB free"):
            await fetch_layers(peers, MODEL, 0, 3, tmp_path / "m")
    assert not any(p.endswith(".safetensors") for p in servicer.paths)
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.partial").exists()


async def test_fetch_from_a_peer_holding_part_of_the_model(models, tmp_path):
    full = models["untied"]
    async with serving(StoreServicer(store(full))) as peers:
        await fetch_layers(peers, MODEL, 1, 5, tmp_path / "cache" / "part")
    part_store = ModelStore(tmp_path / "cache", chunk_size=CHUNK)
    assert part_store.model_ids() == [MODEL]
    async with serving(StoreServicer(part_store)) as peers:
        m = await mesh_pb2_grpc.MeshStub(peers[0][1]).Manifest(mesh_pb2.ManifestRequest(model_id=MODEL))
        assert not m.complete and list(m.layers_held) == ["1-5"]
        await fetch_layers(peers, MODEL, 2, 4, tmp_path / "m")
        with pytest.raises(transfer.FetchError, match="no peer holds"):
            await fetch_layers(peers, MODEL, 4, 6, tmp_path / "n")
    assert same_outputs(full, tmp_path / "m", 2, 4)


async def test_fetch_server_refuses_bad_requests(models):
    full = models["untied"]
    big = next(f for f in build_manifest(full, MODEL).files if f.path.endswith(".safetensors"))
    servicer = StoreServicer(store(full))
    async with serving(servicer) as peers:
        stub = mesh_pb2_grpc.MeshStub(peers[0][1])

        async def code(**kw):
            try:
                async for _ in stub.Fetch(mesh_pb2.FetchRequest(**{"model_id": MODEL, **kw})):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
            return None

        assert (await code(path="../config.json"))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert (await code(path="a/../../etc/passwd"))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert (await code(path="/etc/passwd"))[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert (await code(path="nothere.json"))[0] == grpc.StatusCode.NOT_FOUND
        assert (await code(path=CACHE_NAME))[0] == grpc.StatusCode.NOT_FOUND
        assert (await code(model_id="other", path="config.json"))[0] == grpc.StatusCode.NOT_FOUND
        assert (await code(path=big.path, offset=big.size + 1))[0] == grpc.StatusCode.OUT_OF_RANGE
        assert (await code(path=big.path, offset=big.size - 10, length=11))[0] == grpc.StatusCode.OUT_OF_RANGE
        assert await code(path=big.path, offset=big.size - 10, length=10) is None
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Manifest(mesh_pb2.ManifestRequest(model_id="other"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # unauthenticated callers get nothing
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servicer.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mesh_pb2_grpc.MeshStub(ch).Manifest(mesh_pb2.ManifestRequest(model_id=MODEL))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_partial_folder_lacking_a_tensor_is_refused(models, tmp_path):
    """A partial folder missing a tensor of its layers fails with the tensor's name, never loads."""
    import shutil

    import mlx.core as mx

    full = models["untied"]
    part = tmp_path / "p"
    shutil.copytree(full, part)
    weights = {}
    for f in sorted(part.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
        f.unlink()
    (part / "model.safetensors.index.json").unlink()
    keep = {k: v for k, v in weights.items() if ".layers.2." in k and "q_proj" not in k}
    mx.save_safetensors(str(part / "model.safetensors"), keep)
    (part / PARTIAL_MARKER).write_text(json.dumps({"start": 2, "end": 3}))
    with pytest.raises(ValueError, match="q_proj"):
        Shard(part, 2, 3)
