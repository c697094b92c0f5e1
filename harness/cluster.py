"""Real meshnode processes on namespace hosts, driven from a client namespace.

The test process lives outside the namespaces: every request is made from the mesh's client
host, so no packet for 198.18.x.y ever leaves through this machine's own network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HTTP, GRPC = 8470, 8471
KEY = "test-cluster-key"

_LOAD = ("import json,sys,time,urllib.request,urllib.error,socket\n"
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
         "  time.sleep(0.1)\n")


class Cluster:
    """n meshnode hosts plus a client host; every request is made from the client namespace."""

    def __init__(self, mesh, model: Path, tmp: Path, budgets=(), *, max_context: int = 512, seed: Path | None = None):
        """``seed``: a folder whose compute.json every node starts with (the same figures on every
        host, as installed nodes of one machine type have them cached, instead of each timing them
        while the others do: on shared cores those differ by 2x and plans follow them)."""
        self.mesh, self.model, self.tmp, self.max_context, self.seed = mesh, model, tmp, max_context, seed
        self.hosts = list(mesh.hosts)
        self.client = mesh.add_host("client")
        self.procs = {}
        for h, b in zip(self.hosts, budgets):
            self.start(h, b)

    def start(self, host, budget, *, key: str = KEY, peers=(), mdns: bool = True, env=None, model=None):
        """``model``: what ``--model`` names (default: the model folder); a node's own
        ``--cache-dir`` is ``<tmp>/<host>/cache``."""
        state = self.tmp / host.name
        state.mkdir(exist_ok=True)
        if self.seed is not None and not (state / "compute.json").exists():
            shutil.copy(self.seed / "compute.json", state / "compute.json")
        args = [sys.executable, "-m", "meshnode.cli", "run", "--model", str(model or self.model), "--http-port",
                str(HTTP), "--grpc-port", str(GRPC), "--node-id", host.name, "--memory-budget", str(budget),
                "--state-dir", str(state), "--max-context", str(self.max_context), "--cache-dir", str(state / "cache"),
                # budgets here are fractions of profile.total_bytes(max_context): one request's KV
                "--kv-requests", "1"]
        for p in peers:
            args += ["--peer", p]
        if not mdns:
            args.append("--no-mdns")
        self.procs[host.name] = host.popen(args, env={**os.environ, "MESHNODE_CLUSTER_KEY": key, **(env or {})},
                                           log_path=self.log_path(host))

    def log_path(self, host) -> Path:
        return self.tmp / host.name / "node.log"

    def log(self, host) -> str:
        """What ``host``'s node has logged so far ("" before it starts)."""
        path = self.log_path(host)
        return path.read_text() if path.exists() else ""

    def host(self, name):
        return next(h for h in self.hosts if h.name == name)

    def fetch(self, url, body=None, timeout=10.0):
        code = ("import json,sys,urllib.request,urllib.error\n"
                "url,body,t=sys.argv[1],sys.argv[2],float(sys.argv[3])\n"
                "req=urllib.request.Request(url,data=body.encode() if body else None,"
                "headers={'Content-Type':'application/json'})\n"
                "try:\n"
                "  r=urllib.request.urlopen(req,timeout=t); print(json.dumps([r.status,dict(r.headers),"
                "json.loads(r.read())]))\n"
                "except urllib.error.HTTPError as e:\n"
                "  print(json.dumps([e.code,dict(e.headers),json.loads(e.read())]))\n")
        out = self.client.run([sys.executable, "-c", code, url, json.dumps(body) if body else "", str(timeout)],
                              timeout=timeout + 10, check=False)
        if out.returncode != 0:
            raise OSError((out.stderr.strip().splitlines() or ["request failed"])[-1])
        return json.loads(out.stdout)

    def mesh_view(self, host):
        return self.fetch(f"http://{host.ip}:{HTTP}/v1/mesh", timeout=3)[2]

    def wait(self, predicate, timeout, what):
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                last = predicate()
                if last:
                    return last
            except OSError as exc:
                last = exc
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; last: {last!r}\n{self.logs()}")

    def converged(self, hosts, nodes):
        """The views of ``hosts`` when all see ``nodes`` nodes, one coordinator, one epoch and one
        plan under it, and are healthy; else None."""
        views = [self.mesh_view(h) for h in hosts]
        ok = (len({v["epoch"] for v in views}) == 1 and len({v["coordinator"] for v in views}) == 1
              and len({json.dumps(v["plan"] and v["plan"]["stages"]) for v in views}) == 1
              and all(v["healthy"] for v in views) and all(len(v["nodes"]) == nodes for v in views))
        return views if ok else None

    def chat(self, host, messages, max_tokens: int, timeout: float = 60.0) -> str:
        body = {"model": self.model.name, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        status, _, out = self.fetch(f"http://{host.ip}:{HTTP}/v1/chat/completions", body, timeout=timeout)
        assert status == 200, out
        return out["choices"][0]["message"]["content"]

    def stream(self, host, messages, max_tokens: int, **sampling) -> subprocess.Popen:
        """A streamed chat completion from the client; prints one JSON line per SSE event.
        Greedy unless ``sampling`` says otherwise (``temperature=0.8, seed=7``)."""
        body = json.dumps({"model": self.model.name, "messages": messages, "max_tokens": max_tokens,
                           "temperature": 0, **sampling, "stream": True})
        code = ("import sys,urllib.request\n"
                "req=urllib.request.Request(sys.argv[1],data=sys.argv[2].encode(),"
                "headers={'Content-Type':'application/json'})\n"
                "for line in urllib.request.urlopen(req,timeout=120):\n"
                "  line=line.strip()\n"
                "  if line: print(line.decode(),flush=True)\n")
        return subprocess.Popen(self.client.exec_args([sys.executable, "-c", code,
                                                       f"http://{host.ip}:{HTTP}/v1/chat/completions", body]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def load(self, host, messages, max_tokens: int, seconds: float) -> subprocess.Popen:
        """Sequential chat requests to ``host`` for ``seconds``; one JSON line per request:
        ["ok", text, s] | [status, Retry-After, s] | ["hung", None, s] | ["lost", error, s]."""
        body = json.dumps({"model": self.model.name, "messages": messages, "max_tokens": max_tokens,
                           "temperature": 0})
        return subprocess.Popen(self.client.exec_args([sys.executable, "-c", _LOAD,
                                                       f"http://{host.ip}:{HTTP}/v1/chat/completions", body,
                                                       str(seconds)]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def logs(self):
        return "\n".join(f"--- {p}\n{p.read_text()[-4000:]}" for p in sorted(self.tmp.glob("*/node.log")))


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


def mlx_reference(model: Path, messages: list[dict], max_tokens: int) -> str:
    """What ``mlx_lm.generate`` (greedy) makes of the chat on the whole model: what a mesh must match."""
    from mlx_lm import generate, load

    m, tok = load(str(model))
    return generate(m, tok, prompt=tok.apply_chat_template(messages, add_generation_prompt=True), max_tokens=max_tokens)
