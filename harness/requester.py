"""HTTP requests made from inside a namespace host, by one long-lived Python process per host.

Starting a Python process for each request costs tens of milliseconds of CPU, and the tests poll
nodes several times a second while the nodes they poll share the same two cores. So each host
that makes requests runs one ``requester`` process; a request is one JSON line to its stdin, and
the answer one line back, tagged with the request's number (requests run at once, a thread each).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import traceback
import urllib.error
import urllib.request
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout


def answer(url: str, body: str, timeout: float) -> list:
    """``["ok", [status, headers, JSON body]]`` (an HTTP error status included), or ``["error",
    the exception's last traceback line]`` when no answer came (refused, timed out, not JSON)."""
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url, data=body.encode() if body else None, headers=headers)
    try:
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return ["ok", [r.status, dict(r.headers), json.loads(r.read())]]
        except urllib.error.HTTPError as e:
            return ["ok", [e.code, dict(e.headers), json.loads(e.read())]]
    except Exception as exc:  # noqa: BLE001 - any failure goes back as an answer: the caller's OSError
        return ["error", traceback.format_exception_only(exc)[-1].strip()]


def _value(kind: str, value):
    """The answer's value from ``answer``'s ``[kind, value]``; OSError when it is an error."""
    if kind != "ok":
        raise OSError(value)
    return value


# The requester: reads [id, url, body, timeout] lines; writes [id, kind, value] lines.
_REQUESTER = (
    "import json,sys,threading\n"
    "from harness.requester import answer\n"
    "lock=threading.Lock()\n"
    "def one(i,url,body,t):\n"
    "  out=json.dumps([i,*answer(url,body,t)])\n"
    "  with lock: sys.stdout.write(out+'\\n'); sys.stdout.flush()\n"
    "for line in sys.stdin:\n"
    "  threading.Thread(target=one,args=json.loads(line),daemon=True).start()\n"
)


class Requester:
    """One host's requester process, started on first use and again if it has exited."""

    def __init__(self, host) -> None:
        self.host = host
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.pending: dict[int, Future] = {}
        self.proc = None

    def _start(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = self.host.popen(
            [sys.executable, "-c", _REQUESTER],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            i, kind, value = json.loads(line)
            with self.lock:
                future = self.pending.pop(i, None)
            if future is not None:
                future.set_result((kind, value))
        with self.lock:
            gone, self.pending = self.pending, {}
        for future in gone.values():
            future.set_result(("error", f"the requester in {self.host.name} exited ({proc.wait()})"))

    def fetch(self, url: str, body: str, timeout: float) -> list:
        future: Future = Future()
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            i = next(self.ids)
            self.pending[i] = future
            try:
                self.proc.stdin.write(json.dumps([i, url, body, timeout]) + "\n")
                self.proc.stdin.flush()
            except OSError as exc:
                self.pending.pop(i, None)
                raise OSError(f"the requester in {self.host.name} is gone: {exc}") from None
        try:
            kind, value = future.result(timeout + 10)
        except FutureTimeout:
            raise OSError(f"no answer from {url} within {timeout + 10} s") from None
        return _value(kind, value)


_requesters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_made = threading.Lock()


def request(client, url: str, body: str, timeout: float) -> list:
    """``[status, headers, JSON body]`` of one request from ``client`` (a ``NetHost``; None: from
    here); OSError if no answer came."""
    if client is None:
        return _value(*answer(url, body, timeout))
    with _made:
        requester = _requesters.get(client)
        if requester is None:
            requester = _requesters[client] = Requester(client)
    return requester.fetch(url, body, timeout)
