"""The real trained model (SmolLM2-135M-Instruct from its Q4_1 GGUF, tests/realmodel.py) on
namespace hosts, through what a day of use brings:

* a stage killed mid-answer replays to the uninterrupted answer;
* a 4-turn chat resumes kept prefixes and answers as the uncached conversation does;
* Open WebUI's answer-plus-title pattern gets a title of real words.

Every node is started on the GGUF file and finds this run's conversion in its cache;
tests/test_real_model.py has nodes convert it themselves.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from harness.cluster import HTTP, Cluster, in_ns, mlx_reference, read_stream, stage_nodes
from harness.netns import netns_mesh
from tests.helpers import node_metrics, prompt_cache_reuse
from tests.realmodel import serve, stop_all

CTX = 1024
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and the sea."}]
TEA = [{"role": "user", "content": "How do I make a good cup of tea?"}]


@pytest.fixture(scope="module")
def mesh():
    with netns_mesh(3) as m:
        yield m


@pytest.fixture(scope="module")
def cluster(mesh, smollm2, tmp_path_factory):
    return Cluster(mesh, smollm2[1], tmp_path_factory.mktemp("cluster"), max_context=CTX)


@pytest.mark.netns
@pytest.mark.timeout(900)
def test_a_stage_killed_mid_answer_replays_to_the_same_answer(cluster, mesh, smollm2_gguf, smollm2, tmp_path):
    _, folder = smollm2
    want = mlx_reference(folder, STORY, 160)
    assert len(want) > 300, want
    view = serve(cluster, smollm2_gguf, folder, tmp_path, (0.75, 0.75, 0.75))
    try:
        first, head = stage_nodes(view)
        proc = cluster.procs[first]
        text, faulted = read_stream(
            cluster.stream(cluster.host(head), STORY, 160), fault=lambda: mesh.kill(proc), after_chunks=20, timeout=240
        )
        assert faulted and text == want
        after = cluster.mesh_view(cluster.host(head))
        assert after["epoch"] > view["epoch"] and first not in stage_nodes(after)
    finally:
        stop_all(cluster)


@pytest.mark.netns
@pytest.mark.timeout(900)
def test_a_four_turn_chat_resumes_its_prefix_and_answers_as_uncached(cluster, smollm2_gguf, smollm2, tmp_path):
    _, folder = smollm2
    view = serve(cluster, smollm2_gguf, folder, tmp_path, (0.75, 0.75))
    try:
        head = cluster.host(stage_nodes(view)[-1])
        messages = [{"role": "system", "content": "You are a helpful assistant who knows geography."}]
        for question in (
            "What is the capital of France?",
            "And of Italy?",
            "Which of the two is bigger?",
            "Name a river in each.",
        ):
            messages.append({"role": "user", "content": question})
            answer = cluster.chat(head, messages, 24)
            assert answer == mlx_reference(folder, messages, 24), (question, messages)
            messages.append({"role": "assistant", "content": answer})
        hits = sum(prompt_cache_reuse(node_metrics(cluster, h))[0] for h in cluster.hosts[:2])
        assert hits >= 3, hits
    finally:
        stop_all(cluster)


ANSWER_AND_TITLE = r"""
import json, sys, threading
from openai import OpenAI
base, model, chat, title = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
c = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=240)
out, t = {}, None
text = ""
for chunk in c.chat.completions.create(model=model, messages=chat, max_tokens=48, temperature=0, stream=True):
    if chunk.choices:
        text += chunk.choices[0].delta.content or ""
        if t is None:  # the answer is streaming: Open WebUI asks for the chat's title now
            t = threading.Thread(target=lambda: out.update(title=c.chat.completions.create(
                model=model, messages=title, max_tokens=24, temperature=0).choices[0].message.content))
            t.start()
t.join(240)
out.update(answer=text)
print(json.dumps(out))
"""
TITLE = [
    {
        "role": "user",
        "content": "Create a concise title of 3 to 5 words for this chat. Reply with the title "
        "only.\n\nUSER: How do I make a good cup of tea?",
    }
]


@pytest.mark.netns
@pytest.mark.timeout(900)
def test_open_webuis_answer_and_title_at_once_give_real_words(cluster, smollm2_gguf, smollm2, tmp_path):
    model_id, folder = smollm2
    view = serve(cluster, smollm2_gguf, folder, tmp_path, (0.75, 0.75))
    try:
        head = cluster.host(stage_nodes(view)[-1])
        t0 = time.monotonic()
        out = in_ns(
            cluster.client,
            ANSWER_AND_TITLE,
            f"http://{head.ip}:{HTTP}",
            model_id,
            json.dumps(TEA),
            json.dumps(TITLE),
            timeout=300,
        )
        assert out["answer"] == mlx_reference(folder, TEA, 48)
        title = out["title"]
        assert title == mlx_reference(folder, TITLE, 24)
        words = re.findall(r"[A-Za-z]{2,}", title)
        assert "\n" not in title.strip() and 2 <= len(words) <= 12 and len(title) < 120, title
        print(f"answer and title in {time.monotonic() - t0:.1f} s; title: {title!r}")
    finally:
        stop_all(cluster)
