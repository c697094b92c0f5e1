"""A busy stage is not a lost stage (issue 10b), on real namespace hosts.

Two nodes hold two stages of one model; the client talks to the first stage (not the head), so
both waits are exercised: the head waiting on the first stage's data port, and the first stage
waiting on the head's Generate stream. Delays are injected deterministically into the first
stage's steps (harness/faults.py, through the nodes' test hooks) while the node stays
alive (it keeps heartbeating): a slow step is not a lost stage, so the request does not wait out
the failover deadline for a re-plan that nobody makes, then fail (503 or placement_lost).

One mesh serves every test of the module (forming one is slow); each test sets the delays it
needs and clears them.
"""

from __future__ import annotations

import json
import time

import pytest

from harness import cpulimit
from harness.cluster import HTTP, Cluster, in_ns, mlx_reference, read_stream
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.model.compute import seed_figures
from meshnode.weights.profile import profile_model

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]

MESSAGES = [{"role": "user", "content": "Tell me a story about the sea and the rivers."}]
CTX = 2048


def long_messages(words: int = 230, chat: int = 0) -> list[dict]:
    """A title-like request: about 1k tokens with this model's tokenizer; each ``chat`` another
    (none starts like another: the prompt cache would resume it, and the answer would no longer
    run beside a long prefill)."""
    return [
        {
            "role": "user",
            "content": f"Chat {chat}. ### Task: a concise title for the chat below.\n"
            + " ".join(f"word{(i * 7 + chat * 13) % 97}" for i in range(words)),
        }
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(
        tmp_path_factory.mktemp("busy") / "llama",
        "llama",
        num_layers=8,
        hidden_size=128,
        intermediate_size=256,
        dtype="float32",
        seed=5,
    )


@pytest.fixture(scope="module")
def mesh2(model, tmp_path_factory):
    """(cluster, view, entry host = the first stage, head host, the first stage's delay file)."""
    tmp = tmp_path_factory.mktemp("busy-mesh")
    seed = tmp / "seed"
    seed.mkdir()
    seed_figures(model, profile_model(model).num_layers, seed, rounds=1)
    total = profile_model(model).total_bytes(CTX)
    with netns_mesh(2) as mesh:
        cluster = Cluster(mesh, model, tmp, max_context=CTX, seed=seed)
        # A pipeline, pinned: two nodes that each hold 0.6 of the model also make a tensor pair, which
        # the planner may estimate faster on a fast machine
        delays = cluster.start_all_delayable(int(total * 0.6), env={"MESHNODE_STRATEGY": "pipeline"})
        view = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 60, "a 2-stage plan")[0]
        first, head = (s["nodes"][0] for s in view["plan"]["stages"])
        entry = cluster.host(first)
        yield cluster, view, entry, cluster.host(head), delays[first]


def set_delay(path, spec: dict) -> None:
    path.write_text(json.dumps(spec))
    time.sleep(0.05)  # a new mtime for the next read


def assert_no_loss(cluster, view):
    for h in cluster.hosts:
        log = cluster.log(h)
        assert "generation lost" not in log and "stopped heartbeating" not in log, cluster.logs()
    assert cluster.mesh_view(cluster.hosts[0])["epoch"] == view["epoch"], "the mesh re-planned"


def test_stage_stalled_in_prefill_and_decode_is_not_lost(model, mesh2):
    """The first stage stalls 5 s on the prompt's first chunk and 5 s on a decode step (well past
    failure_timeout) while it heartbeats: the stream completes identical to mlx-lm
    in the same epoch, with no re-plan and no retry."""
    cluster, view, entry, head, delay = mesh2
    want = mlx_reference(model, MESSAGES, 24)
    set_delay(delay, {"prefill": 5.0, "prefill_first": 1, "decode": 5.0, "decode_at": [6]})
    try:
        t0 = time.monotonic()
        text, _ = read_stream(cluster.stream(entry, MESSAGES, 24), timeout=60)
        took = time.monotonic() - t0
    finally:
        set_delay(delay, {})
    assert text == want, cluster.logs()
    assert took >= 10.0, f"the injected stalls did not happen ({took:.1f} s)"
    assert cluster.log(entry).count("test delay:") >= 2
    assert_no_loss(cluster, view)


def test_slow_stage_serves_a_1k_token_prompt_without_503(model, mesh2):
    """A stage slowed as a machine with another job is (every decode step 2.5 s, past
    failure_timeout; prefill 4 ms per position) serves a ~1k-token prompt with default settings:
    slowly, no 503, the answer identical to mlx-lm."""
    cluster, view, entry, head, delay = mesh2
    messages = long_messages(chat=101)  # its own: a prompt the mesh kept would not be prefilled
    want = mlx_reference(model, messages, 3)
    set_delay(delay, {"prefill_per_position": 0.004, "decode": 2.5})
    try:
        body = {"model": model.name, "messages": messages, "max_tokens": 3, "temperature": 0}
        status, _, out = cluster.fetch(f"http://{entry.ip}:{HTTP}/v1/chat/completions", body, timeout=120)
    finally:
        set_delay(delay, {})
    assert status == 200, (out, cluster.logs())
    assert out["usage"]["prompt_tokens"] >= 900, out["usage"]
    assert out["choices"][0]["message"]["content"] == want
    assert_no_loss(cluster, view)


