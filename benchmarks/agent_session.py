"""An agent's session across restarts: the prompt cache on disk against mlx_lm.server (issue 17).

    sudo .venv/bin/python -m benchmarks.agent_session [--prefix-tokens 16000] [--only server|one|two]

One agent session of 8 turns, each resending a ~``--prefix-tokens`` system message (instructions
and tool definitions) and the conversation so far, plus a ~``--turn-tokens`` user message; answers
of 16 tokens, streamed, greedy. The server is restarted after turn 4, and 3 other conversations
(each a ~``--other-tokens`` prompt of its own) run between turns 6 and 7, so that the session's
prefix is no longer in memory (``kv_requests = 1``: the KV of one context).

Run on ``mlx_lm.server`` (its prompt cache lives in memory: turn 5 prefills everything again),
meshnode on one node, and meshnode on 2 stages (namespace hosts, needs root). Printed per run:
each turn's time to first token, and the bytes meshnode's nodes wrote to disk per turn. The
ratios: turns 5 and 7 against turn 4 of the same run (it resumed from memory; goal <= 1.5x) and
against mlx_lm.server's turn 5 (a cold prefill of that conversation; goal <= 0.2x). Every server
runs with the same BLAS (this process's: meshnode.blas), and the answers are checked to be equal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.chat import sized_text  # noqa: E402
from benchmarks.common import STREAM_CHAT, free_port, mlx_device, start_node, stop, wait_healthy  # noqa: E402
from harness.cluster import in_ns, mlx_lm_server_argv, node_argv, wait_mesh  # noqa: E402

MODEL = dict(
    family="llama",
    num_layers=8,
    hidden_size=192,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    dtype="float32",
    max_position_embeddings=32768,
)
TURNS, RESTART_AFTER, OTHERS_AFTER, OTHERS = 8, 4, 6, 3
MAX_TOKENS = 16

# argv: url, model, messages (JSON); prints [seconds to the first text, seconds in all, the text]
ASK = (
    STREAM_CHAT
    + r"""
import sys
url, model, messages = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
print(json.dumps(stream_chat(url, model, messages, MAX_TOKENS)))
""".replace("MAX_TOKENS", str(MAX_TOKENS))
)

# argv: the /metrics URLs; prints, summed over the nodes, the bytes written to the prompt cache on
# disk and the positions read back from it
DISK = r"""
import json, sys, urllib.request
names = ("meshnode_prompt_cache_disk_written_bytes_total ", "meshnode_prompt_cache_disk_tokens_total ")
out = [0, 0]
for url in sys.argv[1:]:
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        for i, name in enumerate(names):
            if line.startswith(name):
                out[i] += float(line.rsplit(" ", 1)[1])
print(json.dumps(out))
"""


def texts(model: Path, prefix_tokens: int, turn_tokens: int, other_tokens: int) -> tuple[str, list[str], list[str]]:
    """The session's system message, its user turns, and the other conversations' prompts."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model)
    return (
        sized_text(tok, "Instructions and tools. ", prefix_tokens, 97),
        [sized_text(tok, f"Turn {t}. ", turn_tokens, t + 3) for t in range(TURNS)],
        [sized_text(tok, f"Another task {k}. ", other_tokens, 50 + k) for k in range(OTHERS)],
    )


class Server:
    """One way of serving the model that can be restarted; ``url``: where the client asks."""

    client = None  # the namespace host the client runs in (None: here)
    url = ""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def disk(self) -> tuple[int, int]:
        """Bytes its nodes have written to the prompt cache on disk so far, and positions read back."""
        return 0, 0


