"""The openai and anthropic SDKs' own resource tests and llama.cpp's server tests (tests/conformance.py)
against one node serving the real model (tests/realmodel.py): every case of the routes meshnode
serves passes, but those tests/conformance_excluded.toml names with their reasons; and the same
through 2 pipeline stages on namespace hosts, the suite run from the client host.

The node caps max_tokens at 4: the generated tests check only an answer's shape, and leave
max_tokens unset or ask for 1,024 tokens; llama.cpp's cases that count the tokens of an answer
check stories260K's text too, and are left out. The suites hold the node to the APIs' shapes, not
to mlx-lm's tokens: the nodes serve the model's weights in float32 on OpenBLAS, which computes
several times faster on this CPU than the Q4_1 file does (tests/test_real_model*.py hold that file
to mlx-lm).
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import urllib.request
from pathlib import Path

import pytest

from harness.cluster import wait_mesh
from tests.conformance import SUITES, Suite, fetch, problems, run
from tests.helpers import clean_env, meshnode_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_TOKENS = 4
# A node's settings here: OpenBLAS under the float32 weights, answers capped at MAX_TOKENS.
ENV = {
    "MESHNODE_BLAS": "auto",
    "MESHNODE_MAX_TOKENS_LIMIT": str(MAX_TOKENS),
    "MESHNODE_DEFAULT_MAX_TOKENS": str(MAX_TOKENS),
}


@pytest.fixture(scope="module")
def node(smollm2_float32, tmp_path_factory):
    """(base URL, served model id) of one ``meshnode run`` on the real model."""
    tmp = tmp_path_factory.mktemp("node")
    with meshnode_run(tmp, {**clean_env(), **ENV}, model=smollm2_float32, http_port=0, grpc_port=0) as (_, port, log):
        base = f"http://127.0.0.1:{port}"
        wait_mesh(
            base, lambda v: v["healthy"], timeout=120, what="the node serving", details=lambda: log.read_text()[-3000:]
        )
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


@pytest.fixture(scope="module")
def stages(smollm2_float32, tmp_path_factory):
    """(client host, base URL, served model id) of 2 pipeline stages on namespace hosts."""
    from harness.cluster import HTTP, Cluster
    from harness.netns import netns_mesh
    from tests.realmodel import serve, stop_all

    folder = smollm2_float32
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, folder, tmp_path_factory.mktemp("cluster"), max_context=1024)
        try:
            view = serve(cluster, folder, folder, tmp_path_factory.mktemp("stages"), (0.75, 0.75), env=ENV)
            assert len(view["plan"]["stages"]) == 2, view["plan"]
            base = f"http://{cluster.hosts[0].ip}:{HTTP}"
            status, _, models = cluster.fetch(f"{base}/v1/models")
            assert status == 200, models
            (model,) = [m["id"] for m in models["data"]]
            yield cluster.client, base, model
        finally:
            stop_all(cluster)


@pytest.mark.netns
@pytest.mark.parametrize("name", SUITES)
def test_the_sdks_own_suite_passes_against_two_stages(name, stages, tmp_path):
    suite, folder = SUITES[name], suite_folder(SUITES[name])
    client, base, model = stages
    url = base + "/v1" if name == "openai" else base
    result = run(suite, folder, url, model, tmp_path / "report.jsonl", host=client)
    found = problems(name, suite, folder, result)
    assert not found, "\n".join(found)
