"""Shared pieces of the benchmarks: the model, mlx-lm's own figure, and streaming from a node."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

# ~100M parameters in float32: llama, hidden 768, 16 layers, MLP 2048.
BENCH_MODEL = dict(
    family="llama",
    num_layers=16,
    hidden_size=768,
    intermediate_size=2048,
    num_heads=12,
    num_kv_heads=4,
    dtype="float32",
)
PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 4


def parse_args(doc: str, more=None):
    """The options every benchmark takes: tokens to decode, and where the model is cached;
    ``more(parser)`` adds a benchmark's own."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    if more is not None:
        more(ap)
    return ap.parse_args()


def bench_model_dir(root: Path, **changes) -> Path:
    """The bench model, built once under ``root``; ``changes`` (e.g. dtype, quantize) make a variant."""
    from meshnode.model.build import model_dir_for

    kwargs = {**BENCH_MODEL, **changes}
    family = kwargs.pop("family")
    return model_dir_for(root, family, **kwargs)


def first_difference(a: Sequence, b: Sequence) -> int | None:
    """The first index where two token lists (or texts) differ (a shorter one differs where it ends)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mlx_device() -> str:
    """Where MLX computes in this process, in words for a benchmark's header (e.g. "gpu (NVIDIA H200)")."""
    import mlx.core as mx

    from meshnode import blas

    device = mx.default_device()
    matmuls = f"; matmuls: {blas.in_use()}" if device.type == mx.DeviceType.cpu else ""
    return f"{device.type.name} ({mx.device_info().get('device_name', '?')}{matmuls})"


def exact_backend() -> bool:
    """Whether MLX here computes a row's result whatever the shape it is part of (MLX's CPU build on
    its own reference BLAS): then any split, batch or speculative pass gives mlx-lm's greedy tokens
    bit for bit. Not on a GPU, nor on OpenBLAS (meshnode.blas), whose kernels round by shape."""
    import mlx.core as mx

    from meshnode import blas

    return mx.default_device().type == mx.DeviceType.cpu and blas.loaded() is None


def param_count(path: Path) -> int:
    from meshnode.weights.profile import profile_model
    from meshnode.weights.weightfiles import ITEMSIZE

    p = profile_model(path)
    bytes_per = ITEMSIZE.get(p.dtype, 4)
    return (sum(p.layer_bytes) + p.embed_bytes + p.head_bytes + p.norm_bytes) // bytes_per


def mlx_lm_decode_tps(path: Path, max_tokens: int, repeats: int = 3) -> float:
    """Decode tokens/s of mlx_lm.stream_generate in this process (best of ``repeats``)."""
    return mlx_lm_decoder(path)(max_tokens, repeats)


def mlx_lm_decoder(path: Path, text: str = PROMPT):
    """The model loaded once: ``decode(max_tokens, repeats)`` gives mlx_lm.stream_generate's decode
    tokens/s (best of ``repeats``) after the chat prompt ``text``, for measuring it again between
    other measurements."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)

    def decode(max_tokens: int, repeats: int = 3) -> float:
        figures = []
        for _ in range(repeats):
            times = []
            for _r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
                times.append(time.perf_counter())
            figures.append((len(times) - 1) / (times[-1] - times[0]))
        return max(figures)

    return decode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never became healthy")


def sse_events(response):
    """The JSON events of a server-sent event stream (``data: [DONE]`` and blank lines skipped)."""
    for line in response:
        if line.startswith(b"data: {"):
            yield json.loads(line[6:])


def http_decode_tps(
    url: str, model_id: str, max_tokens: int, repeats: int = 3, text: str = PROMPT
) -> tuple[float, int]:
    """Decode tokens/s seen by an HTTP streaming client (best of ``repeats``), and tokens generated.

    Tokens are counted from the usage chunk, not from text chunks: a token that ends inside a
    multi-byte character streams no text of its own. The clock runs from the first text chunk
    to the last chunk, so the prompt's prefill is not counted.
    """
    body = json.dumps(
        {
            "model": model_id,
            "messages": [{"role": "user", "content": text}],
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    figures, count = [], 0
    for _ in range(repeats):
        req = urllib.request.Request(
            f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        first = last = None
        with urllib.request.urlopen(req, timeout=600) as r:
            for event in sse_events(r):
                if event.get("usage"):
                    count = event["usage"]["completion_tokens"]
                    continue
                delta = event["choices"][0]["delta"]
                if first is None and delta.get("content"):
                    first = time.perf_counter()
                if event["choices"][0]["finish_reason"]:
                    last = time.perf_counter()
        figures.append((count - 1) / (last - first))
    return max(figures), count


def start_node(
    argv: list[str], env: dict | None = None, log: Path | None = None, prefix: list[str] = ()
) -> subprocess.Popen:
    """Start ``argv`` (a ``meshnode run`` command line: ``harness.cluster.node_argv``) on this machine."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    return subprocess.Popen(
        [*prefix, *argv],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def median(xs):
    return statistics.median(xs)


