"""The meshnode command line: parsing, config errors, and `meshnode status` against a canned server."""

from __future__ import annotations

import io
import json
import logging
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from meshnode import __version__, cli
from meshnode.config import Settings

MESH = {
    "node_id": "mac-studio-abc123",
    "version": "0.1.0",
    "model": "demo",
    "coordinator": "mac-mini-def456",
    "epoch": 3,
    "ready_epoch": 3,
    "healthy": True,
    "plan_error": None,
    "nodes": [
        {
            "node_id": "mac-mini-def456",
            "address": "192.168.1.20",
            "addresses": ["192.168.1.20"],
            "http_port": 8470,
            "grpc_port": 8471,
            "memory_budget": 12 * 2**30,
            "total_memory": 16 * 2**30,
            "compute": 3500.0,
            "version": "0.1.0",
            "role": "coordinator",
        },
        {
            "node_id": "mac-studio-abc123",
            "address": "192.168.1.21",
            "addresses": ["192.168.1.21"],
            "http_port": 8470,
            "grpc_port": 8471,
            "memory_budget": 48 * 2**30,
            "total_memory": 64 * 2**30,
            "compute": 9000.0,
            "version": "0.1.0",
            "role": "member",
        },
    ],
    "plan": {
        "epoch": 3,
        "model": "demo",
        "strategy": "pipeline",
        "reason": "split by memory",
        "max_context": 4096,
        "stages": [
            {"start_layer": 0, "end_layer": 6, "nodes": ["mac-mini-def456"]},
            {"start_layer": 6, "end_layer": 24, "nodes": ["mac-studio-abc123"]},
        ],
    },
    "events": [],
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in list(__import__("os").environ):
        if var.startswith("MESHNODE_"):
            monkeypatch.delenv(var)


class _Server:
    def __init__(self, body, status=200, need_key=None):
        outer = self
        self.body, self.status, self.need_key, self.paths, self.headers = body, status, need_key, [], []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.paths.append(self.path)
                outer.headers.append(dict(self.headers))
                status = outer.status
                if outer.need_key and self.headers.get("Authorization") != f"Bearer {outer.need_key}":
                    status = 401
                data = outer.body if isinstance(outer.body, bytes) else json.dumps(outer.body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(body, status=200, need_key=None):
        s = _Server(body, status, need_key)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["run", "--help"],
        ["status", "--help"],
        ["plan", "--help"],
        ["install", "--help"],
        ["uninstall", "--help"],
    ],
)
def test_help_exits_zero(argv, capsys):
    assert cli.main(argv) == 0
    assert "usage: meshnode" in capsys.readouterr().out


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out


def test_no_command_and_bad_usage(capsys):
    assert cli.main([]) == 2
    assert cli.main(["frobnicate"]) == 2
    assert cli.main(["run", "--bogus"]) == 2
    assert "error" in capsys.readouterr().err


def test_plan_needs_a_model(capsys):  # plan itself: tests/test_cli_plan.py; install, uninstall: test_service.py
    assert cli.main(["plan"]) == 2
    assert "--model" in capsys.readouterr().err


