"""A pytest plugin for an SDK's own suite run against a node (tests/conformance.py loads it with
``-p meshnode_suite``): every request the SDK builds names the model the node serves.

The generated tests pass literal model names ("gpt-4o", "claude-sonnet-4-5"); the node answers an
unknown one with 404, as the contracts say. The SDK's ``_build_request`` is wrapped, so the request
body's ``model`` and the id in ``/models/{id}`` become ``MESHNODE_SUITE_MODEL`` while the test and
the SDK's own checks stay as written.
"""

from __future__ import annotations

import importlib
import json
import os
import re

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


def _report(line: dict) -> None:
    if path := os.environ.get("MESHNODE_SUITE_REPORT"):
        with open(path, "a") as out:
            out.write(json.dumps(line) + "\n")


def pytest_collection_finish(session):
    _report({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report):
    message = report.longrepr.reprcrash.message if report.failed and hasattr(report.longrepr, "reprcrash") else ""
    outcome = "failed" if report.failed else "skipped" if report.skipped else "passed"
    if report.when == "call" or outcome != "passed":
        _report({"case": report.nodeid, "outcome": outcome, "message": message[:500]})
