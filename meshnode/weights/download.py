"""One download of a model's files from peers: a worker per peer stream takes items from a shared
queue; each is verified against its sha256 (a bad one goes back for another peer) and journaled
once fsynced, so the download resumes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc

from meshnode.errors import MeshnodeError
from meshnode.proto import mesh_pb2, mesh_pb2_grpc
from meshnode.weights.store import CHUNK

# A call's gRPC metadata: (key, value) pairs, as ClusterAuth.sign makes them.
Metadata = Sequence[tuple[str, str]]

__all__ = ["DiskSpaceError", "Download", "DownloadItem", "FetchError", "ItemFailed", "JOURNAL", "hash_range"]

log = logging.getLogger(__name__)

JOURNAL = ".meshnode-journal"


class FetchError(MeshnodeError, RuntimeError):
    """A model's layers could not be fetched (no peer holds them, all failed, ...)."""


class DiskSpaceError(FetchError):
    """Not enough free disk space for a transfer; raised before anything is downloaded."""


@dataclass
class DownloadItem:
    key: str  # tensor name, or "file:<path>"
    path: str  # the file of the original model
    offset: int
    length: int
    sha256: str
    out: str  # file in the partial folder
    out_offset: int
    peers: list[str]  # who may supply it
    bad: set[str] = field(default_factory=set)


class ItemFailed(MeshnodeError):
    """One item from one peer failed (``peer_dead``: the peer stopped answering): asked of another."""

    def __init__(self, reason: str, peer_dead: bool = False):
        super().__init__(reason)
        self.peer_dead = peer_dead


