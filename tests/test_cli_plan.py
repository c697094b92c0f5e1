"""`meshnode plan`: a dry run over a described cluster (TOML) or a live node's /v1/mesh."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from meshnode import cli
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("plan") / "llama", "llama", num_layers=6, num_heads=4, num_kv_heads=2)


def write(tmp_path, text):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return str(path)


FAST_PAIR = """
[[node]]
id = "a"
memory = "1GiB"
layer_ms = 5.0
[[node]]
id = "b"
memory = "1GiB"
layer_ms = 5.0
[[link]]
a = "a"
b = "b"
rtt_us = 20
bandwidth = "2GB/s"
"""


def test_fast_pair_gets_a_tensor_plan_with_alternatives(model, tmp_path, capsys):
    assert cli.main(["plan", "--model", str(model), "--cluster", write(tmp_path, FAST_PAIR)]) == 0
    out = capsys.readouterr().out
    assert "plan         tensor, est." in out and "layers 0-5  on a+b" in out
    assert "alternatives" in out and "single" in out and "pipeline" in out and "tok/s" in out
    assert "why          tensor over 0-5@a+b" in out and "20 µs RTT" in out
    assert "memory       a " in out and "of 1.0 GiB" in out

    assert cli.main(["plan", "--model", str(model), "--cluster", write(tmp_path, FAST_PAIR), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["strategy"] == "tensor" and data["estimate_s"] > 0
    assert {a["strategy"] for a in data["alternatives"]} == {"single", "pipeline", "hybrid"}
    assert all(a["estimate_s"] >= data["estimate_s"] for a in data["alternatives"] if a["feasible"])


def test_slow_link_and_forced_strategies(model, tmp_path, capsys):
    slow = FAST_PAIR.replace("rtt_us = 20", "rtt_us = 5000")
    assert cli.main(["plan", "--model", str(model), "--cluster", write(tmp_path, slow)]) == 0
    assert "plan         single" in capsys.readouterr().out
    assert cli.main(["plan", "--model", str(model), "--cluster", write(tmp_path, slow), "--strategy", "pipeline"]) == 0
    assert "plan         pipeline" in capsys.readouterr().out
    # impossible: exit 1 with the reasons
    assert cli.main(["plan", "--model", str(model), "--cluster", write(tmp_path, slow), "--strategy", "hybrid"]) == 1
    assert "hybrid: needs at least three nodes" in capsys.readouterr().out
    tiny = FAST_PAIR.replace('"1GiB"', '"1KiB"')
    assert cli.main(["plan", "--model", str(model), "--cluster", write(tmp_path, tiny), "--json"]) == 1
    assert "short by" in " ".join(json.loads(capsys.readouterr().out)["error"])


def test_bad_inputs_exit_one(model, tmp_path, capsys):
    assert cli.main(["plan", "--model", str(tmp_path / "nope"), "--cluster", write(tmp_path, FAST_PAIR)]) == 1
    assert "cannot read the model" in capsys.readouterr().err
    assert cli.main(["plan", "--model", str(model), "--cluster", write(tmp_path, "[[node]]\nid = 'x'\n")]) == 1
    assert "node 1 needs id and memory" in capsys.readouterr().err


def test_example_cluster_file_plans(model, capsys):
    assert cli.main(["plan", "--model", str(model), "--cluster", str(ROOT / "configs" / "example-cluster.toml")]) == 0
    assert "plan         " in capsys.readouterr().out


def test_live_mesh(model, capsys):
    profile = profile_model(model)
    need = profile.total_bytes(4096, requests=2)  # what `meshnode plan` reserves by default, as a node
    mesh = {
        "nodes": [
            {
                "node_id": "a",
                "memory_budget": need // 2 + need // 4,
                "layer_seconds": 0.002,
                "links": [
                    {"peer": "b", "address": "198.18.0.2", "rtt_us": 900.0, "jitter_us": 5.0, "bandwidth": 1e8},
                    {"peer": "b", "address": "198.19.0.2", "rtt_us": 15.0, "jitter_us": 1.0, "bandwidth": 2e9},
                ],
            },
            {"node_id": "b", "memory_budget": need // 2 + need // 4, "layer_seconds": 0.002, "links": []},
        ]
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(mesh).encode() if self.path == "/v1/mesh" else b"{}"
            self.send_response(200 if self.path == "/v1/mesh" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert cli.main(["plan", "--model", str(model), "--url", url]) == 0
        out = capsys.readouterr().out
        # neither node holds it alone; the fastest path between them (15 µs, 16 at p95) makes a tensor pair pay
        assert "plan         tensor" in out and "16 µs RTT at p95" in out
        assert "single" in out and "impossible" in out
    finally:
        server.shutdown()
        server.server_close()


def test_a_links_spread_is_shown_and_costed(model, tmp_path, capsys):
    """A link's p90 - p10 spread (``jitter_us``) is costed at the p95 round trip, shown beside the median."""
    jittery = FAST_PAIR.replace("rtt_us = 20", "rtt_us = 20\njitter_us = 5000")
    assert cli.main(["plan", "--model", str(model), "--cluster", write(tmp_path, jittery)]) == 0
    out = capsys.readouterr().out
    assert "links (costed at p95)\n  a-b  round trip 0.02 ms, p95 3.22 ms, 2,000 MB/s" in out, out
    assert "plan         single" in out  # a wandering link makes splitting not pay, as a slow one does
