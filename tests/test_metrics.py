"""GET /metrics of one real node (Prometheus text format), the figures in /v1/mesh, the dashboard's
files and the API key, and load progress (a bar on a terminal, ``progress`` in /v1/mesh)."""

from __future__ import annotations

import contextlib
import io
import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshnode.metrics import NodeMetrics, Progress, outcome_for_status
from meshnode.model.build import build_model
from meshnode.model.shard import Shard
from tests.helpers import running_node

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "Count the stars."}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("metrics") / "llama", "llama", num_layers=4, dtype="float32")


@pytest.fixture(scope="module")
def node(model_path, tmp_path_factory):
    with running_node(model_path, tmp_path_factory.mktemp("node"), max_context=512) as (node, base):
        yield node, base


def http(url, body=None, headers=None, timeout=60):
    """(status, headers, body bytes) of one request; 4xx/5xx are returned, not raised."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def scrape(base, headers=None) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser: {(name, labels): value}."""
    status, hdrs, raw = http(f"{base}/metrics", headers=headers)
    assert status == 200, raw
    assert hdrs["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def ok(samples):
    return samples[("meshnode_requests_total", (("outcome", "ok"),))]


def test_chat_request_counts_in_metrics(node):
    _, base = node
    before = scrape(base)
    assert before[("meshnode_plan_epoch", ())] >= 1
    assert before[("meshnode_plans_adopted_total", ())] >= 1
    status, _, raw = http(
        f"{base}/v1/chat/completions", {"model": "llama", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    )
    assert status == 200, raw
    usage = json.loads(raw)["usage"]
    after = scrape(base)
    assert ok(after) == ok(before) + 1
    assert (
        after[("meshnode_tokens_generated_total", ())]
        == before[("meshnode_tokens_generated_total", ())] + usage["completion_tokens"]
    )
    ttft = ("meshnode_time_to_first_token_seconds_count", ())
    assert after[ttft] == before[ttft] + 1
    assert (
        after[("meshnode_time_to_first_token_seconds_sum", ())]
        > before[("meshnode_time_to_first_token_seconds_sum", ())]
    )
    # every outcome and membership kind is exported from the start (0 until it happens)
    for outcome in ("client_error", "unavailable", "error", "cancelled"):
        assert ("meshnode_requests_total", (("outcome", outcome),)) in after
    for kind in ("join", "loss", "leave"):
        assert ("meshnode_membership_changes_total", (("kind", kind),)) in after
    assert ("meshnode_decode_tokens_per_second", ()) in after
    assert ("meshnode_generation_retries_total", ()) in after


def test_outcomes_streaming_and_mesh_figures(node):
    _, base = node
    before = scrape(base)
    status, _, _ = http(f"{base}/v1/chat/completions", {"model": "nope", "messages": MESSAGES})
    assert status == 404
    status, _, raw = http(
        f"{base}/v1/chat/completions", {"model": "llama", "messages": MESSAGES, "max_tokens": 10, "stream": True}
    )
    assert status == 200 and raw.decode().rstrip().endswith("data: [DONE]")
    after = scrape(base)
    client_error = ("meshnode_requests_total", (("outcome", "client_error"),))
    assert after[client_error] == before[client_error] + 1
    assert ok(after) == ok(before) + 1
    status, _, raw = http(f"{base}/v1/mesh")
    mesh = json.loads(raw)
    m = mesh["metrics"]
    assert m["tokens_generated"] == after[("meshnode_tokens_generated_total", ())]
    assert m["requests"]["ok"] == ok(after) and m["requests"]["client_error"] == after[client_error]
    assert m["last_request_tokens_per_second"] > 0
    assert m["mean_time_to_first_token"] > 0
    assert mesh["progress"] is None  # loaded: nothing in progress
    assert "measuring" in mesh
    assert any(e["event"] == "plan" for e in mesh["events"])


@pytest.mark.slow
def test_dashboard_files_and_api_key(model_path, tmp_path):
    with running_node(model_path, tmp_path, max_context=256, api_key="sekret") as (_, base):
        status, hdrs, raw = http(f"{base}/")
        assert status == 200 and hdrs["Content-Type"].startswith("text/html") and b"/static/app.js" in raw
        for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
            status, hdrs, _ = http(f"{base}/static/{name}")
            assert status == 200 and kind in hdrs["Content-Type"], name
        assert http(f"{base}/metrics")[0] == 401  # metrics are data: they need the key like /v1
        assert http(f"{base}/v1/mesh")[0] == 401
        assert http(f"{base}/static/../../node.py")[0] in (403, 404)
        auth = {"Authorization": "Bearer sekret"}
        assert http(f"{base}/v1/mesh", headers=auth)[0] == 200
        assert ("meshnode_tokens_generated_total", ()) in scrape(base, headers=auth)


def test_shard_reports_each_layer_and_progress_draws_a_bar(model_path):
    seen = []
    Shard(model_path, 1, 4, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)]

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        p = Progress(stream, width=10)
        p.update("loading layers 0-3 of m", 2, 4)
        assert p.current == {"task": "loading layers 0-3 of m", "done": 2, "total": 4}
        p.finish()
        assert p.current is None
    assert "loading layers 0-3 of m [#####-----] 2/4" in tty.getvalue()
    assert pipe.getvalue() == ""  # not a terminal: no bar, the log says it


def test_live_rate_and_outcomes():
    now = [100.0]
    m = NodeMetrics(clock=lambda: now[0])
    assert m.tokens_per_second() == 0.0
    for _ in range(11):
        m.token()
        now[0] += 0.1
    assert m.tokens_per_second() == pytest.approx(10.0)
    now[0] += 3.0  # idle: not decoding now
    assert m.tokens_per_second() == 0.0
    assert [outcome_for_status(s) for s in (200, 400, 404, 413, 429, 503, 500)] == [
        "ok",
        "client_error",
        "client_error",
        "client_error",
        "unavailable",
        "unavailable",
        "error",
    ]
    m.event("plan", {"epoch": 7})
    m.event("loss", {"node_id": "x"})
    text = m.render().decode()
    assert "meshnode_plan_epoch 7.0" in text
    assert 'meshnode_membership_changes_total{kind="loss"} 1.0' in text


@pytest.mark.slow
def test_mesh_view_says_while_the_node_measures_its_machine(model_path, tmp_path, monkeypatch):
    """Once a peer is there to group with, a node's first start on a machine times a layer split two
    ways (two short-lived processes) while it already serves: its requests meanwhile run slower (the
    processes share its cores). /v1/mesh says so, and when it ends; alone, it times nothing."""
    import threading

    import meshnode.node as node_module

    started, release = threading.Event(), threading.Event()

    def slow_measure(*args):
        started.set()
        assert release.wait(60)
        return 0.001

    monkeypatch.setattr(node_module, "tensor_layer_seconds", slow_measure)
    with contextlib.ExitStack() as stack:
        a, base = stack.enter_context(running_node(model_path, tmp_path / "a", node_id="node-a", max_context=512))
        assert not started.wait(3), "a node alone timed a split layer"
        assert json.loads(http(f"{base}/v1/mesh")[2])["measuring"] is None
        peer = [f"127.0.0.1:{a.grpc_port}"]
        stack.enter_context(running_node(model_path, tmp_path / "b", node_id="node-b", max_context=512, peers=peer))
        try:
            assert started.wait(60)
            deadline = time.monotonic() + 30
            while not json.loads(http(f"{base}/v1/mesh")[2])["measuring"]:  # either node may time it first
                assert time.monotonic() < deadline, "a's measuring never shown"
                time.sleep(0.05)
            assert "split two ways" in json.loads(http(f"{base}/v1/mesh")[2])["measuring"]
        finally:
            release.set()
        deadline = time.monotonic() + 30
        while json.loads(http(f"{base}/v1/mesh")[2])["measuring"] is not None:
            assert time.monotonic() < deadline, "still measuring"
            time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["single", "pipeline", "auto"])
def test_a_node_that_makes_no_tensor_group_times_none(model_path, tmp_path, monkeypatch, strategy):
    """The split figure prices tensor groups only: nodes set to plan without them start no ring
    processes; nodes that may plan them time it once they have a peer."""
    import threading

    import meshnode.node as node_module

    timed = threading.Event()

    def measure(*args):
        timed.set()
        return 0.001

    monkeypatch.setattr(node_module, "tensor_layer_seconds", measure)
    with contextlib.ExitStack() as stack:
        a, _ = stack.enter_context(running_node(model_path, tmp_path / "a", max_context=512, strategy=strategy))
        peer = [f"127.0.0.1:{a.grpc_port}"]
        stack.enter_context(running_node(model_path, tmp_path / "b", max_context=512, strategy=strategy, peers=peer))
        assert timed.wait(6) == (strategy == "auto"), strategy  # it times within a beat of the peer's
