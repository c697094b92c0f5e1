"""Shared test helpers: run a real node (aiohttp + gRPC servers) in a background thread."""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness.cluster import HTTP, node_argv
from meshnode.config import load_settings
from meshnode.node import Node

# Chats sent at once from one client with the openai package (threads), every other one streamed:
# argv base URL, JSON [[model, prompt], ...], max_tokens; prints {"answers": [...], "models": [ids listed]}.
CONCURRENT_CHATS = r"""
import json, sys, threading
from openai import OpenAI
base, asks, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
out = [None] * len(asks)
def one(i):
    model, prompt = asks[i]
    messages = [{"role": "user", "content": prompt}]
    if i % 2:
        out[i] = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=model, messages=messages, max_tokens=n, temperature=0, stream=True) if ch.choices)
    else:
        out[i] = c.chat.completions.create(model=model, messages=messages, max_tokens=n,
                                           temperature=0).choices[0].message.content
threads = [threading.Thread(target=one, args=(i,)) for i in range(len(asks))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"answers": out, "models": sorted(m.id for m in c.models.list())}))
"""

NPM_DIR = Path.home() / ".cache" / "meshnode" / "npm"  # npm tools the tests run (coding agents)
CODEX = NPM_DIR / "node_modules" / ".bin" / "codex"


@contextmanager
def running_node(model: Path | str | None, tmp_path: Path, *, ready: bool = True, **overrides):
    """A Node on 127.0.0.1 with ephemeral ports and mDNS off; yields (node, base_url). With
    ``ready`` (the default) only once it serves; else as soon as it listens."""
    flags = dict(
        model=str(model) if model else None,
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        mdns=False,
        state_dir=str(tmp_path / "state"),
        cache_dir=str(tmp_path / "cache"),
        memory_budget=8 * 2**30,
    )
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
        except BaseException as exc:  # noqa: BLE001 - surfaced to the test
            errors.append(exc)
            started.set()
            return
        started.set()
        await done.wait()
        await node.stop()

    # As asyncio.run does, the runner cancels and awaits what is still pending when main() ends (a
    # stream in flight): a task left in a closed loop is destroyed by a later garbage collection,
    # whose error would land in whatever test runs then.
    runner = asyncio.Runner(loop_factory=lambda: loop)
    thread = threading.Thread(target=runner.run, args=(main(),), daemon=True)
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
        runner.close()


def npm_tool(package: str, binary: Path) -> Path:
    """``binary`` of the npm ``package``, installed from the npm registry into NPM_DIR the first time.
    An exclusive lock on NPM_DIR serialises installs, so parallel test workers never run two npm
    installs into one prefix."""
    if binary.exists():
        return binary
    if shutil.which("npm") is None:
        pytest.skip(f"npm is not installed: {package} cannot be installed (.ci/run installs npm)")
    NPM_DIR.mkdir(parents=True, exist_ok=True)
    with open(NPM_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            status, _, err = run_group(
                ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(NPM_DIR), package], timeout=600
            )
            if status != 0:
                pytest.skip(f"npm could not install {package}: {err[-500:]}")
    assert binary.exists(), f"npm installed {package} but {binary} is missing"
    return binary


CLAUDE_CODE = "2.1.332"  # the version the test holds the node to


def claude_code() -> Path:
    """Claude Code (npm ``@anthropic-ai/claude-code``), installed once into NPM_DIR. Its binary is in
    the optional package for the platform; the main package's postinstall, which npm may not run,
    only links it."""
    import platform

    arch = {"x86_64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), platform.machine())
    system = {"Linux": "linux", "Darwin": "darwin"}.get(platform.system(), platform.system().lower())
    binary = NPM_DIR / "node_modules" / "@anthropic-ai" / f"claude-code-{system}-{arch}" / "claude"
    claude = npm_tool(f"@anthropic-ai/claude-code@{CLAUDE_CODE}", binary)
    status, out, _ = run_group([str(claude), "--version"], timeout=60)
    if status != 0:
        pytest.skip("the Claude Code binary does not run on this machine")
    assert out.startswith(CLAUDE_CODE), out
    return claude


def codex_cli() -> Path:
    """Codex CLI (npm ``@openai/codex``), installed once into NPM_DIR."""
    codex = npm_tool("@openai/codex", CODEX)
    if run_group([str(codex), "--version"], timeout=60)[0] != 0:
        pytest.skip("the Codex CLI binary does not run on this machine")
    return codex


def codex_setup(tmp_path: Path, model: str, base_url: str) -> tuple[Path, dict]:
    """(working folder, environment) for ``codex exec`` set up with only ``base_url`` (a custom
    model provider, wire API "responses"). Codex's long base instructions are swapped for a line
    (model_instructions_file) so that the CPU prefill stays short."""
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "instructions.md").write_text("You are a helpful coding assistant.\n")
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "meshnode"\n'
        f'model_instructions_file = "{home / "instructions.md"}"\n\n'
        f'[model_providers.meshnode]\nname = "meshnode"\nbase_url = "{base_url}"\n'
        'env_key = "MESHNODE_API_KEY"\nwire_api = "responses"\n'
    )
    return work, {**os.environ, "HOME": str(tmp_path), "CODEX_HOME": str(home), "MESHNODE_API_KEY": "unused"}


