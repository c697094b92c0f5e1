"""`meshnode status` against a real `meshnode run` on loopback: the text for a person, --json,
and the exit status, for a healthy node, one that cannot serve, and one found by its config file.
(Peers that mDNS announces but that do not answer: tests/test_reachability.py, on namespace hosts.)
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from harness.cluster import wait_until
from meshnode.model.build import build_model
from tests.helpers import clean_env as _env
from tests.helpers import meshnode_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(
        tmp_path_factory.mktemp("status") / "llama",
        "llama",
        num_layers=4,
        hidden_size=64,
        intermediate_size=128,
        dtype="float32",
    )


def status(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "meshnode.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env or _env(),
    )
    return out.returncode, out.stdout, out.stderr


def test_status_of_a_healthy_node(model, tmp_path):
    with meshnode_run(tmp_path, model=model, http_port=0, grpc_port=0, budget="1GiB") as (node_id, port, _):
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: status("--url", url)[0] == 0, 30, "the node to become healthy")
        rc, out, err = status("--url", url)
        assert rc == 0, out + err
        lines = out.splitlines()
        assert lines[0].startswith(f"node         {node_id}  (meshnode ") and lines[0].endswith(", healthy)")
        assert "health       ok: serving, every peer answers" in lines
        assert f"coordinator  {node_id}" in lines and "model        llama" in lines
        assert any(line.startswith("plan         single, epoch 1") for line in lines), out
        assert f"  layers 0–3 on node {node_id}" in lines
        assert "nodes        1" in lines
        assert any(
            line.startswith(f"  {node_id}  127.0.0.1:{port}  offers 1.0 GiB of ")
            and line.endswith("[this node, coordinator]")
            for line in lines
        ), out
        assert "hint" not in out and err == ""

        rc, out, _ = status("--url", url, "--json")
        data = json.loads(out)
        assert rc == 0
        assert data["node_id"] == node_id and data["healthy"] is True and data["unreachable"] == []
        assert data["plan"]["stages"] == [
            {**data["plan"]["stages"][0], "start_layer": 0, "end_layer": 4, "nodes": [node_id]}
        ]


def test_status_of_a_node_that_cannot_serve(model, tmp_path):
    """A budget the model does not fit in: the node runs and answers, but serves nothing."""
    with meshnode_run(tmp_path, model=model, http_port=0, grpc_port=0, budget="64KiB") as (node_id, port, _):
        url = f"http://127.0.0.1:{port}"
        data = wait_until(
            lambda: (d := json.loads(status("--url", url, "--json")[1])).get("plan_error") and d,
            30,
            "the node to find that the model does not fit",
        )
        assert data["healthy"] is False and data["plan"] is None
        assert status("--url", url, "--json")[0] == 1
        rc, out, _ = status("--url", url)
        assert rc == 1
        assert f"node         {node_id}  (meshnode " in out and "NOT healthy" in out
        assert "health       not serving: the model does not fit on the nodes available" in out
        assert "plan         (none)" in out


def test_status_finds_the_node_by_its_config_file(model, tmp_path):
    """As after `meshnode install`: the config names the port and an API key; status reads both."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "meshnode.toml"
    config.write_text(
        f'model = "{model}"\nhttp_port = {port}\napi_key = "status-test-key"\n'
        f'cluster_key = "a-cluster-key-for-this-test"\nmemory_budget = "1GiB"\n'
    )
    config.chmod(0o600)
    with meshnode_run(tmp_path, config=config, grpc_port=0) as (node_id, up_port, _):
        assert up_port == port
        wait_until(lambda: status("--config", str(config))[0] == 0, 30, "the node to become healthy")
        rc, out, _ = status("--config", str(config))
        assert rc == 0 and f"node         {node_id}" in out
        rc, _, err = status("--url", f"http://127.0.0.1:{port}")  # without the key
        assert rc == 1 and "wants an API key" in err
        rc, out, _ = status(env={**_env(), "MESHNODE_CONFIG": str(config)})  # the service's way
        assert rc == 0 and f"node         {node_id}" in out