# Open WebUI's new-chat pattern through the openai client, from the client namespace: the answer
# (streamed) and a ~1k-token title request (non-streamed) sent at the same moment.
OPENWEBUI = r"""
import json, sys, threading
from openai import OpenAI
url, model, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
answer, titles = json.loads(sys.argv[4]), json.loads(sys.argv[5])  # a title request per round
c = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
texts, lost = [], []
def ask():
    try:
        text = ""
        for ch in c.chat.completions.create(model=model, messages=answer, max_tokens=20, temperature=0, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
        texts.append(text)
    except Exception as e:
        lost.append("answer: " + repr(e))
def name(title):
    try:
        c.chat.completions.create(model=model, messages=title, max_tokens=10, temperature=0)
    except Exception as e:
        lost.append("title: " + repr(e))
for i in range(rounds):
    a, b = threading.Thread(target=ask), threading.Thread(target=name, args=(titles[i],))
    a.start(); b.start(); a.join(); b.join()
print(json.dumps({"texts": texts, "lost": lost}))
"""

# 6 rounds keep this test short; the 20 rounds: benchmarks/busy.py --openwebui 20.
ROUNDS = 6


def test_openwebui_answer_and_title_at_once_nothing_lost(model, mesh2):
    cluster, view, entry, head, delay = mesh2
    want = mlx_reference(model, MESSAGES, 20)
    result = in_ns(
        cluster.client,
        OPENWEBUI,
        f"http://{entry.ip}:{HTTP}",
        model.name,
        ROUNDS,
        json.dumps(MESSAGES),
        json.dumps([long_messages(chat=i) for i in range(ROUNDS)]),
        timeout=150,
    )
    assert result["lost"] == [], (result["lost"], cluster.logs())
    assert result["texts"] == [want] * ROUNDS
    assert_no_loss(cluster, view)


def test_access_log_one_line_per_request_and_quiet_disconnect(model, mesh2):
    """Every request (a 404 poll, a chat, a stream the client drops) leaves one access line in the
    log of the node it reached; a client that goes away leaves one INFO line and no traceback."""
    cluster, view, entry, head, delay = mesh2
    before = cluster.log(entry).count("meshnode.access:")
    status, _, _ = cluster.fetch(f"http://{entry.ip}:{HTTP}/api/unknown")
    assert status == 404
    cluster.chat(entry, MESSAGES, 4)
    set_delay(delay, {"decode": 0.2})  # a stream long enough to walk away from
    try:
        proc = cluster.stream(entry, MESSAGES, 200)
        for _ in range(4):
            proc.stdout.readline()
        proc.kill()  # the client goes away mid-stream (a chat UI's Stop)
        proc.wait(10)
        cluster.wait(lambda: "client disconnected" in cluster.log(entry), 20, "the disconnect noticed")
    finally:
        set_delay(delay, {})
    time.sleep(0.5)
    log = cluster.log(entry)
    lines = [line for line in log.splitlines() if "meshnode.access:" in line]
    assert len(lines) - before == 3, lines[before:]
    new = lines[before:]
    assert "GET /api/unknown 404" in new[0]
    assert "POST /v1/chat/completions 200" in new[1] and f"model={model.name}" in new[1] and "+4" in new[1]
    assert "client-disconnected" in new[2]
    assert "Traceback" not in log and "Error handling request" not in log, log[-4000:]


def test_a_stage_that_raises_is_reported_at_once_and_the_mesh_keeps_serving(model, mesh2):
    """A deterministic fault (the first stage's computation raises at decode step 3, as a bug in a
    model would) ends the stream at once with an explicit error event naming the stage's error,
    is not replayed or taken for a lost node (no retry, no re-plan), and the next request is served."""
    cluster, view, entry, head, delay = mesh2
    set_delay(delay, {"raise_at": [3]})
    try:
        proc = cluster.stream(entry, MESSAGES, 24)
        t0 = time.monotonic()
        events = [json.loads(line.strip()[6:]) for line in proc.stdout if line.strip().startswith("data: {")]
        took = time.monotonic() - t0
        proc.wait(10)
    finally:
        set_delay(delay, {})
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1, events
    assert errors[0]["code"] == "stage_fault" and "injected fault at decode step 3" in errors[0]["message"], errors
    assert took < 10, f"the fault took {took:.1f} s to reach the client"
    assert "failed on" in cluster.log(entry) or "failed on" in cluster.log(head)
    assert_no_loss(cluster, view)
    want = mlx_reference(model, MESSAGES, 12)
    assert cluster.chat(entry, MESSAGES, 12) == want


@pytest.mark.skipif(cpulimit.available() is not None, reason=str(cpulimit.available()))
def test_a_stage_limited_to_a_quarter_core_serves_a_1k_token_prompt(model, mesh2):
    """A stage whose process really gets a quarter of one core (CFS bandwidth control, as a machine
    busy with another job) serves a ~1k-token prompt with default settings: slowly, no 503, no
    re-plan, the answer identical to mlx-lm. Its heartbeats still go out, so it is busy, not lost."""
    cluster, view, entry, head, delay = mesh2
    messages = long_messages(chat=102)  # its own: a prompt the mesh kept would not be prefilled
    want = mlx_reference(model, messages, 3)
    body = {"model": model.name, "messages": messages, "max_tokens": 3, "temperature": 0}
    with cpulimit.cpu_limited(cluster.procs[entry.name].pid, 0.25) as throttled:
        status, _, out = cluster.fetch(f"http://{entry.ip}:{HTTP}/v1/chat/completions", body, timeout=150)
        assert throttled() > 0, "the limit never bit"
    assert status == 200, (out, cluster.logs())
    assert out["usage"]["prompt_tokens"] >= 900, out["usage"]
    assert out["choices"][0]["message"]["content"] == want
    assert_no_loss(cluster, view)
