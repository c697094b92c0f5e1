"""The shared helpers of harness/cluster.py on this machine (no namespaces): the one `meshnode run`
command line, Python run elsewhere for its JSON, and polling a condition or a node's /v1/mesh."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from harness.cluster import in_ns, node_argv, wait_mesh, wait_until
from meshnode.cli import build_parser

pytestmark = pytest.mark.timeout(60)


def test_node_argv_names_only_flags_meshnode_run_has():
    argv = node_argv(
        Path("/m"),
        http_port=1,
        grpc_port=2,
        node_id="n",
        budget="1GiB",
        state_dir=Path("/s"),
        max_context=64,
        cache_dir="/c",
        kv_requests=1,
        host="127.0.0.1",
        config="/f.toml",
        peers=["10.0.0.1:8471", "10.0.0.2:8471"],
        mdns=False,
        extra=["--encrypt"],
    )
    assert argv[:4] == [sys.executable, "-m", "meshnode.cli", "run"]
    args = build_parser().parse_args(argv[3:])
    assert (args.model, args.http_port, args.grpc_port, args.node_id, args.memory_budget) == (
        ["/m"],
        "1",
        "2",
        "n",
        "1GiB",
    )
    assert (args.state_dir, args.max_context, args.cache_dir, args.kv_requests, args.host) == (
        "/s",
        "64",
        "/c",
        "1",
        "127.0.0.1",
    )
    assert args.config == Path("/f.toml") and args.peers == ["10.0.0.1:8471", "10.0.0.2:8471"]
    assert args.mdns is False and args.encrypt is True


def test_node_argv_leaves_out_what_is_not_given():
    assert node_argv() == [sys.executable, "-m", "meshnode.cli", "run"]
    assert node_argv("m", grpc_port=0) == [
        sys.executable,
        "-m",
        "meshnode.cli",
        "run",
        "--model",
        "m",
        "--grpc-port",
        "0",
    ]


def test_in_ns_returns_the_last_json_line_or_raises_with_stderr():
    assert in_ns(None, "import sys,json; print('noise'); print(json.dumps(sys.argv[1:]))", "a", 2) == ["a", "2"]
    with pytest.raises(RuntimeError, match="broken on purpose"):
        in_ns(None, "raise SystemExit('broken on purpose')")


def test_wait_until_retries_oserror_and_says_what_it_waited_for():
    tries = []

    def check():
        tries.append(1)
        if len(tries) < 3:
            raise OSError("not up yet")
        return len(tries) >= 4 and "done"

    assert wait_until(check, 10, "four tries", interval=0.01) == "done"
    with pytest.raises(AssertionError, match=r"waiting for never; last: False\nthe logs"):
        wait_until(lambda: False, 0.1, "never", interval=0.01, details=lambda: "the logs")


@pytest.fixture
def mesh_file(tmp_path):
    """A stand-in for a node's /v1/mesh: a file polled through a file:// URL (urllib reads those
    too), with no plan at first and a 2-stage plan half a second later."""
    view = tmp_path / "v1" / "mesh"
    view.parent.mkdir()

    def write(body: dict) -> None:
        (tmp_path / "next").write_text(json.dumps(body))
        (tmp_path / "next").replace(view)

    write({"healthy": False, "plan": None})
    later = threading.Timer(0.5, write, args=({"healthy": True, "plan": {"stages": [1, 2]}},))
    later.start()
    try:
        yield tmp_path.as_uri()
    finally:
        later.cancel()


def test_wait_mesh_polls_until_the_predicate_holds(mesh_file):
    # plan None: the predicate's TypeError counts as "not yet"
    view = wait_mesh(mesh_file, lambda v: len(v["plan"]["stages"]) == 2, timeout=30, interval=0.05, what="a plan")
    assert view == {"healthy": True, "plan": {"stages": [1, 2]}}


def test_wait_mesh_times_out_with_the_last_view(mesh_file):
    with pytest.raises(
        AssertionError,
        match=r"waiting for three stages in .*/v1/mesh: timed out after 1.5 s; "
        r"last: .*\"stages\": \[1, 2\].*\nthe logs",
    ):
        wait_mesh(
            mesh_file,
            lambda v: len(v["plan"]["stages"]) == 3,
            timeout=1.5,
            interval=0.05,
            what="three stages",
            details=lambda: "the logs",
        )


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("qwen3", "bfloat16")])
def test_a_scripted_model_says_its_table_whatever_came_before(tmp_path, family, dtype):
    from mlx_lm import load, stream_generate

    from harness.scripted import script_successors
    from meshnode.model.build import build_model

    path = build_model(tmp_path / family, family, num_layers=2, hidden_size=64, dtype=dtype, tie_word_embeddings=False)
    chain = list(range(300, 340))
    script_successors(path, dict(zip(chain, chain[1:])))
    model, tokenizer = load(str(path))
    for before in ([], [17, 250, 499, 3], list(range(100, 180))):
        said = [r.token for r in stream_generate(model, tokenizer, before + chain[:1], max_tokens=len(chain) - 1)]
        assert said == chain[1:]


def test_a_scripted_model_refuses_two_tokens_with_one_successor(tmp_path):
    from harness.scripted import script_successors
    from meshnode.model.build import build_model

    path = build_model(tmp_path / "m", "llama", num_layers=1, hidden_size=64, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="same next token"):
        script_successors(path, {300: 302, 301: 302})


@pytest.mark.slow
def test_an_in_process_node_stopped_mid_stream_leaves_no_task_pending(tmp_path, caplog):
    """A node that stops with a stream in flight leaves nothing pending in its closed loop: a task
    left there is destroyed by some later garbage collection, whose asyncio error then lands in
    whatever test runs in this process at that moment (test_fuzz counts every such error)."""
    import gc
    import http.client

    from meshnode.model.build import build_model
    from tests.helpers import running_node

    model = build_model(tmp_path / "llama", "llama", num_layers=2, hidden_size=64, dtype="float32")
    body = {"model": model.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}
    first = threading.Event()

    def stream(port: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}))
            r = conn.getresponse()
            r.readline()
            first.set()
            while r.readline():
                pass
        except OSError:
            pass  # the node went away mid-stream: the point of the test

    with caplog.at_level("ERROR", logger="asyncio"):
        with running_node(model, tmp_path / "node", max_context=100_000) as (n, _):
            reader = threading.Thread(target=stream, args=(n.http_port,), daemon=True)
            reader.start()
            assert first.wait(60), "the stream never started"
        reader.join(30)
        gc.collect()
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()], caplog.text
