"""Shared test helpers: run a real node (aiohttp + gRPC servers) in a background thread."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from meshnode.config import load_settings
from meshnode.node import Node


@contextmanager
def running_node(model: Path | str | None, tmp_path: Path, *, ready: bool = True, **overrides):
    """A Node on 127.0.0.1 with ephemeral ports and mDNS off; yields (node, base_url). With
    ``ready`` (the default) only once it serves; else as soon as it listens."""
    flags = dict(model=str(model) if model else None, host="127.0.0.1", http_port=0, grpc_port=0, mdns=False,
                 state_dir=str(tmp_path / "state"), cache_dir=str(tmp_path / "cache"), memory_budget=8 * 2**30)
    flags.update(overrides)
    settings = load_settings(None, env={}, flags=flags)
    loop = asyncio.new_event_loop()
    node = Node(settings)
    started = threading.Event()
    errors: list[BaseException] = []
    done = asyncio.Event()

    async def main():
        try:
            await node.start()
        except BaseException as exc:  # surfaced to the test
            errors.append(exc)
            started.set()
            return
        started.set()
        await done.wait()
        await node.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(120), "node did not start"
    if errors:
        raise errors[0]
    base = f"http://127.0.0.1:{node.http_port}"
    deadline = time.monotonic() + 60
    while ready and not node.serving_ready():
        assert time.monotonic() < deadline, "node never became ready"
        time.sleep(0.05)
    try:
        yield node, base
    finally:
        loop.call_soon_threadsafe(done.set)
        thread.join(30)
        loop.close()