def hash_range(path: Path, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            data = f.read(min(CHUNK, left))
            if not data:
                return ""
            h.update(data)
            left -= len(data)
    return h.hexdigest()


def _absorb(h: hashlib._Hash, f: IO[bytes], data: bytes) -> None:
    h.update(data)
    f.write(data)


class Download:
    """One fetch: the work queue, the per-peer workers and the journal."""

    def __init__(
        self,
        peers: dict[str, grpc.aio.Channel],
        model_id: str,
        partial: Path,
        items: list[DownloadItem],
        total: int,
        done_bytes: int,
        on_progress: Callable[[int, int], None] | None,
        streams_per_peer: int,
        chunk_timeout: float,
        max_peer_failures: int,
        metadata: Metadata | None,
    ) -> None:
        self.peers = peers
        self.model_id = model_id
        self.partial = partial
        self.pending = list(items)
        self.inflight = 0
        self.dead: set[str] = set()
        self.failures: dict[str, int] = {}
        self.cond = asyncio.Condition()
        self.total = total
        self.done = done_bytes
        self.fetched = 0
        self.by_peer: dict[str, int] = {}
        self.refetched = 0
        self.on_progress = on_progress
        self.streams = streams_per_peer
        self.chunk_timeout = chunk_timeout
        self.max_failures = max_peer_failures
        self.metadata = metadata
        self.journal = open(partial / JOURNAL, "a")
        # Verified items wait here for the committer to fsync and journal them off the event loop.
        self.verified: list[DownloadItem] = []
        self.verified_ready = asyncio.Event()
        self.closing = False  # no more items will come: the committer drains and returns

    def _eligible(self, peer: str, item: DownloadItem) -> bool:
        return peer in item.peers and peer not in item.bad

    async def _worker(self, peer: str) -> None:
        stub = mesh_pb2_grpc.MeshStub(self.peers[peer])
        while True:
            async with self.cond:
                while True:
                    if peer in self.dead:
                        return
                    item = next((it for it in self.pending if self._eligible(peer, it)), None)
                    if item is not None:
                        self.pending.remove(item)
                        self.inflight += 1
                        break
                    if self.inflight == 0:
                        return  # nothing left this peer could ever take
                    await self.cond.wait()
            ok = False
            try:
                await self._fetch(stub, peer, item)
                ok = True
            except ItemFailed as e:
                what = "tensor" if not item.key.startswith("file:") else "file"
                log.warning(
                    "peer %s: %s %s of %s: %s; refetching elsewhere",
                    peer,
                    what,
                    item.key.removeprefix("file:"),
                    self.model_id,
                    e,
                )
                item.bad.add(peer)
                self.failures[peer] = self.failures.get(peer, 0) + 1
                if e.peer_dead or self.failures[peer] >= self.max_failures:
                    log.warning("peer %s: dropped from this transfer", peer)
                    self.dead.add(peer)
            finally:
                async with self.cond:
                    self.inflight -= 1
                    if not ok:
                        self.refetched += 1
                        self.pending.append(item)
                    self.cond.notify_all()

    async def _fetch(self, stub: mesh_pb2_grpc.MeshStub, peer: str, item: DownloadItem) -> None:
        req = mesh_pb2.FetchRequest(model_id=self.model_id, path=item.path, offset=item.offset, length=item.length)
        call = stub.Fetch(req, metadata=self.metadata)
        h = hashlib.sha256()
        got = 0
        out = self.partial / item.out
        mode = "wb" if item.key.startswith("file:") else "r+b"
        if mode == "wb":
            out.parent.mkdir(parents=True, exist_ok=True)
        absorbing = None  # the previous chunk being hashed and written while the next one arrives
        try:
            with open(out, mode) as f:
                f.seek(item.out_offset)
                try:
                    while True:
                        try:
                            chunk = await asyncio.wait_for(call.read(), self.chunk_timeout)
                        except TimeoutError:
                            raise ItemFailed(f"no data for {self.chunk_timeout:g} s", peer_dead=True) from None
                        if absorbing is not None:
                            await absorbing
                            absorbing = None
                        if chunk is grpc.aio.EOF:
                            break
                        n = len(chunk.data)
                        self.fetched += n
                        if chunk.offset != item.offset + got or n == 0 or got + n > item.length:
                            raise ItemFailed(
                                f"chunk at {chunk.offset} with {n} bytes, expected offset "
                                f"{item.offset + got} and at most {item.length - got} bytes"
                            )
                        # hashlib and file writes release the GIL: off the loop, they overlap the network
                        absorbing = asyncio.ensure_future(asyncio.to_thread(_absorb, h, f, chunk.data))
                        got += n
                        self._progress(n)
                finally:
                    if absorbing is not None:  # never close the file under a write still running
                        await asyncio.gather(absorbing, return_exceptions=True)
                if got != item.length:
                    raise ItemFailed(f"stream ended after {got} of {item.length} bytes")
                if h.hexdigest() != item.sha256:
                    raise ItemFailed(f"sha256 mismatch ({h.hexdigest()[:12]}… != {item.sha256[:12]}…)")
        except grpc.aio.AioRpcError as e:
            self._progress(-got)
            dead = e.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.CANCELLED,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAUTHENTICATED,
            )
            raise ItemFailed(f"{e.code().name}: {e.details()}", peer_dead=dead) from None
        except ItemFailed:
            self._progress(-got)
            raise
        finally:
            call.cancel()  # no-op once the stream ended; stops the peer's sender otherwise
        self.by_peer[peer] = self.by_peer.get(peer, 0) + item.length
        self.verified.append(item)
        self.verified_ready.set()

    async def _committer(self) -> None:
        """Make verified items durable in batches, then journal them (a crash refetches the rest)."""
        while True:
            await self.verified_ready.wait()
            self.verified_ready.clear()
            batch, self.verified = self.verified, []
            if batch:
                await asyncio.to_thread(self._make_durable, batch)
            if self.closing and not self.verified:
                return

    def _make_durable(self, batch: list[DownloadItem]) -> None:
        if self.journal.closed:  # the transfer was cancelled meanwhile: the next call re-verifies
            return
        for out in dict.fromkeys(self.partial / it.out for it in batch):
            fd = os.open(out, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for it in batch:
            self.journal.write(json.dumps({"key": it.key, "sha256": it.sha256}) + "\n")
        self.journal.flush()
        os.fsync(self.journal.fileno())

    def _progress(self, n: int) -> None:
        self.done += n
        if self.on_progress is not None and n:
            self.on_progress(self.done, self.total)

    async def run(self) -> None:
        committer = asyncio.create_task(self._committer())
        try:
            workers = [asyncio.create_task(self._worker(p)) for p in self.peers for _ in range(self.streams)]
            try:
                await asyncio.gather(*workers)
            finally:
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                self.closing = True  # what was verified still becomes durable and journaled, even on failure
                self.verified_ready.set()
                await asyncio.shield(committer)
        finally:
            committer.cancel()
            self.journal.close()
        if self.pending:
            missing = ", ".join(it.key.removeprefix("file:") for it in self.pending[:5])
            raise FetchError(
                f"no peer could supply {len(self.pending)} item(s) of {self.model_id} "
                f"({missing}{', …' if len(self.pending) > 5 else ''})"
            )