def test_run_flags_become_settings(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('http_port = 9000\nmodel = "file-model"\nlog_level = "DEBUG"\n')
    args = cli.build_parser().parse_args(
        [
            "run",
            "--config",
            str(cfg),
            "--model",
            "flag-model",
            "--grpc-port",
            "9999",
            "--node-id",
            "n1",
            "--cluster-key",
            "k3y-value",
            "--memory-budget",
            "2GiB",
            "--peer",
            "10.0.0.2:8471",
            "--peer",
            "[::1]:1",
            "--no-mdns",
            "--max-context",
            "777",
            "--host",
            "127.0.0.1",
            "--state-dir",
            str(tmp_path / "st"),
            "--strategy",
            "hybrid",
        ]
    )
    s = cli.settings_from_args(args, env={"MESHNODE_HTTP_PORT": "9100", "MESHNODE_LOG_LEVEL": "warning"})
    assert s.model == "flag-model"
    assert s.http_port == 9100  # env beats file
    assert s.grpc_port == 9999
    assert s.node_id == "n1" and s.cluster_key == "k3y-value"
    assert s.memory_budget == 2 * 1024**3
    assert s.peers == ("10.0.0.2:8471", "[::1]:1")
    assert s.mdns is False and s.max_context == 777 and s.host == "127.0.0.1"
    assert s.log_level == "WARNING"
    assert s.state_dir == tmp_path / "st"
    assert s.strategy == "hybrid"


def test_run_without_flags_keeps_lower_layers():
    args = cli.build_parser().parse_args(["run"])
    s = cli.settings_from_args(args, env={"MESHNODE_MDNS": "false", "MESHNODE_PEERS": "a:1,b:2"})
    assert s.mdns is False and s.peers == ("a:1", "b:2")
    assert cli.settings_from_args(args, env={}) == Settings()


def test_run_config_error_exits_2_without_traceback(tmp_path, capsys, monkeypatch):
    assert cli.main(["run", "--http-port", "notaport"]) == 2
    err = capsys.readouterr().err
    assert "--http-port" in err and "Traceback" not in err
    bad = tmp_path / "bad.toml"
    bad.write_text("colour = 1\n")
    assert cli.main(["run", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "colour" in err and str(bad) in err
    monkeypatch.setenv("MESHNODE_MEMORY_FRACTION", "2")
    assert cli.main(["run"]) == 2
    assert "MESHNODE_MEMORY_FRACTION" in capsys.readouterr().err


def test_run_calls_run_node_with_settings(monkeypatch, tmp_path):
    import types

    seen = {}

    def fake_run_node(settings):
        seen["settings"] = settings
        logging.getLogger("meshnode.test").info("joining with key %s", settings.cluster_key)
        return 0

    monkeypatch.setitem(sys.modules, "meshnode.node", types.SimpleNamespace(run_node=fake_run_node))
    stream = io.StringIO()
    real_setup = cli.setup_logging
    monkeypatch.setattr(cli, "setup_logging", lambda s: real_setup(s, stream=stream))
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    try:
        rc = cli.main(
            [
                "run",
                "--cluster-key",
                "super-secret-key",
                "--node-id",
                "n9",
                "--log-level",
                "debug",
                "--state-dir",
                str(tmp_path),
            ]
        )
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    assert rc == 0
    assert seen["settings"].node_id == "n9" and seen["settings"].cluster_key == "super-secret-key"
    log_text = stream.getvalue()
    assert "joining with key <redacted>" in log_text
    assert "super-secret-key" not in log_text
    assert "meshnode.test" in log_text and "INFO" in log_text


def test_console_script_entry_point_is_fast_to_import():
    # `import meshnode.cli` must not pull in mlx, grpc or aiohttp
    code = "import sys, meshnode.cli; print(any(m in sys.modules for m in ('mlx', 'grpc', 'aiohttp')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --------------------------------------------------------------------------- status


def test_status_human_summary(serve, capsys):
    srv = serve(MESH)
    assert cli.main(["status", "--url", srv.url]) == 0
    assert srv.paths == ["/v1/mesh"]
    out = capsys.readouterr().out
    assert "mac-studio-abc123" in out
    assert "coordinator  mac-mini-def456" in out
    assert "epoch        3" in out
    assert "layers 0–5 on node mac-mini-def456" in out
    assert "layers 6–23 on node mac-studio-abc123" in out
    assert "48.0 GiB" in out and "12.0 GiB" in out
    assert "healthy" in out


def test_status_json(serve, capsys):
    srv = serve(MESH)
    assert cli.main(["status", "--url", srv.url + "/", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == MESH


def test_status_unhealthy_exits_1(serve, capsys):
    srv = serve({**MESH, "healthy": False, "plan": None, "plan_error": "not enough memory"})
    assert cli.main(["status", "--url", srv.url]) == 1
    out = capsys.readouterr().out
    assert "NOT healthy" in out and "not enough memory" in out and "(none)" in out


def test_status_without_healthy_key_uses_plan(serve):
    body = {k: v for k, v in MESH.items() if k != "healthy"}
    assert cli.main(["status", "--url", serve(body).url]) == 0
    body["plan"] = None
    assert cli.main(["status", "--url", serve(body).url]) == 1


def test_status_http_error_and_garbage(serve, capsys):
    assert cli.main(["status", "--url", serve({"error": {"message": "boom"}}, status=500).url]) == 1
    assert "HTTP 500" in capsys.readouterr().err
    assert cli.main(["status", "--url", serve(b"<html>", status=200).url]) == 1
    assert "not a JSON object" in capsys.readouterr().err


def test_status_api_key(serve, capsys, monkeypatch):
    srv = serve(MESH, need_key="k-123")
    assert cli.main(["status", "--url", srv.url]) == 1
    assert "API key" in capsys.readouterr().err
    assert cli.main(["status", "--url", srv.url, "--api-key", "k-123"]) == 0
    monkeypatch.setenv("MESHNODE_API_KEY", "k-123")
    assert cli.main(["status", "--url", srv.url]) == 0


def test_status_default_url_follows_settings(serve, monkeypatch, capsys):
    srv = serve(MESH)
    port = srv.httpd.server_address[1]
    monkeypatch.setenv("MESHNODE_HTTP_PORT", str(port))
    assert cli.main(["status"]) == 0
    assert "mac-studio-abc123" in capsys.readouterr().out


def test_status_unreachable_exits_2(capsys):
    port = free_port()
    assert cli.main(["status", "--url", f"http://127.0.0.1:{port}", "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and str(port) in err and "Traceback" not in err


def test_status_url_without_scheme(serve):
    srv = serve(MESH)
    assert cli.main(["status", "--url", srv.url.removeprefix("http://")]) == 0


def test_status_links_and_unreachable_peers(serve, capsys):
    nodes = [dict(n) for n in MESH["nodes"]]
    nodes[1]["links"] = [
        {
            "peer": "mac-mini-def456",
            "address": "169.254.10.2",
            "rtt_us": 180.4,
            "jitter_us": 20.0,
            "rpc_rtt_us": 610.0,
            "bandwidth": 2.5e9,
            "measured_at": 0,
        },
        {
            "peer": "mac-mini-def456",
            "address": "192.168.1.20",
            "rtt_us": 2400.0,
            "jitter_us": 900.0,
            "bandwidth": 45e6,
            "measured_at": 0,
        },
    ]
    body = {**MESH, "nodes": nodes}
    assert cli.main(["status", "--url", serve(body).url]) == 0
    out = capsys.readouterr().out
    assert "  to mac-mini-def456 via 169.254.10.2  round trip 180 µs ± 20 µs (a gRPC call 610 µs), 2.5 GB/s" in out
    assert "  to mac-mini-def456 via 192.168.1.20  round trip 2.40 ms ± 900 µs, 45.0 MB/s" in out
    assert "health       ok: serving, every peer answers" in out

    # serving, but a peer that mDNS shows never answers: not healthy, and the text says why and what to do
    body["unreachable"] = [
        {
            "node_id": "mac-pro-1",
            "address": "192.168.1.30:8471",
            "seconds": 42.0,
            "error": "UNAVAILABLE: No route to host",
        }
    ]
    assert cli.main(["status", "--url", serve(body).url]) == 1
    out = capsys.readouterr().out
    assert "NOT healthy" in out
    assert (
        "health       peer mac-pro-1 is announced over mDNS but does not answer at 192.168.1.30:8471 "
        "(for 42.0 s: UNAVAILABLE: No route to host)"
    ) in out
    assert "System Settings > Privacy & Security > Local Network" in out
    assert cli.main(["status", "--url", serve(body).url, "--json"]) == 1


def test_format_status_tolerates_sparse_json():
    text = cli.format_status({"node_id": "x"})
    assert "x" in text and "(none" in text
    assert cli.status_exit_code([]) == 1


def test_format_status_marks_a_node_of_another_build_and_a_slow_one():
    view = {
        "node_id": "a",
        "version": "0.1.0+g1111111",
        "nodes": [
            {"node_id": "a", "version": "0.1.0+g1111111", "slowdown": 1.0},
            {"node_id": "b", "version": "0.1.0+g2222222", "slowdown": 8.0, "slow_since": 1_700_000_000.0},
        ],
    }
    lines = cli.format_status(view).splitlines()
    a, b = (next(line for line in lines if line.strip().startswith(n)) for n in ("a ", "b "))
    assert "meshnode" not in a and "[meshnode 0.1.0+g2222222]" in b
    assert any(line.strip().startswith("b runs at 0.12x its measured speed since ") for line in lines), lines


def test_run_takes_speculative_decoding_from_flags():
    args = cli.build_parser().parse_args(
        ["run", "--speculative", "draft-model", "--draft-model", "/models/small", "--draft-max", "4"]
    )
    s = cli.settings_from_args(args, env={"MESHNODE_SPECULATIVE": "off"})
    assert (s.speculative, s.draft_model, s.draft_max) == ("draft_model", "/models/small", 4)  # a flag beats env
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "--speculative", "sometimes"])
