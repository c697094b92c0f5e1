"""Coding agents through a real 2-stage mesh (issue 12b): ``meshnode run`` processes on namespace
hosts, every client inside the mesh's client namespace.

Codex CLI (npm @openai/codex), set up with only the mesh's base URL (a custom model provider, wire
API "responses"), runs ``codex exec`` against the scripted model of tests/agent_model.py split in
two stages and exits 0 with its answer, as it does against one node (tests/test_responses_api.py).

The agent loop of tests/test_agent_loop.py on two stages: the taught qwen3, asked through the node
that is not the head (it relays to the head), calls get_weather and answers from the result, by
chat completions (the call not streamed, the answer streamed) and by the Responses API (a
function_call item, then its function_call_output) and by the Anthropic Messages API (a tool_use
block streamed, then its tool_result); each turn re-sends a prompt that starts as the last one did,
so every stage resumes it from its prompt cache.
"""

from __future__ import annotations

import json

import pytest

from harness.cluster import HTTP, Cluster, in_ns
from harness.netns import netns_mesh
from meshnode.weights.profile import profile_model
from tests.agent_model import ASK, FINAL, RESULT, SAID, TOOLS, scripted_model
from tests.helpers import codex_cli, codex_setup, node_metrics, prompt_cache_reuse, run_group


def _two_stages(cluster: Cluster, budget: int) -> dict:
    """Start a node on every host with ``budget`` (less than the model needs alone) and the
    pipeline strategy; the converged plan, which has two stages."""
    # No move for speed once planned (figures measured on busy shared cores arrive after the first
    # plan): a move starts a new epoch without the prompt caches the turns resume.
    for h in cluster.hosts:
        cluster.start(h, budget, env={"MESHNODE_STRATEGY": "pipeline", "MESHNODE_REBALANCE_DWELL": "600"})
    views = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 120, "convergence")
    plan = views[0]["plan"]
    assert len(plan["stages"]) == 2, plan
    return plan


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_codex_exec_against_a_two_stage_mesh(tmp_path):
    codex = codex_cli()
    model = scripted_model(tmp_path, SAID, max_position_embeddings=40960)
    total = profile_model(model).total_bytes(40960, 1)  # the Cluster's nodes hold one request's KV
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=None)
        plan = _two_stages(cluster, int(total * 0.6))  # neither holds it alone with its whole context
        assert plan["max_context"] == 40960, plan  # the config's context, with default settings
        entry = cluster.hosts[0]
        work, env = codex_setup(tmp_path, model.name, f"http://{entry.ip}:{HTTP}/v1")
        status, out, err = run_group(
            cluster.client.exec_args([str(codex), "exec", "--skip-git-repo-check", "Say hello."]),
            timeout=420,
            cwd=work,
            env=env,
        )
        log = cluster.log(entry)
    assert status == 0, (out[-2000:], err[-3000:])
    assert out.strip() == SAID, (out[-2000:], err[-3000:])
    served = [line for line in log.splitlines() if "POST /v1/responses 200" in line]
    assert served, log[-3000:]
    # Codex's tools alone (its instructions cut to a line): a prompt longer than 12k tokens, served
    # as it comes on two stages whose memory holds the model's whole context.
    assert max(int(line.split("tokens=")[1].split("+")[0]) for line in served) > 12000, served


# The agent's loop, by the openai package inside the client namespace; prints what came back.
AGENT = r"""
import json, sys
from openai import OpenAI
base, model, ask, tools, result = (sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]),
                                   sys.argv[5])
c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
r = c.chat.completions.create(model=model, messages=ask, tools=tools, temperature=0)
choice = r.choices[0]
calls = choice.message.tool_calls or []
messages = ask + [choice.message.model_dump(exclude_none=True)] + [
    {"role": "tool", "tool_call_id": call.id, "content": result} for call in calls]
chunks = [ch for ch in c.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0,
                                                 stream=True) if ch.choices]
function = {"type": "function", **tools[0]["function"]}
first = c.responses.create(model=model, input=ask[0]["content"], tools=[function], temperature=0)
items = [i for i in first.output if i.type == "function_call"]
outputs = [{"type": "function_call_output", "call_id": i.call_id, "output": result} for i in items]
follow = c.responses.create(model=model, tools=[function], temperature=0,
                            input=[{"role": "user", "content": ask[0]["content"]},
                                   *[i.model_dump(exclude_none=True) for i in items], *outputs])
from anthropic import Anthropic
a = Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
a_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in tools]
with a.messages.stream(model=model, max_tokens=100, messages=ask, tools=a_tools, extra_body={"temperature": 0}) as s:
    use_msg = s.get_final_message()
uses = [b for b in use_msg.content if b.type == "tool_use"]
answer = a.messages.create(model=model, max_tokens=100, tools=a_tools, extra_body={"temperature": 0}, messages=[
    *ask, {"role": "assistant", "content": use_msg.content},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": result} for u in uses]}])
print(json.dumps({
    "anthropic": [use_msg.stop_reason, [[u.name, u.input] for u in uses], answer.stop_reason,
                  [b.text for b in answer.content if b.type == "text"]],
    "chat": [choice.finish_reason, choice.message.content or "",
             [[t.type, t.function.name, json.loads(t.function.arguments), bool(t.id)] for t in calls]],
    "streamed": ["".join(ch.choices[0].delta.content or "" for ch in chunks), chunks[-1].choices[0].finish_reason],
    "responses": [first.status, [i.type for i in first.output],
                  [[i.name, json.loads(i.arguments), bool(i.call_id)] for i in items]],
    "follow": [follow.status, follow.output_text],
}))
"""


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_agent_loop_on_two_stages_resumes_from_the_prompt_cache(taught, tmp_path):
    model = taught
    total = profile_model(model).total_bytes(1024, 1)
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=1024)
        plan = _two_stages(cluster, int(total * 0.6))  # neither holds it alone: two stages
        head = cluster.host(plan["stages"][-1]["nodes"][0])
        other = next(h for h in cluster.hosts if h is not head)  # it relays to the head, as any node does
        first_epoch = cluster.mesh_view(head)["epoch"]
        got = in_ns(
            cluster.client,
            AGENT,
            f"http://{other.ip}:{HTTP}",
            model.name,
            json.dumps(ASK),
            json.dumps(TOOLS),
            RESULT,
            timeout=300,
        )
        reuse = {h.name: prompt_cache_reuse(node_metrics(cluster, h)) for h in cluster.hosts}
        epochs = (first_epoch, cluster.mesh_view(head)["epoch"])  # the turns ran on one plan
        logs = cluster.logs()
    assert got["chat"] == ["tool_calls", "", [["function", "get_weather", {"city": "Paris"}, True]]], got
    assert got["streamed"] == [FINAL, "stop"], got
    assert got["responses"] == ["completed", ["function_call"], [["get_weather", {"city": "Paris"}, True]]], got
    assert got["follow"] == ["completed", FINAL], got
    assert got["anthropic"] == ["tool_use", [["get_weather", {"city": "Paris"}]], "end_turn", [FINAL]], got
    # Each turn starts as the ones before it did (the tools, the question): every stage resumed
    # every request after the first from its prompt cache.
    for name, (hits, reused) in reuse.items():
        # A string, not a tuple: pytest cuts a tuple's repr, and the logs are what tells which turn missed.
        assert hits == 5 and reused > 0, f"{name} {reuse} epochs {epochs}\n{logs}"
