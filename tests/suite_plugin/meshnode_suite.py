"""A pytest plugin for another project's suite run against a node (tests/conformance.py loads it
with ``-p meshnode_suite``): every request the suite builds names the model the node serves.

The generated tests pass literal model names ("gpt-4o", "claude-sonnet-4-5"); the node answers an
unknown one with 404, as the contracts say. The SDK's ``_build_request`` is wrapped, so the request
body's ``model`` and the id in ``/models/{id}`` become ``MESHNODE_SUITE_MODEL`` while the test and
the SDK's own checks stay as written.

llama.cpp's server tests drive one ``utils.ServerProcess`` (with ``DEBUG_EXTERNAL`` it starts no
server): it is pointed at ``MESHNODE_SUITE_HOST``/``MESHNODE_SUITE_PORT``, its alias is the served
model, and its requests to the OpenAI routes llama-server also serves without ``/v1`` go to
``/v1``, naming the served model (llama-server has one and lets a request leave it out).
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import os
import re

import pytest

MODEL = os.environ["MESHNODE_SUITE_MODEL"]
MODEL_PATH = re.compile(r"(/models/)[^/]+$")


def _rewritten(options):
    data = options.json_data
    if isinstance(data, dict) and isinstance(data.get("model"), str):
        options = options.model_copy(update={"json_data": {**data, "model": MODEL}})
    if isinstance(options.url, str) and MODEL_PATH.search(options.url):
        options = options.model_copy(update={"url": MODEL_PATH.sub(rf"\g<1>{MODEL}", options.url)})
    return options


def _wrap(module_name: str) -> None:
    try:
        base = importlib.import_module(module_name).BaseClient
    except ImportError:  # the other SDK's suite
        return
    build = base._build_request

    def _build_request(self, options, *args, **kwargs):
        return build(self, _rewritten(options), *args, **kwargs)

    base._build_request = _build_request


for _name in ("openai._base_client", "anthropic._base_client"):
    _wrap(_name)

# llama-server's aliases of the OpenAI routes, which the contract has under /v1 (its /completions is
# its own /completion, not OpenAI's)
V1_ALIASES = {f"/{route}": f"/v1/{route}" for route in ("chat/completions", "models", "responses")}
NAMED = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")


def _to_node(path, data):
    path = V1_ALIASES.get(path, path)
    if isinstance(data, dict) and path in NAMED:
        data = {**data, "model": MODEL}
    return path, data


def _wrap_llama_server() -> None:
    try:
        server = importlib.import_module("utils").ServerProcess
    except ImportError:  # an SDK's suite
        return
    init, begin = server.__init__, server.start
    request, stream = server.make_request, server.make_stream_request

    def __init__(self):
        init(self)
        self.server_host = os.environ["MESHNODE_SUITE_HOST"]
        self.server_port = int(os.environ["MESHNODE_SUITE_PORT"])

    def start(self, *args, **kwargs):
        self.server_host = os.environ["MESHNODE_SUITE_HOST"]
        self.model_alias = MODEL
        return begin(self, *args, **kwargs)

    def make_request(self, method, path, data=None, *args, **kwargs):
        return request(self, method, *_to_node(path, data), *args, **kwargs)

    def make_stream_request(self, method, path, data=None, *args, **kwargs):
        return stream(self, method, *_to_node(path, data), *args, **kwargs)

    server.__init__, server.start = __init__, start
    server.make_request, server.make_stream_request = make_request, make_stream_request


def pytest_configure(config):
    if os.environ.get("DEBUG_EXTERNAL"):
        _wrap_llama_server()


def _report(line: dict) -> None:
    if path := os.environ.get("MESHNODE_SUITE_REPORT"):
        with open(path, "a") as out:
            out.write(json.dumps(line) + "\n")


def _left_out(nodeid: str, pattern: str, params: list[str]) -> bool:
    # tests/conformance.py's LeftOut.covers
    bare, _, param = nodeid.partition("[")
    chosen = not params or any(fnmatch.fnmatchcase(param[:-1], p) for p in params)
    return fnmatch.fnmatchcase(bare, pattern) and chosen


def pytest_collection_modifyitems(config, items):
    # the cases tests/conformance.py says to leave out unrun, where a run would cost time for nothing
    left_out = json.loads(os.environ.get("MESHNODE_SUITE_UNRUN") or "[]")  # [pattern, params] each
    for item in items:
        if any(_left_out(item.nodeid, pattern, params) for pattern, params in left_out):
            item.add_marker(pytest.mark.skip(reason="left out: tests/conformance_excluded.toml"))


def pytest_collection_finish(session):
    _report({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report):
    message = report.longrepr.reprcrash.message if report.failed and hasattr(report.longrepr, "reprcrash") else ""
    outcome = "failed" if report.failed else "skipped" if report.skipped else "passed"
    if report.when == "call" or outcome != "passed":
        _report({"case": report.nodeid, "outcome": outcome, "message": message[:500]})
