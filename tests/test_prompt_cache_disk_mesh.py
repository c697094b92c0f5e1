"""The prompt cache on disk through real nodes (issue 17): every node of a 2-stage mesh restarts
between two turns of a chat, and the next turn reads its prefix back from disk on every stage.

``meshnode run`` processes on namespace hosts, the ``openai`` client, answers compared with
``mlx_lm.generate`` on the whole conversation; the nodes' metrics say how many positions came
from disk. A corrupt entry is deleted and the turn runs its whole prompt, answering the same.
"""

from __future__ import annotations

import json

import pytest
from mlx_lm import generate, load

from harness.cluster import HTTP, Cluster, in_ns
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model
from tests.helpers import node_metrics

pytestmark = [pytest.mark.netns, pytest.mark.slow]

MAX_TOKENS = 10
TURNS = [f"Turn {i}: a long question about harbours, ferries and the tides of the North Sea. " * 4 for i in range(4)]

# One chat request with the conversation so far (openai package); prints the answer.
ASK = r"""
import json, sys
from openai import OpenAI
base, model, messages = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
print(json.dumps(c.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0).choices[0].message.content))
""".replace("MAX_TOKENS", str(MAX_TOKENS))


def metric(text: str, name: str) -> int:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def reference(model, messages) -> str:
    m, tok = load(str(model))
    return generate(m, tok, prompt=tok.apply_chat_template(messages, add_generation_prompt=True), max_tokens=MAX_TOKENS)


@pytest.mark.timeout(600)
def test_every_node_restarted_the_next_turn_reads_its_prefix_from_disk(tmp_path):
    model = build_model(
        tmp_path / "llama-8bit",
        "llama",
        num_layers=6,
        hidden_size=64,
        intermediate_size=128,
        dtype="bfloat16",
        quantize="8bit",
    )
    total = profile_model(model).total_bytes(1024)
    env = {"MESHNODE_STRATEGY": "pipeline"}
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=1024)

        def start_all() -> dict:
            for h in cluster.hosts:  # neither holds it alone: two stages
                cluster.start(h, int(total * 0.6), env=env)
            views = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 90, "convergence")
            assert len(views[0]["plan"]["stages"]) == 2, views[0]["plan"]
            return views[0]["plan"]

        def stop_all() -> None:
            for name in list(cluster.procs):
                cluster.mesh.stop(cluster.procs.pop(name))

        messages: list[dict] = []

        def turn(i: int) -> str:
            messages.append({"role": "user", "content": TURNS[i]})
            answer = in_ns(
                cluster.client,
                ASK,
                f"http://{cluster.hosts[0].ip}:{HTTP}",
                model.name,
                json.dumps(messages),
                timeout=300,
            )
            assert answer == reference(model, messages), cluster.logs()
            messages.append({"role": "assistant", "content": answer})
            return answer

        plan = start_all()
        turn(0)
        turn(1)
        written = {
            h.name: metric(node_metrics(cluster, h), "meshnode_prompt_cache_disk_written_bytes_total")
            for h in cluster.hosts
        }
        assert all(n > 0 for n in written.values()), written

        stop_all()
        assert start_all()["stages"] == plan["stages"]
        turn(2)
        for h in cluster.hosts:  # every stage read turn 2's prefix back: only turn 3's tokens were computed
            text = node_metrics(cluster, h)
            hits, positions = (
                metric(text, "meshnode_prompt_cache_disk_hits_total"),
                metric(text, "meshnode_prompt_cache_disk_tokens_total"),
            )
            assert hits == 1 and positions > 2 * 60, (h.name, hits, positions, cluster.logs())

        # A truncated entry: the stage deletes it, the turn runs its whole prompt and answers the same.
        stop_all()
        entries = sorted(
            (tmp_path / cluster.hosts[0].name / "cache" / "prompt-cache").glob("*/*/layers-*"),
            key=lambda p: p.stat().st_mtime,
        )
        newest = entries[-1]
        newest.write_bytes(newest.read_bytes()[:1000])
        start_all()
        turn(3)
        assert not newest.exists()
        assert "could not be read" in cluster.log(cluster.hosts[0])