def run_group(args: list[str], timeout: float, **kw) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a command in its own process group, which is killed whole
    if it runs past ``timeout`` (npm's codex script starts the native binary as a child)."""
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{args[0]} ran past {timeout} s: {out[-2000:]} {err[-3000:]}")
    return proc.returncode, out, err


def prompt_cache_reuse(metrics_text: str) -> tuple[int, int]:
    """(hits, reused positions) from a node's /metrics."""
    values = {}
    for line in metrics_text.splitlines():
        if line.startswith(("meshnode_prompt_cache_hits_total", "meshnode_prompt_cache_reused_tokens_total")):
            name, value = line.rsplit(" ", 1)
            values[name] = int(float(value))
    return values.get("meshnode_prompt_cache_hits_total", 0), values.get("meshnode_prompt_cache_reused_tokens_total", 0)


def node_metrics(cluster, host) -> str:
    """``host``'s /metrics, fetched from ``cluster``'s client namespace (a harness.cluster.Cluster)."""
    code = (
        f"import urllib.request; print(urllib.request.urlopen('http://{host.ip}:{HTTP}/metrics', timeout=5)"
        ".read().decode())"
    )
    return cluster.client.run([sys.executable, "-c", code], timeout=20).stdout


class LoneMesh:
    """What a ServedModel asks of the mesh, for a node with no peers (tests of one node's
    ServedModel): ready() then asks only this node."""

    membership = None

    def plan_error_of(self, model_id):
        return ""


def tensor_group(model, start, end, size=2, secrets=None, ready_timeout_s=60, num_layers=6, **kwargs) -> list:
    """A tensor group of ``size`` real worker processes on loopback sharing layers [start, end) of
    ``model`` (meshnode.model.tensor); the caller closes every member. As in a node, where the
    control plane's heartbeats say it, a step is waited for while every member's worker runs (a
    first step compiles the family's kernels: seconds on a busy machine); ``members_alive=None``
    leaves only the per-step deadline."""
    from meshnode.model.compute import free_ports
    from meshnode.model.tensor import TensorShard

    *ring, control = free_ports(size + 1)
    endpoints = [f"127.0.0.1:{p}" for p in ring]
    secrets = secrets or [b"k" * 32] * size
    members: list = []
    kwargs.setdefault("members_alive", lambda: all(m.alive() for m in members))
    members += [
        TensorShard(
            model,
            start,
            end,
            num_layers,
            rank=r,
            endpoints=endpoints,
            control=f"127.0.0.1:{control}",
            secret=secrets[r],
            **kwargs,
        )
        for r in range(size)
    ]
    errors: list[BaseException] = []

    def launch(m):
        try:
            m.launch(ready_timeout_s)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=launch, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for m in members:
            m.close()
        raise errors[0]
    return members


NODE_UP = re.compile(r"node (\S+) up: HTTP :(\d+), gRPC :(\d+)")


def clean_env() -> dict[str, str]:
    """This environment without MESHNODE_* variables (a node then takes its defaults)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MESHNODE_")}


@contextmanager
def meshnode_run(tmp_path: Path, env: dict[str, str] | None = None, **flags):
    """A real `meshnode run` process on 127.0.0.1 (mDNS off) with ``flags`` (``node_argv``'s) and
    ``env`` (default :func:`clean_env`); yields (node id, http port, log path) once it is up."""
    log = tmp_path / "node.log"
    argv = node_argv(host="127.0.0.1", mdns=False, state_dir=tmp_path / "state", **flags)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=clean_env() if env is None else env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while not (m := NODE_UP.search(log.read_text())):
            assert proc.poll() is None, f"meshnode run exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"meshnode run did not come up:\n{log.read_text()}"
            time.sleep(0.1)
        yield m.group(1), int(m.group(2)), log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
