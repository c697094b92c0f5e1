"""What Open WebUI does all day (issue 12), on a real 2-stage mesh in network namespaces, through
the ``openai`` package as Open WebUI's OpenAI connection uses it:

* the answer streams with ``stream_options.include_usage`` while a title request for the same
  chat is sent beside it (Open WebUI asks for a title and tags as soon as the first answer
  starts); both answers equal mlx-lm's, and the usage chunk counts the streamed tokens;
* the model list (``GET /v1/models``, polled by the UI) answers 200 with the model all the while
  a node leaves and the mesh has no plan, then joins again and the mesh re-plans: the state goes
  from ready to "does not fit" (or loading) and back, never a 503 or an empty list.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from harness.cluster import HTTP, Cluster, in_ns, mlx_reference
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model

MESSAGES = [{"role": "user", "content": "Tell me a story about the sea, the rivers and the lighthouse keeper."}]
TITLE = [{"role": "user", "content": "### Task: a concise title for this chat: Tell me a story about the sea."}]

ANSWER_AND_TITLE = r"""
import json, sys, threading
from openai import OpenAI
base, model, messages, title = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
out = {}
stream = c.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, stream=True,
                                   stream_options={"include_usage": True})
text, usage, chunks = "", None, 0
for chunk in stream:
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
        chunks += 1
        if chunks == 3:  # the answer is streaming: Open WebUI sends the title request now
            t = threading.Thread(target=lambda: out.update(title=c.chat.completions.create(
                model=model, messages=title, max_tokens=10, temperature=0).choices[0].message.content))
            t.start()
    if chunk.usage is not None:
        usage = [chunk.usage.prompt_tokens, chunk.usage.completion_tokens]
t.join(120)
out.update(answer=text, usage=usage)
print(json.dumps(out))
"""

POLL = r"""
import json, sys, time, urllib.request
url, seconds = sys.argv[1], float(sys.argv[2])
seen, end = [], time.monotonic() + seconds
while time.monotonic() < end:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            seen.append([r.status, [[m["id"], m["state"]] for m in json.loads(r.read())["data"]]])
    except urllib.error.HTTPError as e:
        seen.append([e.code, []])
    except OSError as e:
        seen.append([0, str(e)])
    time.sleep(0.2)
print(json.dumps(seen))
"""


@pytest.mark.netns
@pytest.mark.timeout(400)
def test_open_webui_answer_title_and_model_list_through_a_re_plan(tmp_path):
    model = build_model(
        tmp_path / "qwen3-bf16", "qwen3", num_layers=4, hidden_size=64, intermediate_size=128, dtype="bfloat16"
    )
    total = profile_model(model).total_bytes(1024)
    env = {"MESHNODE_STRATEGY": "pipeline"}
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=1024)
        for h in cluster.hosts:  # neither holds it alone: two stages
            cluster.start(h, int(total * 0.6), env=env)
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 90, "convergence")
        assert len(views[0]["plan"]["stages"]) == 2, views[0]["plan"]
        entry, other = cluster.hosts
        base = f"http://{entry.ip}:{HTTP}"
        got = in_ns(
            cluster.client, ANSWER_AND_TITLE, base, model.name, json.dumps(MESSAGES), json.dumps(TITLE), timeout=300
        )
        assert got["answer"] == mlx_reference(model, MESSAGES, 24)
        assert got["title"] == mlx_reference(model, TITLE, 10)
        assert got["usage"] is not None and got["usage"][1] > 0

        # The UI polls the model list while one node leaves (no plan fits the other alone) and joins again.
        polled: dict = {}
        poller = threading.Thread(
            target=lambda: polled.update(seen=in_ns(cluster.client, POLL, f"{base}/v1/models", 60, timeout=120))
        )
        poller.start()
        time.sleep(2)
        cluster.mesh.stop(cluster.procs.pop(other.name))
        cluster.wait(
            lambda: cluster.mesh_view(entry).get("plan") is None or len(cluster.mesh_view(entry)["nodes"]) == 1,
            60,
            "the mesh noticing the node left",
        )
        time.sleep(3)
        cluster.start(other, int(total * 0.6), env=env)
        cluster.wait(lambda: cluster.converged(cluster.hosts, 2), 90, "the node back and a new plan")
        poller.join(120)
        seen = polled["seen"]
        assert seen and all(status == 200 and [m for m, _ in listed] == [model.name] for status, listed in seen), [
            s for s in seen if s[0] != 200
        ][:5]
        states = [listed[0][1] for _, listed in seen]
        # Ready, then not (no plan fits the one node left: "does not fit" on the coordinator, or
        # "loading" on a node that has not heard why yet), then ready again (the chat below).
        assert states[0] == "ready" and set(states) - {"ready"}, states
        assert set(states) <= {"ready", "loading", "does not fit"}, states
        assert cluster.chat(entry, MESSAGES, 8) == mlx_reference(model, MESSAGES, 8)  # served again
