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


# Four streams at once from the client namespace, one per API surface, on raw sockets: for each,
# the seconds it took, the longest gap between any two bytes, and whether it ended as it should.
SILENCES = r"""
import json, socket, sys, threading, time
host, port, bodies = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
out = {}
def run(name, path, body):
    data = json.dumps(body).encode()
    s = socket.create_connection((host, port), timeout=120)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    t0 = last = time.monotonic(); gap = 0.0; raw = b""
    while chunk := s.recv(65536):
        now = time.monotonic(); gap = max(gap, now - last); last = now; raw += chunk
    out[name] = {"took": last - t0, "gap": gap, "raw": raw.decode(errors="replace")[-3000:]}
threads = [threading.Thread(target=run, args=b) for b in bodies]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps(out))
"""


def test_a_long_prefill_keeps_every_surfaces_stream_alive(model, mesh2):
    """A ~1k-token prompt the first stage prefills for ~14 s, on each surface at once (OpenAI chat,
    Anthropic, Responses, Ollama): no stream is silent for more than a few seconds (SSE comments,
    Anthropic pings, empty NDJSON pieces), so no client's idle timeout fires; each ends whole."""
    from meshnode.api.core import KEEPALIVE_S

    cluster, view, entry, head, delay = mesh2
    m = model.name
    prompts = [long_messages(chat=300 + i) for i in range(4)]
    bodies = [
        ("openai", "/v1/chat/completions", {"model": m, "messages": prompts[0], "max_tokens": 2, "stream": True}),
        ("anthropic", "/v1/messages", {"model": m, "messages": prompts[1], "max_tokens": 2, "stream": True}),
        (
            "responses",
            "/v1/responses",
            {"model": m, "input": prompts[2][0]["content"], "max_output_tokens": 2, "stream": True},
        ),
        ("ollama", "/api/chat", {"model": m, "messages": prompts[3], "stream": True, "options": {"num_predict": 2}}),
    ]
    set_delay(delay, {"prefill_per_position": 0.014})
    try:
        out = in_ns(cluster.client, SILENCES, entry.ip, HTTP, json.dumps(bodies), timeout=150)
    finally:
        set_delay(delay, {})
    for name, got in out.items():
        assert got["took"] >= 2.2 * KEEPALIVE_S, (name, got["took"], "the prefill was not slow enough to tell")
        assert got["gap"] < KEEPALIVE_S + 2.5, (name, got, cluster.logs())
    assert "data: [DONE]" in out["openai"]["raw"]  # (the body is chunked: sizes between frames)
    assert "event: message_stop" in out["anthropic"]["raw"]
    assert "response.incomplete" in out["responses"]["raw"] or "response.completed" in out["responses"]["raw"]
    assert '"done":true' in out["ollama"]["raw"]
    assert_no_loss(cluster, view)


ABANDON = r"""
import json, socket, sys, time
host, port, path, body, after = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].encode(), float(sys.argv[5])
s = socket.create_connection((host, port))
s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
time.sleep(after)
s.close()  # a client that gave up (a timeout, a chat UI's Stop)
print(json.dumps({"left": True}))
"""


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_client_that_leaves_mid_prefill_stops_the_work_on_every_stage(model, mesh2, streamed):
    """A ~1k-token prompt the first stage would prefill for ~20 s, whose client leaves after 2 s
    (a whole answer or a stream): within a few seconds the first stage runs no more of its steps,
    the head logs the generation cancelled, the access line says so, and the next request is
    answered as mlx-lm answers it."""
    import re

    cluster, view, entry, head, delay = mesh2
    messages = long_messages(chat=400 + streamed)
    body = {"model": model.name, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": streamed}
    set_delay(delay, {"prefill_per_position": 0.02})
    try:
        mark = len(cluster.log(entry))
        in_ns(cluster.client, ABANDON, entry.ip, HTTP, "/v1/chat/completions", json.dumps(body), 2.0, timeout=30)
        cluster.wait(lambda: "client disconnected" in cluster.log(entry)[mark:], 10, "the disconnect noticed")
        time.sleep(3.0)  # a step already running when the client left may end
        settled = len(cluster.log(entry))
        time.sleep(5.0)
    finally:
        set_delay(delay, {})
    log = cluster.log(entry)
    steps = re.findall(r"test delay: \S+ s before a (\d+)-position step of (\S+)", log[mark:])
    assert steps, cluster.logs()
    assert sum(int(n) for n, _ in steps) < 900, ("the whole prompt was prefilled", steps)
    late = re.findall(r"test delay: .* of (\S+)", log[settled:])
    assert not late, ("the first stage went on with the abandoned request", late)
    assert "Traceback" not in log[mark:], log[mark:][-3000:]
    (line,) = [x for x in log[mark:].splitlines() if "client-disconnected" in x]
    assert f"POST /v1/chat/completions {200 if streamed else 499} " in line, line  # a stream's status went out
    assert "the request was cancelled" in cluster.log(head) + cluster.log(entry), cluster.logs()
    assert cluster.chat(entry, MESSAGES, 6) == mlx_reference(model, MESSAGES, 6)
    assert_no_loss(cluster, view)