class MlxLmServer(Server):
    def __init__(self, model: Path, tmp: Path):
        self.model, self.tmp, self.proc = model, tmp, None

    def start(self) -> None:
        port = free_port()
        self.proc = subprocess.Popen(
            mlx_lm_server_argv(self.model, port),
            stdout=open(self.tmp / "server.log", "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.url = f"http://127.0.0.1:{port}"
        wait_healthy(self.url, 300)

    def stop(self) -> None:
        stop(self.proc)


class OneNode(Server):
    def __init__(self, model: Path, tmp: Path, ctx: int):
        self.model, self.state, self.ctx, self.proc = model, tmp / "node", ctx, None
        self.http, self.grpc = free_port(), free_port()

    def start(self) -> None:
        self.state.mkdir(exist_ok=True)
        self.proc = start_node(
            node_argv(
                self.model,
                host="127.0.0.1",
                http_port=self.http,
                grpc_port=self.grpc,
                mdns=False,
                state_dir=self.state,
                cache_dir=self.state / "cache",
                max_context=self.ctx,
                kv_requests=1,
            ),
            log=self.state / "node.log",
        )
        self.url = f"http://127.0.0.1:{self.http}"
        wait_healthy(self.url, 300)
        wait_mesh(self.url, lambda v: v["measuring"] is None, timeout=300, what="the node to time its machine")

    def stop(self) -> None:
        stop(self.proc)

    def disk(self) -> tuple[int, int]:
        written, read = in_ns(None, DISK, self.url + "/metrics")
        return int(written), int(read)


class TwoStages(Server):
    """Two nodes on namespace hosts, neither holding the model alone; the client on a third."""

    def __init__(self, model: Path, tmp: Path, ctx: int, hosts: list):
        from meshnode.model.compute import CACHE_FILE, seed_figures
        from meshnode.weights.profile import profile_model

        *self.hosts, self.client = hosts
        self.model, self.tmp, self.ctx, self.procs = model, tmp, ctx, []
        profile = profile_model(model)
        self.budget = int(profile.total_bytes(ctx) * 0.6)
        seed_figures(model, profile.num_layers, tmp / "seed", max(profile.layer_bytes), tensor=False)
        for h in self.hosts:
            (tmp / h.name).mkdir()
            shutil.copy(tmp / "seed" / CACHE_FILE, tmp / h.name / CACHE_FILE)

    def start(self) -> None:
        for h in self.hosts:
            state = self.tmp / h.name
            self.procs.append(
                h.popen(
                    node_argv(
                        self.model,
                        http_port=8470,
                        grpc_port=8471,
                        node_id=h.name,
                        budget=self.budget,
                        state_dir=state,
                        cache_dir=state / "cache",
                        max_context=self.ctx,
                        kv_requests=1,
                    ),
                    env={
                        **os.environ,
                        "PYTHONPATH": str(ROOT),
                        "MESHNODE_CLUSTER_KEY": "bench",
                        "MESHNODE_STRATEGY": "pipeline",
                    },
                    log_path=state / "node.log",
                )
            )
        urls = [f"http://{h.ip}:8470" for h in self.hosts]
        view = wait_mesh(
            urls[0],
            lambda v: v["healthy"] and v["plan"] and len(v["plan"]["stages"]) == 2,
            client=self.client,
            timeout=300,
            what="a 2-stage plan",
        )
        for url in urls:
            wait_mesh(url, lambda v: v["measuring"] is None, client=self.client, timeout=300, what="measuring")
        self.url = f"http://{self.host(view['plan']['stages'][0]['nodes'][0]).ip}:8470"  # not the head: relayed

    def host(self, name: str):
        return next(h for h in self.hosts if h.name == name)

    def stop(self) -> None:
        for proc in self.procs:
            stop(proc)
        self.procs = []

    def disk(self) -> tuple[int, int]:
        written, read = in_ns(self.client, DISK, *[f"http://{h.ip}:8470/metrics" for h in self.hosts])
        return int(written), int(read)


def session(server: Server, model: Path, system: str, users: list[str], others: list[str]) -> dict:
    """The session's turns on ``server``: each turn's time to first token and answer, the bytes
    written to disk for it (its keep included: counted up to the next turn) and the positions its
    stages read back from disk."""
    name = str(model) if isinstance(server, MlxLmServer) else model.name
    messages = [{"role": "system", "content": system}]
    ttft, answers, written, read = [], [], [], []
    server.start()
    try:
        mark = (0, 0)
        for turn, user in enumerate(users, start=1):
            if turn > 1:
                time.sleep(1)  # the last turn's keep is written meanwhile
                written[-1] += server.disk()[0] - mark[0]
            if turn == RESTART_AFTER + 1:
                server.stop()
                server.start()
            if turn == OTHERS_AFTER + 1:
                for other in others:
                    in_ns(
                        server.client,
                        ASK,
                        server.url,
                        name,
                        json.dumps([{"role": "user", "content": other}]),
                        timeout=1800,
                    )
            mark = server.disk()
            messages.append({"role": "user", "content": user})
            first, _, text = in_ns(server.client, ASK, server.url, name, json.dumps(messages), timeout=1800)
            messages.append({"role": "assistant", "content": text})
            ttft.append(first)
            answers.append(text)
            read.append(server.disk()[1] - mark[1])
            written.append(0)
            print(
                f"  turn {turn}: {first * 1000:.0f} ms to the first token, {read[-1]} positions from disk", flush=True
            )
        time.sleep(1)
        written[-1] += server.disk()[0] - mark[0]
    finally:
        server.stop()
    return {"ttft": ttft, "answers": answers, "written": written, "read_from_disk": read}


@contextlib.contextmanager
def servers(model: Path, ctx: int, only: str | None) -> Iterator[dict[str, Server]]:
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        out: dict[str, Server] = {"mlx_lm.server": MlxLmServer(model, tmp)}
        if only in (None, "one"):
            (tmp / "one").mkdir()
            out["meshnode, one node"] = OneNode(model, tmp / "one", ctx)
        if only in (None, "two"):
            from harness.netns import netns_mesh

            (tmp / "two").mkdir()
            out["meshnode, 2 stages"] = TwoStages(model, tmp / "two", ctx, stack.enter_context(netns_mesh(3)).hosts)
        yield out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=16000)
    ap.add_argument("--turn-tokens", type=int, default=300)
    ap.add_argument("--other-tokens", type=int, default=5000)
    ap.add_argument("--only", choices=("one", "two"), help="mlx_lm.server and this one only")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    from meshnode.model.build import model_dir_for

    spec = dict(MODEL)
    model = model_dir_for(args.cache, spec.pop("family"), **spec)
    system, users, others = texts(model, args.prefix_tokens, args.turn_tokens, args.other_tokens)
    ctx = MODEL["max_position_embeddings"]
    print(
        f"model {model.name} ({MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, {MODEL['dtype']}); "
        f"{mlx_device()}; a {args.prefix_tokens}-token system message, {TURNS} turns of ~{args.turn_tokens} "
        f"tokens, {MAX_TOKENS}-token answers; restart after turn {RESTART_AFTER}; {OTHERS} other "
        f"conversations of ~{args.other_tokens} tokens after turn {OTHERS_AFTER}; context {ctx}, kv_requests 1"
    )
    runs = {}
    with servers(model, ctx, args.only) as chosen:
        for name, server in chosen.items():
            print(name, flush=True)
            runs[name] = session(server, model, system, users, others)
    cold = runs["mlx_lm.server"]["ttft"][RESTART_AFTER]
    for name, r in runs.items():
        t = r["ttft"]
        same = "same answers" if r["answers"] == runs["mlx_lm.server"]["answers"] else "ANSWERS DIFFER"
        print(f"{name:20s} TTFT (ms): {' '.join(f'{x * 1000:6.0f}' for x in t)}; {same}")
        if name != "mlx_lm.server":
            for turn in (5, 7):
                print(
                    f"    turn {turn}: {t[turn - 1] / t[3]:.2f}x its turn 4 (from memory; goal <= 1.5x), "
                    f"{t[turn - 1] / cold:.3f}x mlx_lm.server's cold turn 5 (goal <= 0.2x)"
                )
            print(
                f"    disk written per turn (MB): {' '.join(f'{w / 1e6:.1f}' for w in r['written'])}; "
                f"positions read from disk per turn: {' '.join(map(str, r['read_from_disk']))}"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": MODEL,
                    "device": mlx_device(),
                    "args": vars(args) | {"cache": str(args.cache), "json": str(args.json)},
                    "runs": runs,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