MESH_HTTP, MESH_GRPC = 8470, 8471


@contextlib.contextmanager
def mlx_lm_server(model: Path, launch: tuple[str, ...] = ("-m", "mlx_lm.server")):
    """One ``mlx_lm.server`` process on loopback serving ``model`` (the baseline); yields its base URL.
    ``launch``: what follows the interpreter to start it (``-c`` code that loads a node's BLAS first)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, *launch, "--model", str(model), "--port", str(port)]
        with open(Path(tmp) / "server.log", "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", 300)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop(proc)


@contextlib.contextmanager
def local_node(model: Path, max_context: int, env: dict | None = None):
    """One ``meshnode run`` process on loopback (mDNS off) serving ``model`` (``env``: more of its
    environment); yields its base URL."""
    from harness.cluster import node_argv

    with tempfile.TemporaryDirectory() as tmp:
        http, grpc = free_port(), free_port()
        proc = start_node(
            node_argv(
                model,
                host="127.0.0.1",
                http_port=http,
                grpc_port=grpc,
                mdns=False,
                state_dir=tmp,
                max_context=max_context,
            ),
            env=env,
            log=Path(tmp) / "node.log",
        )
        try:
            wait_healthy(f"http://127.0.0.1:{http}", 300)
            yield f"http://127.0.0.1:{http}"
        finally:
            stop(proc)


# For the client scripts the benchmarks run where the client lives (here, or in a namespace):
# stream one greedy chat completion; (seconds to the first text, seconds in all, the text).
STREAM_CHAT = r"""
import json, time, urllib.request
def stream_chat(url, model, messages, max_tokens, timeout=900):
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    t0 = time.perf_counter(); first = None; text = ""
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                piece = ev["choices"][0]["delta"].get("content") if ev.get("choices") else None
                if piece:
                    first = first or time.perf_counter()
                    text += piece
    end = time.perf_counter()
    return (first or end) - t0, end - t0, text
