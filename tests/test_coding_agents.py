"""Coding agents with their defaults (issue 12b, 20): OpenCode (npm ``opencode-ai``) and Claude Code
(npm ``@anthropic-ai/claude-code``), each set up with only the mesh's base URL, run a task round
trip against a 2-stage mesh on namespace hosts and exit 0 with an answer.

OpenCode sends what it sends every day: a ~5k-token system prompt with its tool definitions, a
32000-token max_tokens, streaming with usage. The model (random weights, its config allowing 32k
tokens of context) cannot do the task, so the answer is noise; what is tested is that the agent's
requests are served as it makes them: the context the model was trained for, the room left as
the answer's limit, tools accepted, the stream OpenCode parses.

Claude Code sends its own: a system prompt of several thousand tokens, a "# Environment" turn
with role ``system`` inside ``messages``, a dozen tools (some ``defer_loading``), adaptive
thinking, ``?beta=true``. Its stream idle timeout is lowered below the time the mesh takes to
prefill that prompt: the stream's pings must keep it waiting.

The packages are installed from the npm registry once into ~/.cache/meshnode/npm (its binary ships
inside it); it runs inside the client namespace, which has no other network than the mesh's.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from harness.cluster import HTTP, Cluster
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model
from tests.agent_model import SAID, scripted_model
from tests.helpers import NPM_DIR, claude_code, npm_tool

OPENCODE = NPM_DIR / "node_modules" / ".bin" / "opencode"


def _chat_model(path):
    """A random-weights llama whose config allows 32k tokens of context, as an agent's prompt needs."""
    return build_model(
        path,
        "llama",
        num_layers=4,
        hidden_size=64,
        intermediate_size=128,
        dtype="float32",
        max_position_embeddings=32768,
    )


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_opencode_runs_a_task_against_a_two_stage_mesh(tmp_path):
    opencode = npm_tool("opencode-ai", OPENCODE)
    model = _chat_model(tmp_path / "llama-32k")
    total = profile_model(model).total_bytes(32768, 1)  # the Cluster's nodes hold one request's KV
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=None)
        for h in cluster.hosts:  # neither holds it alone with its whole context: two stages
            cluster.start(h, int(total * 0.6), env={"MESHNODE_STRATEGY": "pipeline"})
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 120, "convergence")
        assert views[0]["plan"]["max_context"] == 32768, views[0]["plan"]
        entry = cluster.hosts[0]
        home, work = tmp_path / "home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        config = {
            "$schema": "https://opencode.ai/config.json",
            "model": f"meshnode/{model.name}",
            "provider": {
                "meshnode": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "meshnode",
                    "options": {"baseURL": f"http://{entry.ip}:{HTTP}/v1"},
                    "models": {model.name: {"name": model.name}},
                }
            },
        }
        (work / "opencode.json").write_text(json.dumps(config))
        env = {
            **os.environ,
            "HOME": str(home),
            "OPENCODE_CONFIG": str(work / "opencode.json"),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
        }
        run = cluster.client.run(
            [str(opencode), "run", "-m", f"meshnode/{model.name}", "Write a haiku about the sea."],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        log = cluster.log(entry)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert run.stdout.strip(), run.stderr[-3000:]
    served = [line for line in log.splitlines() if "POST /v1/chat/completions 200" in line]
    assert served, log[-3000:]
    prompt_tokens = max(int(line.split("tokens=")[1].split("+")[0]) for line in served)
    assert prompt_tokens > 4096, served  # its system prompt and tools: more than a fixed 4096-token context holds


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_claude_code_runs_a_task_against_a_two_stage_mesh_through_a_long_prefill(tmp_path):
    claude = claude_code()
    # It says SAID and ends, whatever the prompt: Claude Code's prompt carries the date and the
    # folder, and an answer of random weights cut at max tokens is an error to it (exit 1).
    model = scripted_model(tmp_path, SAID)
    total = profile_model(model).total_bytes(32768, 1)
    idle_s = 20  # Claude Code's stream idle timeout, lowered from 300 s
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=None)
        delays = cluster.start_all_delayable(int(total * 0.6), env={"MESHNODE_STRATEGY": "pipeline"})
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 120, "convergence")
        entry = cluster.hosts[0]
        first = views[0]["plan"]["stages"][0]["nodes"][0]
        # The first stage alone takes 1.5 idle timeouts over Claude Code's ~10k-token prompt.
        delays[first].write_text(json.dumps({"prefill_per_position": 1.5 * idle_s / 10_000}))
        home, work = tmp_path / "home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": f"http://{entry.ip}:{HTTP}",
            "ANTHROPIC_API_KEY": "unused",
            "ANTHROPIC_MODEL": model.name,
            "ANTHROPIC_SMALL_FAST_MODEL": model.name,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(idle_s * 1000),
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",
        }
        t0 = time.monotonic()
        run = cluster.client.run(
            [str(claude), "-p", "Write a haiku about the sea.", "--model", model.name],
            cwd=work,
            env=env,
            timeout=400,
            check=False,
        )
        took = time.monotonic() - t0
        log = cluster.log(entry)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:], log[-3000:])
    assert SAID in run.stdout, (run.stdout[-2000:], run.stderr[-3000:])
    access = [line.split("meshnode.access: ", 1)[1] for line in log.splitlines() if "meshnode.access: " in line]
    asked = [line for line in access if line.startswith("POST /v1/messages")]
    assert asked and all(" 200 " in line for line in asked), asked
    prompt_tokens = max(int(line.split("tokens=")[1].split("+")[0]) for line in asked)
    assert prompt_tokens > 4096, asked
    assert took > idle_s, f"the prefill ({took:.1f} s in all) did not outlast the idle timeout"
