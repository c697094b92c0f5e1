"""The openai and anthropic SDKs' own resource tests (tests/conformance.py) against one node serving
the real model (tests/realmodel.py): every case of the routes meshnode serves passes, but those
tests/conformance_excluded.toml names with their reasons.

The node caps max_tokens at 16: the generated tests check only an answer's shape, and leave
max_tokens unset or ask for 1,024 tokens.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import urllib.request
from pathlib import Path

import pytest

from tests.conformance import SUITES, Suite, fetch, problems, run
from tests.helpers import running_node

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def node(smollm2, tmp_path_factory):
    """(base URL, served model id) of one node on the real model."""
    _, folder = smollm2
    tmp = tmp_path_factory.mktemp("node")
    with running_node(folder, tmp, max_tokens_limit=MAX_TOKENS, default_max_tokens=MAX_TOKENS) as (_, base):
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
            (model,) = [m["id"] for m in json.load(r)["data"]]
        yield base, model


def suite_folder(suite: Suite) -> Path:
    """The suite's unpacked sdist, or a skip that says why it cannot be had."""
    try:
        return fetch(suite)
    except (OSError, subprocess.SubprocessError, StopIteration, tarfile.TarError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"{suite.name} cannot be had from the package registry: {exc} {detail[-300:]!r}")


@pytest.mark.parametrize("name", SUITES)
def test_the_sdks_own_suite_passes_against_one_node(name, node, tmp_path):
    suite, folder = SUITES[name], suite_folder(SUITES[name])
    base, model = node
    url = base + "/v1" if name == "openai" else base
    result = run(suite, folder, url, model, tmp_path / "report.jsonl")
    found = problems(name, suite, folder, result)
    assert not found, "\n".join(found)
