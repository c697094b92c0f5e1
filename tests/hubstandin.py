"""A local stand-in for the Hugging Face Hub, serving model folders to huggingface_hub.

It answers what huggingface_hub 2.x asks for a model repository (point it here with
``HF_ENDPOINT=http://<host>:<port>``, ``HF_HUB_DISABLE_XET=1``):

* ``GET /api/models/<owner>/<name>[/revision/<rev>]``: the model info (``sha``, ``siblings``);
* ``GET /api/models/<owner>/<name>/tree/<rev>[/<path>]``: the file listing, safetensors files as
  LFS files (``lfs.oid`` = their sha256), the others with their git blob id;
* ``HEAD``/``GET /<owner>/<name>/resolve/<rev>/<path>``: the file, with ``X-Repo-Commit``,
  ``ETag`` (``X-Linked-Etag``/``X-Linked-Size`` for LFS files), ``Content-Length``, and
  ``Range`` requests (206 with ``Content-Range``).

Every request is recorded (method, path, Range header, body bytes sent). ``cut_once`` names files
whose next full-body GET is cut off halfway (the connection closes after half the promised bytes),
to test that a download resumes. Runs in a thread of the test (``with HubStandIn(...) as hub``) or
as a process (``python -m tests.hubstandin --host IP --port N owner/name=DIR``), e.g. inside a
network namespace; the process prints ``ready <port>`` once it listens and writes its request log
as JSON lines to ``--log``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from aiohttp import web

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    sent: int = 0  # body bytes sent
    status: int = 0  # -1: the body was cut off
    remote: str = ""  # the client's address


class _Repo:
    def __init__(self, repo_id: str, folder: Path):
        self.repo_id = repo_id
        self.folder = Path(folder)
        self.files: dict[str, dict] = {}
        for p in sorted(self.folder.rglob("*")):
            rel = p.relative_to(self.folder).as_posix()
            if not p.is_file() or any(part.startswith(".") for part in rel.split("/")):
                continue
            data = p.read_bytes()
            info = {
                "size": len(data),
                "blob": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                "sha256": hashlib.sha256(data).hexdigest(),
                "lfs": rel.endswith(".safetensors"),
            }
            self.files[rel] = info
        self.commit = hashlib.sha1(
            json.dumps(sorted((k, v["sha256"]) for k, v in self.files.items())).encode()
        ).hexdigest()

    def etag(self, rel: str) -> str:
        info = self.files[rel]
        return info["sha256"] if info["lfs"] else info["blob"]


class HubStandIn:
    """A loopback (or namespace) HTTP server that plays the Hub for ``repos`` (id -> folder)."""

    def __init__(self, repos: dict[str, Path], host: str = "127.0.0.1", port: int = 0, log_path: Path | None = None):
        self.repos = {k: _Repo(k, v) for k, v in repos.items()}
        self.host, self.port = host, port
        self.requests: list[Request] = []
        self.cut_once: set[str] = set()
        self.log_path = log_path
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ serving
    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("GET", r"/api/models/{owner}/{name}/revision/{rev}", self._info)
        app.router.add_route("GET", r"/api/models/{owner}/{name}", self._info)
        app.router.add_route("GET", r"/api/models/{owner}/{name}/tree/{rev}", self._tree)
        app.router.add_route("GET", r"/api/models/{owner}/{name}/tree/{rev}/{path:.+}", self._tree)
        app.router.add_route("HEAD", r"/{owner}/{name}/resolve/{rev}/{path:.+}", self._resolve)
        app.router.add_route("GET", r"/{owner}/{name}/resolve/{rev}/{path:.+}", self._resolve)
        app.router.add_route("*", r"/{tail:.*}", self._unknown)
        return app

    def _record(self, request: web.Request) -> Request:
        rec = Request(request.method, request.path, request.headers.get("Range"), remote=request.remote or "")
        with self._lock:
            self.requests.append(rec)
        return rec

    def _flush(self, rec: Request) -> None:
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(asdict(rec)) + "\n")

    def _repo(self, request: web.Request) -> _Repo:
        repo = self.repos.get(f"{request.match_info['owner']}/{request.match_info['name']}")
        if repo is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"}, text="Repository not found")
        rev = request.match_info.get("rev")
        if rev is not None and rev not in ("main", repo.commit):
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"}, text="Revision not found")
        return repo

    async def _info(self, request: web.Request) -> web.Response:
        rec = self._record(request)
        repo = self._repo(request)
        body = {
            "_id": repo.commit[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": repo.commit,
            "private": False,
            "disabled": False,
            "gated": False,
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "siblings": [{"rfilename": rel} for rel in repo.files],
        }
        rec.status = 200
        self._flush(rec)
        return web.json_response(body)

    async def _tree(self, request: web.Request) -> web.Response:
        rec = self._record(request)
        repo = self._repo(request)
        prefix = request.match_info.get("path", "").strip("/")
        out = []
        for rel, info in repo.files.items():
            if prefix and not rel.startswith(prefix + "/"):
                continue
            entry = {"type": "file", "oid": info["blob"], "size": info["size"], "path": rel}
            if info["lfs"]:
                entry["lfs"] = {"oid": info["sha256"], "size": info["size"], "pointerSize": 134}
            out.append(entry)
        rec.status = 200
        self._flush(rec)
        return web.json_response(out)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        rec = self._record(request)
        repo = self._repo(request)
        rel = request.match_info["path"]
        if rel not in repo.files:
            rec.status = 404
            self._flush(rec)
            raise web.HTTPNotFound(
                headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit}, text="Entry not found"
            )
        info = repo.files[rel]
        size = info["size"]
        headers = {
            "X-Repo-Commit": repo.commit,
            "ETag": f'"{repo.etag(rel)}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if info["lfs"]:
            headers["X-Linked-Etag"] = f'"{info["sha256"]}"'
            headers["X-Linked-Size"] = str(size)
        first, last = 0, size - 1
        status = 200
        if rec.range:
            m = _RANGE.match(rec.range.strip())
            if m is None or (not m.group(1) and not m.group(2)):
                raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
            if m.group(1):
                first = int(m.group(1))
                last = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            else:  # a suffix: the last n bytes
                first = max(size - int(m.group(2)), 0)
            if first > last or first >= size:
                raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        length = last - first + 1
        headers["Content-Length"] = str(length)
        rec.status = status
        if request.method == "HEAD":
            self._flush(rec)
            return web.Response(status=status, headers=headers)
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        cut = None
        with self._lock:
            if rel in self.cut_once and first == 0 and length == size:
                self.cut_once.discard(rel)
                cut = length // 2
        with open(repo.folder / rel, "rb") as f:
            f.seek(first)
            left = length if cut is None else cut
            while left > 0:
                chunk = f.read(min(left, 256 * 1024))
                if not chunk:
                    break
                await resp.write(chunk)
                rec.sent += len(chunk)
                left -= len(chunk)
        if cut is not None:  # the promised bytes never all come: the client sees a broken body
            rec.status = -1
            self._flush(rec)
            request.transport.close()
            return resp
        self._flush(rec)
        await resp.write_eof()
        return resp

    async def _unknown(self, request: web.Request) -> web.Response:
        rec = self._record(request)
        rec.status = 404
        self._flush(rec)
        print(f"hub stand-in: unhandled {request.method} {request.path_qs}", file=sys.stderr, flush=True)
        return web.Response(status=404, text="not served by the stand-in")

    # ------------------------------------------------------------------ lifecycle
    async def serve(self) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def __enter__(self) -> HubStandIn:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self.serve())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="hub-standin", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("hub stand-in did not start")
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def gets(self, suffix: str) -> list[Request]:
        """The GET requests of files whose path ends with ``suffix``."""
        with self._lock:
            return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path and r.path.endswith(suffix)]


def hub_env(endpoint: str, hf_home: Path) -> dict[str, str]:
    """Environment pointing huggingface_hub at a stand-in, with its own cache."""
    return {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(hf_home),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log", type=Path)
    ap.add_argument("repos", nargs="+", help="owner/name=DIR")
    args = ap.parse_args()
    repos = dict(r.split("=", 1) for r in args.repos)
    hub = HubStandIn({k: Path(v) for k, v in repos.items()}, args.host, args.port, args.log)

    async def run() -> None:
        await hub.serve()
        print(f"ready {hub.port}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