"""


@contextlib.contextmanager
def two_stage_mesh(
    model: Path,
    max_context: int,
    *,
    pin: bool = False,
    fraction: float = 0.6,
    env: dict | None = None,
    cores: list[int] | None = None,
    loopback: bool = False,
    drafts: Path | None = None,
):
    """Two ``meshnode run`` processes on namespace hosts, pipelined (neither holds the model alone),
    and a third host for the client; yields ``(client, entry_url, node_logs)`` once a 2-stage plan
    serves: ``entry_url`` is the node that is not the head (a client of any node is relayed to the
    head). ``pin``: each node's process on a core of its own (``taskset``), as on two machines;
    unpinned, the two share this box's cores and one's compute takes CPU from the other's (``cores``:
    the ones to pin to, this thread's by default). Needs root, except with ``loopback``: both nodes
    on 127.0.0.1 (ports of their own, each the other's static peer, mDNS off) and the client here
    (``client`` is None), for a machine without network namespaces, such as a lent GPU. ``drafts``:
    the nodes' scripted guesses for speculative decoding (harness/drafts.py), a test hook.

    Both nodes are given one speed figure, measured here once (the best of 3, as the tests'
    ``seed_figures``): they stand for two identical machines, and on a VM whose timings drift each
    node's own measure at start can differ by more than SAME_SPEED, so that the planner splits the
    layers unevenly. It is yielded once both have also timed a layer split two ways (`measuring` in
    /v1/mesh): until then two processes share each node's core, so the first requests run slower
    and the head prices its speculative passes on a slowed machine."""
    from harness.cluster import node_argv, wait_mesh
    from meshnode.model.compute import CACHE_FILE, seed_figures
    from meshnode.weights.profile import profile_model

    root = Path(__file__).resolve().parent.parent
    profile = profile_model(model)
    budget = int(profile.total_bytes(max_context) * fraction)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        seed_figures(model, profile.num_layers, tmp / "seed", max(profile.layer_bytes), tensor=False)
        if loopback:
            # ports 100 apart: each node also listens on grpc_port + 1 to + 34 (tensor, echo, data)
            hosts = [_LoopbackHost(f"node-{i}") for i in range(2)]
            stack.callback(lambda: [stop(proc) for h in hosts for proc in h.procs])
            client = None
            flags = [
                dict(
                    http_port=MESH_HTTP + 100 * i,
                    grpc_port=MESH_GRPC + 100 * i,
                    host=h.ip,
                    mdns=False,
                    peers=[f"{h.ip}:{MESH_GRPC + 100 * (1 - i)}"],
                )
                for i, h in enumerate(hosts)
            ]
        else:
            from harness.netns import netns_mesh

            *hosts, client = stack.enter_context(netns_mesh(3)).hosts
            flags = [dict(http_port=MESH_HTTP, grpc_port=MESH_GRPC)] * len(hosts)
        urls = {h.name: f"http://{h.ip}:{f['http_port']}" for h, f in zip(hosts, flags)}
        cores = cores or sorted(os.sched_getaffinity(0))
        logs = [tmp / h.name / "node.log" for h in hosts]
        for i, (h, node_flags) in enumerate(zip(hosts, flags)):
            state = tmp / h.name
            state.mkdir()
            shutil.copy(tmp / "seed" / CACHE_FILE, state / CACHE_FILE)
            h.popen(
                (["taskset", "-c", str(cores[i % len(cores)])] if pin else [])
                + node_argv(
                    model,
                    **node_flags,
                    node_id=h.name,
                    budget=budget,
                    state_dir=state,
                    # budgets are fractions of one request's total (as in the tests)
                    max_context=max_context,
                    kv_requests=1,
                    drafts=drafts,
                ),
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH")))),
                    "MESHNODE_CLUSTER_KEY": "bench",
                    "MESHNODE_STRATEGY": "pipeline",
                    **(env or {}),
                },
                log_path=state / "node.log",
            )
        view = wait_mesh(
            urls[hosts[0].name],
            lambda v: v["healthy"] and v["plan"] and len(v["plan"]["stages"]) == 2,
            client=client,
            timeout=200,
            what="a 2-stage plan",
            details=lambda: "".join(log.read_text()[-3000:] for log in logs),
        )
        for h in hosts:  # a node's first start times a layer split two ways meanwhile (`measuring`)
            wait_mesh(
                urls[h.name],
                lambda v: v["measuring"] is None,
                client=client,
                timeout=200,
                what=f"{h.name} to finish measuring its machine",
            )
        yield client, urls[view["plan"]["stages"][0]["nodes"][0]], logs


class _LoopbackHost:
    """A node's place in ``two_stage_mesh(loopback=True)``: this machine (its ports: the node's flags)."""

    ip = "127.0.0.1"

    def __init__(self, name: str):
        self.name, self.procs = name, []

    def popen(self, cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
        self.procs.append(start_node(cmd, env=env, log=log_path))
        return self.procs[-1]
