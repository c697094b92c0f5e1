"""The speed paths give mlx-lm's tokens: pipelined prefill and overlapped decoding, on real stages.

Real `meshnode run` processes on namespace hosts, real gRPC between them. The prefill's step limit
is set so low that every prompt is cut into the smallest chunks (many chunks in flight through
every stage), and several requests with prompts of different lengths run at once, so their
prefills and decodes interleave on every stage. Each answer must equal mlx_lm.generate's greedy
answer for its own prompt. No timing is asserted here (benchmarks/suite.py measures speed).
"""

from __future__ import annotations

import json
import sys

import pytest

from harness.cluster import HTTP, Cluster, in_ns
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

MAX_TOKENS = 12
PROMPTS = [
    "Hi",
    "Where do rivers go when they reach the sea, and why? " * 4,
    "Tell me about lighthouses, keepers, storms and ships in the night. " * 12,
    "Count: one two three four five six seven eight nine ten. " * 6,
]
# Every stage's prefill step is limited to a tenth of a millisecond: chunks of the smallest size.
FAST_CHUNKS = {"MESHNODE_MAX_STEP_MS": "0.1"}

_CONCURRENT = (
    "import json,sys,threading,urllib.request\n"
    "url,bodies=sys.argv[1],json.loads(sys.argv[2])\n"
    "out=[None]*len(bodies)\n"
    "def go(i):\n"
    "  req=urllib.request.Request(url,data=json.dumps(bodies[i]).encode(),"
    "headers={'Content-Type':'application/json'})\n"
    "  try:\n"
    "    out[i]=json.loads(urllib.request.urlopen(req,timeout=120).read())['choices'][0]['message']['content']\n"
    "  except Exception as e:\n"
    "    out[i]='ERROR '+repr(e)\n"
    "ts=[threading.Thread(target=go,args=(i,)) for i in range(len(bodies))]\n"
    "[t.start() for t in ts]; [t.join() for t in ts]\n"
    "print(json.dumps(out))\n"
)


def _messages(text):
    return [{"role": "user", "content": text}]


def _references(model):
    from mlx_lm import generate, load

    m, tok = load(str(model))
    return [
        generate(
            m, tok, prompt=tok.apply_chat_template(_messages(p), add_generation_prompt=True), max_tokens=MAX_TOKENS
        )
        for p in PROMPTS
    ]


def _concurrent_chats(cluster, host) -> list[str]:
    bodies = [
        {"model": cluster.model.name, "messages": _messages(p), "max_tokens": MAX_TOKENS, "temperature": 0}
        for p in PROMPTS
    ]
    return in_ns(
        cluster.client, _CONCURRENT, f"http://{host.ip}:{HTTP}/v1/chat/completions", json.dumps(bodies), timeout=180
    )


def _decode_hops(cluster, host) -> dict[str, float]:
    """Decode hops the head timed, by transport (tcp: the data port; grpc), from its /metrics."""
    code = (
        f"import urllib.request; print(urllib.request.urlopen('http://{host.ip}:{HTTP}/metrics', timeout=5)"
        ".read().decode())"
    )
    text = cluster.client.run([sys.executable, "-c", code], timeout=20).stdout
    counts = {"tcp": 0.0, "grpc": 0.0}
    for line in text.splitlines():
        if line.startswith("meshnode_hop_transport_seconds_count{"):
            transport = line.split('transport="')[1].split('"')[0]
            counts[transport] += float(line.rsplit(" ", 1)[1])
    return counts


def _run(model, tmp_path, hosts: int, fraction: float, transport: str = "tcp"):
    references = _references(model)
    budget = int(profile_model(model).total_bytes(512) * fraction)
    with netns_mesh(hosts) as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=512)
        for i, h in enumerate(cluster.hosts):
            # mixed: the first node has no data port (as a node of an older version): whichever is
            # the head, its activations to that node go over gRPC, and the head's go over gRPC too.
            fast = transport == "tcp" or (transport == "mixed" and i > 0)
            # pipeline pinned: these are tests of stages; with "auto" the planner may put two of the
            # three nodes in a tensor group (hybrid), whichever the measured links favour on the day.
            cluster.start(
                h,
                budget,
                env={**FAST_CHUNKS, "MESHNODE_STRATEGY": "pipeline", "MESHNODE_FAST_HOPS": "true" if fast else "false"},
            )
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, hosts), 60, "convergence")
        assert len(views[0]["plan"]["stages"]) == hosts, views[0]["plan"]
        head = next(h for h in cluster.hosts if h.name == views[0]["plan"]["stages"][-1]["nodes"][0])
        other = next(h for h in cluster.hosts if h is not head)
        # Through the head (its own API) and through another node (relayed to the head), twice:
        # the second round runs on warm caches and interleaves differently.
        for host in (head, other):
            got = _concurrent_chats(cluster, host)
            assert got == references, f"via {host.name}: {got} != {references}\n{cluster.logs()}"
        # Every decode hop went the configured way: the data port, or gRPC with fast_hops off
        # (and, in the mixed mesh, to or from the node without a data port).
        hops = _decode_hops(cluster, head)
        way = "tcp" if transport == "tcp" else "grpc"
        assert hops[way] > 0 and sum(hops.values()) == hops[way], hops


@pytest.mark.parametrize("transport", ["tcp", "grpc", "mixed"])
def test_dense_two_stages_pipelined_prefill_and_overlapped_decoding(tmp_path_factory, tmp_path, transport):
    model = build_model(
        tmp_path_factory.mktemp("speed") / "llama",
        "llama",
        num_layers=8,
        hidden_size=128,
        intermediate_size=256,
        dtype="float32",
    )
    _run(model, tmp_path, hosts=2, fraction=0.6, transport=transport)


def test_moe_three_stages_pipelined_prefill_and_overlapped_decoding(tmp_path_factory, tmp_path):
    model = build_model(
        tmp_path_factory.mktemp("speed") / "qwen3_moe", "qwen3_moe", num_layers=6, hidden_size=64, dtype="float32"
    )
    _run(model, tmp_path, hosts=3, fraction=0.4)
