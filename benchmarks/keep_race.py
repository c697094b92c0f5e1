"""A chat's next turn against its previous turn's keep, on one freshly started node (issue 48).

    sudo .venv/bin/python -m benchmarks.keep_race [--runs 4] [--cpu 0.1] [--tree DIR]

Each run starts one ``meshnode run`` node on loopback (benchmarks.chat's model); once it serves,
it and the processes it starts are limited to ``--cpu`` of one core (harness.cpulimit: a busy
machine; needs root). One 4-turn chat then goes to it as a client sends one: a ~600-token system
message, ~360-token user turns, 48-token answers, each turn sent as soon as the last answer ended
(streamed, greedy). A node just started also times its machine meanwhile, so the first turns
share the core with that. Prints, per run and turn, the time to the first token and the positions
resumed from the prompt cache (the node's /metrics): a turn that resumes no more than the turn
before it resumed an older prefix (the previous turn's keep was not found). ``--tree``: the
meshnode source the node runs (e.g. a ``git archive`` of another commit), to compare two versions
on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.chat import MODEL, TURNS, user_messages  # noqa: E402
from benchmarks.common import free_port, start_node, stop, wait_healthy  # noqa: E402
from harness.cluster import node_argv  # noqa: E402
from harness.cpulimit import cpu_limited  # noqa: E402

MAX_TOKENS = 48


def stream_chat(url: str, model: str, messages: list[dict]) -> tuple[float, str]:
    """(seconds to the first text, the text) of one streamed greedy chat completion."""
    body = json.dumps(
        {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    ).encode()
    t0, first, text = time.perf_counter(), None, ""
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            if line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                piece = ev["choices"][0]["delta"].get("content") if ev.get("choices") else None
                if piece:
                    first = first or time.perf_counter()
                    text += piece
    return (first or time.perf_counter()) - t0, text


def resumed(url: str) -> int:
    """Positions the node's requests have resumed from its prompt cache so far."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("meshnode_prompt_cache_reused_tokens_total"):
                return int(float(line.rsplit(" ", 1)[1]))
    return 0


def one_run(model: Path, users: list[str], system: str, cpu: float, tree: Path) -> list[tuple[float, int]]:
    """(time to first token, positions resumed) of each turn of one chat with a fresh node."""
    with tempfile.TemporaryDirectory() as tmp:
        http = free_port()
        env = {"PYTHONPATH": str(tree)}  # with the node started from tree, its own source comes first
        here = os.getcwd()
        os.chdir(tree)
        try:
            proc = start_node(
                node_argv(
                    model,
                    host="127.0.0.1",
                    http_port=http,
                    grpc_port=free_port(),
                    mdns=False,
                    state_dir=tmp,
                    max_context=4096,
                ),
                env=env,
                log=Path(tmp) / "node.log",
            )
        finally:
            os.chdir(here)
        url = f"http://127.0.0.1:{http}"
        try:
            wait_healthy(url, 300)
            with cpu_limited(proc.pid, cpu) if cpu else contextlib.nullcontext():
                messages = [{"role": "system", "content": system}]
                turns = []
                for user in users:
                    messages.append({"role": "user", "content": user})
                    before = resumed(url)
                    first, text = stream_chat(url, model.name, messages)
                    turns.append((first, resumed(url) - before))
                    messages.append({"role": "assistant", "content": text})
                return turns
        finally:
            stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--cpu", type=float, default=0.1, help="the node's share of one core (0: no limit)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the meshnode source the node runs")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    args = ap.parse_args()
    from meshnode.model.build import model_dir_for

    spec = dict(MODEL)
    model = model_dir_for(args.cache, spec.pop("family"), **spec)
    (users,), system = user_messages(model, 360, 600)
    print(
        f"model {model.name}; {TURNS} turns of ~360 tokens after a ~600-token system message; answers of "
        f"{MAX_TOKENS} tokens; the node on {args.cpu or 'every'} core(s); source {args.tree}",
        flush=True,
    )
    misses = 0
    for run in range(args.runs):
        turns = one_run(model, users, system, args.cpu, args.tree.resolve())
        missed = any(now <= last for (_, last), (_, now) in zip(turns, turns[1:]))
        misses += missed
        print(
            f"run {run + 1}: "
            + " | ".join(f"turn {i + 1} ttft {t:5.2f} s, resumed {r:4d}" for i, (t, r) in enumerate(turns))
            + ("  (an older prefix resumed)" if missed else ""),
            flush=True,
        )
    print(f"{misses} of {args.runs} runs resumed an older prefix in some turn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
