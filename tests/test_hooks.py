"""Test hooks reach a node through its constructor, never through the environment (issue 47).

harness/hooked_node.py starts ``meshnode run`` with stage delays and faults (harness/faults.py)
and scripted drafts (harness/drafts.py) as meshnode.hooks.NodeHooks; ``harness.cluster.node_argv``
launches it only when a test asks for either. The multi-host tests that use them (test_busy,
test_fault_placement, test_speculative_mesh) prove the delays, faults and drafts on real meshes;
here: the command line, each hook on its own, and scripted drafts through one real node.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from harness.cluster import HOOKED_NODE, mesh_view, node_argv, wait_until
from harness.faults import InjectedDelay
from harness.hooked_node import split_argv
from meshnode.cli import build_parser
from meshnode.model.build import build_model
from meshnode.transport.hop import _run_hook
from meshnode.transport.refusals import FAULT, StageFault
from meshnode.transport.stage_server import StageServer
from tests.helpers import clean_env, meshnode_run

pytestmark = pytest.mark.timeout(120)


def test_a_node_with_hooks_is_meshnode_run_behind_the_hooked_entry_point():
    assert node_argv("m")[:4] == [sys.executable, "-m", "meshnode.cli", "run"]  # no hooks: meshnode itself
    argv = node_argv("m", http_port=1, stage_delays="/d.json", drafts="/g.json", mdns=False)
    assert argv[:6] == [sys.executable, str(HOOKED_NODE), "--stage-delays", "/d.json", "--drafts", "/g.json"]
    hooks, rest = split_argv(argv[2:])
    assert hooks == {"stage_delays": "/d.json", "drafts": "/g.json"}
    args = build_parser().parse_args(rest)
    assert (args.model, args.http_port, args.mdns) == (["m"], "1", False)
    assert split_argv(["run", "--drafts", "x"]) == ({}, ["run", "--drafts", "x"])  # only at the front


def test_injected_delays_count_each_stream_s_messages(tmp_path):
    path = tmp_path / "delay.json"
    path.write_text(json.dumps({"raise_at": [1], "stall": 0.01, "stall_at": [2], "prefill": 0.01, "prefill_first": 1}))
    delays = InjectedDelay(str(path))
    before = delays.stream("req-1")
    assert before(8) is None  # a prefill chunk: delayed, nothing inside the step
    assert before(8) is None  # past prefill_first
    assert before(1) is None  # decode step 0
    with pytest.raises(RuntimeError, match="injected fault at decode step 1"):
        before(1)()
    assert before(1)() is None  # step 2 stalls (briefly) inside its step
    assert delays.stream("req-2")(1) is None  # another stream counts from 0
    path.write_text("{}")  # read again once it changes
    assert delays.stream("req-3")(1) is None and before(1) is None


def test_a_hook_raising_inside_a_step_is_the_stage_s_fault():
    """What a stream hook runs inside a step is a step of the stage (a stalled one shows in its
    StepWatch), and what it raises is reported as the stage's computation raising."""
    faults = []
    server = StageServer(None, vocab_size=10, max_chunk=8, max_context=64, on_fault=faults.append)
    stage = SimpleNamespace(server=server, shard=SimpleNamespace(spec=SimpleNamespace(start=2, end=4)))
    seen = []
    _run_hook(stage, lambda: seen.append(server.steps.longest() >= 0 and len(server.steps._running)), "r")
    assert seen == [1] and server.steps.longest() == 0

    def fail():
        raise RuntimeError("injected fault at decode step 3")

    with pytest.raises(StageFault) as info:
        _run_hook(stage, fail, "r")
    assert info.value.code == grpc.StatusCode.INTERNAL and str(info.value).startswith(FAULT)
    assert "injected fault at decode step 3" in str(info.value)
    assert faults and "layers [2, 4) failed on this input" in faults[0]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_scripted_drafts_reach_a_real_node_s_requests(tmp_path):
    """A `meshnode run` node given a drafts file guesses what it says, read for each request."""
    from mlx_lm import load, stream_generate

    model = build_model(
        tmp_path / "llama", "llama", num_layers=4, hidden_size=64, intermediate_size=128, dtype="float32", seed=4
    )
    whole, tokenizer = load(str(model))
    prompt = list(range(40, 80))
    answer = [r.token for r in stream_generate(whole, tokenizer, prompt, max_tokens=24)]
    drafts = tmp_path / "drafts.json"
    drafts.write_text(json.dumps({"p": 1.0, "vocab": whole.args.vocab_size, "answers": [prompt + answer], "k": 4}))
    env = {**clean_env(), "MESHNODE_SPECULATIVE": "prompt_lookup"}
    with meshnode_run(tmp_path, env, model=model, http_port=0, grpc_port=0, max_context=512, drafts=drafts) as (
        _,
        port,
        log,
    ):
        base = f"http://127.0.0.1:{port}"

        def complete() -> list[int]:
            body = json.dumps(
                {"model": model.name, "prompt": prompt, "max_tokens": len(answer), "temperature": 0}
            ).encode()
            req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.load(r)["choices"][0]["text"]

        def speculation() -> dict:
            return mesh_view(base)["metrics"]["speculation"]

        wait_until(lambda: mesh_view(base)["healthy"], 60, "the node to serve")
        want = tokenizer.decode(answer)
        assert complete() == want, Path(log).read_text()[-3000:]
        first = speculation()
        assert first["drafted"] > 0 and first["accepted"] == first["drafted"], first  # every guess right
        drafts.write_text(json.dumps({"off": True}))  # read again for the next request
        assert complete() == want
        assert speculation()["drafted"] == first["drafted"]
