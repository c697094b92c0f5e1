"""Real meshnode processes on namespace hosts, driven from a client namespace.

The test process lives outside the namespaces: every request is made from the mesh's client
host, so no packet for 198.18.x.y ever leaves through this machine's own network.

Shared by tests/ and benchmarks/: ``node_argv`` (the one ``meshnode run`` command line),
``in_ns`` (Python run inside a host, its JSON answer), ``fetch`` and ``mesh_view`` (one request
made from a host), ``wait_until`` (poll a condition) and ``wait_mesh`` (poll a node's
``/v1/mesh`` until a predicate over it holds); ``Cluster`` builds on them.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.requester import request

HTTP, GRPC = 8470, 8471
KEY = "test-cluster-key"
HOOKED_NODE = Path(__file__).resolve().parent / "hooked_node.py"  # `meshnode run` with test hooks


def node_argv(
    model: Path | str | None = None,
    *,
    http_port: int | str | None = None,
    grpc_port: int | str | None = None,
    node_id: str | None = None,
    budget: int | str | None = None,
    state_dir: Path | str | None = None,
    max_context: int | None = None,
    cache_dir: Path | str | None = None,
    kv_requests: int | None = None,
    host: str | None = None,
    config: Path | str | None = None,
    peers=(),
    mdns: bool = True,
    extra=(),
    stage_delays: Path | str | None = None,
    drafts: Path | str | None = None,
) -> list[str]:
    """The argv of ``python -m meshnode.cli run`` (this interpreter) with these flags; a flag whose
    value is None is left out (the node's default or config file applies). ``budget`` is
    ``--memory-budget`` (bytes or a size such as "1GiB"); ``peers``: one ``--peer`` each;
    ``mdns=False``: ``--no-mdns``; ``extra``: further arguments, last (e.g. ``["--encrypt"]``).
    ``stage_delays`` (harness/faults.py), ``drafts`` (harness/drafts.py): files of test hooks,
    which the node gets through harness/hooked_node.py instead."""
    hooks = [
        arg
        for flag, path in (("--stage-delays", stage_delays), ("--drafts", drafts))
        if path is not None
        for arg in (flag, str(path))
    ]
    argv = [sys.executable, *((str(HOOKED_NODE), *hooks) if hooks else ("-m", "meshnode.cli")), "run"]
    for flag, value in (
        ("--config", config),
        ("--model", model),
        ("--host", host),
        ("--http-port", http_port),
        ("--grpc-port", grpc_port),
        ("--node-id", node_id),
        ("--memory-budget", budget),
        ("--state-dir", state_dir),
        ("--max-context", max_context),
        ("--cache-dir", cache_dir),
        ("--kv-requests", kv_requests),
    ):
        if value is not None:
            argv += [flag, str(value)]
    for peer in peers:
        argv += ["--peer", peer]
    if not mdns:
        argv.append("--no-mdns")
    return [*argv, *extra]


def in_ns(host, code: str, *args, timeout: float = 600, env: dict | None = None) -> Any:
    """Run the Python ``code`` (``sys.argv[1:]``: ``args``, as strings) inside ``host`` (a
    ``NetHost``; None: here, outside the namespaces) and return the JSON of the last line it
    printed. Raises RuntimeError with the end of its stderr if it exits non-zero."""
    cmd = [sys.executable, "-c", code, *map(str, args)]
    kw = dict(capture_output=True, text=True, timeout=timeout, check=False, env=env)
    out = subprocess.run(cmd, **kw) if host is None else host.run(cmd, **kw)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    lines = out.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"printed nothing; stderr: {out.stderr[-3000:]}")
    return json.loads(lines[-1])


def fetch(client, url: str, body=None, timeout: float = 10.0) -> list:
    """One HTTP request made from ``client`` (a ``NetHost``; None: from here): ``[status, headers,
    JSON body]``, an HTTP error status included; OSError if no answer came (refused, timed out)."""
    return request(client, url, json.dumps(body) if body else "", timeout)


def mesh_view(url: str, client=None, timeout: float = 3.0) -> dict:
    """``GET <url>/v1/mesh`` from ``client`` (None: from here), once; ``url`` is the node's base URL."""
    return fetch(client, f"{url}/v1/mesh", timeout=timeout)[2]


def wait_until(
    check: Callable[[], Any],
    timeout: float,
    what: str,
    *,
    interval: float = 0.2,
    details: Callable[[], str] | None = None,
) -> Any:
    """Call ``check`` until it returns something truthy, and return that; an OSError it raises
    counts as "not yet". After ``timeout`` seconds: AssertionError naming ``what``, the last
    result and ``details()`` (e.g. the nodes' logs)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}" + (f"\n{details()}" if details else ""))


# Polls a URL for JSON until killed: one line per try, ["ok", body] or ["error", why].
_WATCH = (
    "import json,sys,time,urllib.request\n"
    "url,every,t=sys.argv[1],float(sys.argv[2]),float(sys.argv[3])\n"
    "while True:\n"
    "  try:\n"
    "    with urllib.request.urlopen(url,timeout=t) as r: line=json.dumps(['ok',json.load(r)])\n"
    "  except Exception as e:\n"
    "    line=json.dumps(['error',repr(e)])\n"
    "  print(line,flush=True)\n"
    "  time.sleep(every)\n"
)


def wait_mesh(
    url: str,
    until: Callable[[dict], Any],
    *,
    timeout: float,
    what: str,
    client=None,
    interval: float = 0.2,
    request_timeout: float = 2.0,
    details: Callable[[], str] | None = None,
) -> dict:
    """Poll ``<url>/v1/mesh`` (``url``: a node's base URL) from ``client`` (a ``NetHost``; None:
    from here) every ``interval`` seconds until ``until(view)`` is truthy; returns that view.
    One polling process runs for the whole wait (not one per try). A try that gets no answer, or a
    view on which ``until`` raises KeyError, TypeError or IndexError (no plan yet), counts as "not
    yet". After ``timeout`` seconds: AssertionError naming ``what``, the last view or error, and
    ``details()``."""
    cmd = [sys.executable, "-c", _WATCH, f"{url}/v1/mesh", str(interval), str(request_timeout)]
    proc = subprocess.Popen(
        cmd if client is None else client.exec_args(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline, last, why = time.monotonic() + timeout, None, f"timed out after {timeout} s"
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                why = f"the polling process exited ({proc.wait()}): {proc.stderr.read()[-2000:]}"
                break
            kind, last = json.loads(line)
            if kind != "ok":
                continue
            try:
                if until(last):
                    return last
            except (KeyError, TypeError, IndexError) as exc:
                last = {"view": last, "predicate": repr(exc)}
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join(5)  # it reads to the end of the output of the process just killed
        proc.stdout.close()
        proc.stderr.close()
    raise AssertionError(
        f"waiting for {what} in {url}/v1/mesh: {why}; last: {json.dumps(last)[-3000:]}"
        + (f"\n{details()}" if details else "")
    )


_LOAD = (
    "import json,sys,time,urllib.request,urllib.error,socket\n"
    "url,body,until=sys.argv[1],sys.argv[2],time.time()+float(sys.argv[3])\n"
    "while time.time()<until:\n"
    "  req=urllib.request.Request(url,data=body.encode(),headers={'Content-Type':'application/json'})\n"
    "  t=time.time()\n"
    "  try:\n"
    "    r=urllib.request.urlopen(req,timeout=60); out=json.loads(r.read())\n"
    "    print(json.dumps(['ok',out['choices'][0]['message']['content'],time.time()-t]),flush=True)\n"
    "  except urllib.error.HTTPError as e:\n"
    "    print(json.dumps([e.code,e.headers.get('Retry-After'),time.time()-t]),flush=True)\n"
    "  except (socket.timeout, TimeoutError):\n"
    "    print(json.dumps(['hung',None,time.time()-t]),flush=True)\n"
    "  except Exception as e:\n"
    "    print(json.dumps(['lost',repr(e),time.time()-t]),flush=True)\n"
    "  time.sleep(0.1)\n"
)


class Cluster:
    """n meshnode hosts plus a client host; every request is made from the client namespace."""

    def __init__(self, mesh, model: Path, tmp: Path, budgets=(), *, max_context: int = 512, seed: Path | None = None):
        """``seed``: a folder whose compute.json every node starts with (the same figures on every
        host, as installed nodes of one machine type have them cached, instead of each timing them
        while the others do: on shared cores those differ widely and plans follow them)."""
        self.mesh, self.model, self.tmp, self.max_context, self.seed = mesh, model, tmp, max_context, seed
        self.hosts = list(mesh.hosts)
        self.client = mesh.add_host("client")
        self.procs = {}
        for h, b in zip(self.hosts, budgets):
            self.start(h, b)

    def start(
        self,
        host,
        budget,
        *,
        key: str = KEY,
        peers=(),
        mdns: bool = True,
        env=None,
        model=None,
        stage_delays: Path | None = None,
        drafts: Path | None = None,
        kv_requests: int = 1,
        build: Path | None = None,
    ):
        """``model``: what ``--model`` names (default: the model folder); a node's own
        ``--cache-dir`` is ``<tmp>/<host>/cache``; ``stage_delays``, ``drafts``: files of test
        hooks (``node_argv``); ``kv_requests``: the requests whose KV each node reserves;
        ``build``: a source tree of another meshnode to run (harness/builds.py), with this one's
        dependencies."""
        state = self.tmp / host.name
        state.mkdir(exist_ok=True)
        if self.seed is not None and not (state / "compute.json").exists():
            shutil.copy(self.seed / "compute.json", state / "compute.json")
        # budgets here are fractions of profile.total_bytes(max_context, kv_requests)
        args = node_argv(
            model or self.model,
            http_port=HTTP,
            grpc_port=GRPC,
            node_id=host.name,
            budget=budget,
            state_dir=state,
            max_context=self.max_context,
            cache_dir=state / "cache",
            kv_requests=kv_requests,
            peers=peers,
            mdns=mdns,
            stage_delays=stage_delays,
            drafts=drafts,
        )
        # Planning around slow nodes is off unless a test turns it on: the suite's nodes share two
        # cores with each other and with other tests, so each of them is slow now and then.
        # So is watching the machine's free memory: their budgets stand for machines other than this one.
        env = {
            **os.environ,
            "MESHNODE_CLUSTER_KEY": key,
            "MESHNODE_SLOW_FACTOR": "0",
            "MESHNODE_MEMORY_MARGIN": "0",
            **(env or {}),
        }
        if build is not None:  # `python -m` puts its working folder first on the path
            env["PYTHONPATH"] = str(build)
        self.procs[host.name] = host.popen(args, env=env, log_path=self.log_path(host), cwd=build)

    def start_all_delayable(self, budget, env=None) -> dict[str, Path]:
        """Start a node on every host, each reading its injected stage delays and faults from its
        own file (harness/faults.py), empty for now; returns those files by host name (write JSON
        into one to change its node)."""
        delays = {}
        for h in self.hosts:
            (self.tmp / h.name).mkdir(exist_ok=True)
            delays[h.name] = self.tmp / h.name / "delay.json"
            delays[h.name].write_text("{}")
            self.start(h, budget, env=env, stage_delays=delays[h.name])
        return delays

    def log_path(self, host) -> Path:
        return self.tmp / host.name / "node.log"

    def log(self, host) -> str:
        """What ``host``'s node has logged so far ("" before it starts)."""
        path = self.log_path(host)
        return path.read_text() if path.exists() else ""

    def host(self, name):
        return next(h for h in self.hosts if h.name == name)

    def fetch(self, url, body=None, timeout=10.0):
        return fetch(self.client, url, body, timeout)

    def mesh_view(self, host):
        return mesh_view(f"http://{host.ip}:{HTTP}", self.client)

    def wait(self, predicate, timeout, what):
        return wait_until(predicate, timeout, what, details=self.logs)

    def converged(self, hosts, nodes, stages: int | None = None):
        """The views of ``hosts`` when all see ``nodes`` nodes, one coordinator, one epoch and one
        plan under it (of ``stages`` stages, if given), and are healthy; else None. ``stages`` waits
        out a plan made before the last node joined (a join rebalances a moment later)."""
        views = [self.mesh_view(h) for h in hosts]
        ok = (
            (stages is None or bool(views[0]["plan"]) and len(views[0]["plan"]["stages"]) == stages)
            and len({v["epoch"] for v in views}) == 1
            and len({v["coordinator"] for v in views}) == 1
            and len({json.dumps(v["plan"] and v["plan"]["stages"]) for v in views}) == 1
            and all(v["healthy"] for v in views)
            and all(len(v["nodes"]) == nodes for v in views)
        )
        return views if ok else None

    def chat(self, host, messages, max_tokens: int, timeout: float = 60.0) -> str:
        body = {"model": self.model.name, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        status, _, out = self.fetch(f"http://{host.ip}:{HTTP}/v1/chat/completions", body, timeout=timeout)
        assert status == 200, out
        return out["choices"][0]["message"]["content"]

    def stream(
        self, host, messages, max_tokens: int, *, model: str | None = None, timeout: float = 120, **sampling
    ) -> subprocess.Popen:
        """A streamed chat completion from the client; prints one JSON line per SSE event.
        Greedy unless ``sampling`` says otherwise (``temperature=0.8, seed=7``); ``model``: its id
        (default: the cluster's model); ``timeout``: seconds the client waits for a line."""
        body = json.dumps(
            {
                "model": model or self.model.name,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                **sampling,
                "stream": True,
            }
        )
        code = (
            "import sys,urllib.request\n"
            "req=urllib.request.Request(sys.argv[1],data=sys.argv[2].encode(),"
            "headers={'Content-Type':'application/json'})\n"
            f"for line in urllib.request.urlopen(req,timeout={timeout}):\n"
            "  line=line.strip()\n"
            "  if line: print(line.decode(),flush=True)\n"
        )
        return subprocess.Popen(
            self.client.exec_args([sys.executable, "-c", code, f"http://{host.ip}:{HTTP}/v1/chat/completions", body]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def load(self, host, messages, max_tokens: int, seconds: float) -> subprocess.Popen:
        """Sequential chat requests to ``host`` for ``seconds``; one JSON line per request:
        ["ok", text, s] | [status, Retry-After, s] | ["hung", None, s] | ["lost", error, s]."""
        body = json.dumps({"model": self.model.name, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
        return subprocess.Popen(
            self.client.exec_args(
                [sys.executable, "-c", _LOAD, f"http://{host.ip}:{HTTP}/v1/chat/completions", body, str(seconds)]
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def logs(self):
        """The end of each node's log for a failure message, without the access lines of the
        harness's own polling (GET /v1/mesh every fraction of a second would fill it)."""

        def tail(p):
            lines = [
                line
                for line in p.read_text(errors="replace").splitlines(keepends=True)
                if not ("meshnode.access: GET /v1/mesh " in line or "meshnode.access: GET /health " in line)
            ]
            return "".join(lines)[-4000:]

        return "\n".join(f"--- {p}\n{tail(p)}" for p in sorted(self.tmp.glob("*/node.log")))


def node_view(view: dict, node_id: str) -> dict:
    """One node's entry in a /v1/mesh view's ``nodes``."""
    return next(n for n in view["nodes"] if n["node_id"] == node_id)


def stage_nodes(view: dict) -> list[str]:
    """The first node of each stage of a /v1/mesh view's plan, in stage order (the last: the head)."""
    return [s["nodes"][0] for s in view["plan"]["stages"]]


def read_stream(proc, fault=None, after_chunks=10, timeout=90):
    """Collect the streamed text; call ``fault()`` once ``after_chunks`` content chunks arrived."""
    text, chunks, done, error = "", 0, False, None
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        line = line.strip()
        assert time.monotonic() < deadline, "stream hung"
        if line == "data: [DONE]":
            done = True
            break
        if line.startswith(":"):  # a keep-alive comment
            continue
        event = json.loads(line[6:])
        if "error" in event:
            error = event["error"]
            continue
        for choice in event["choices"]:
            piece = choice["delta"].get("content")
            if piece:
                text += piece
                chunks += 1
                if fault is not None and chunks == after_chunks:
                    fault()
                    fault = None
    proc.wait(10)
    assert error is None, error
    assert done, f"stream ended without [DONE]: {proc.stderr.read()[-2000:]}"
    return text, fault is None


# mlx_lm.server under the BLAS meshnode.blas loads (the nodes' own): argv after the script are its own
_MLX_LM_SERVER = r"""
import runpy, sys
from meshnode import blas
blas.use_fast_blas()
sys.argv = ["mlx_lm.server", *sys.argv[1:]]
runpy.run_module("mlx_lm.server", run_name="__main__")
"""


def mlx_lm_server_argv(model: Path, port: int) -> list[str]:
    """The argv of ``mlx_lm.server`` serving ``model`` on loopback ``port``, computing its matmuls
    on the BLAS the nodes use (``MESHNODE_BLAS``)."""
    return [sys.executable, "-c", _MLX_LM_SERVER, "--model", str(model), "--port", str(port)]


def mlx_reference(model: Path, messages: list[dict], max_tokens: int) -> str:
    """What ``mlx_lm.generate`` (greedy) makes of the chat on the whole model: what a mesh must match."""
    from mlx_lm import generate, load

    m, tok = load(str(model))
    return generate(m, tok, prompt=tok.apply_chat_template(messages, add_generation_prompt=True), max_tokens=max_tokens)
