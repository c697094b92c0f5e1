"""Issue 12 benchmark: a growing chat's time to first token, turn by turn, against mlx_lm.server.

A chat client re-sends the whole conversation every turn. Four turns, each adding a user message
of ~``--turn-tokens`` tokens (and the model's answer), streamed with temperature 0; the time to
first token of each turn is measured on:
  - ``mlx_lm.server`` (one process on loopback; it keeps an LRU prompt cache),
  - meshnode on one node (one ``meshnode run`` process on loopback), and
  - meshnode on 2 stages (two ``meshnode run`` processes on namespace hosts, the client on a third,
    talking to the node that is not the head; needs root; ``--pin``: a core each, as two machines).
Targets (issue 12): turn-4 TTFT <= 1.1x mlx_lm.server on one node, <= 1.3x on 2 stages. Each
server's answers are checked to be the same text (greedy).

    sudo .venv/bin/python -m benchmarks.chat [--turn-tokens 400] [--pin] [--only one|two|server]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import STREAM_CHAT, free_port, local_node, stop, two_stage_mesh, wait_healthy  # noqa: E402
from harness.cluster import in_ns  # noqa: E402

# The model of benchmarks.busy: on these 2-core boxes (~1 GFLOP/s) a 1k-token prefill takes seconds.
MODEL = dict(family="llama", num_layers=8, hidden_size=192, intermediate_size=512, num_heads=4, num_kv_heads=2,
             dtype="float32")
CTX = 4096
TURNS = 4
MAX_TOKENS = 16

# argv: url, model, user messages (JSON list); prints {"ttft": [...], "answers": [...]}
CLIENT = STREAM_CHAT + r'''
import sys
url, model, users = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
messages, ttft, answers = [], [], []
for user in users:
    messages.append({"role": "user", "content": user})
    first, _, text = stream_chat(url, model, messages, %(max_tokens)d)
    ttft.append(first)
    answers.append(text)
    messages.append({"role": "assistant", "content": text})
print(json.dumps({"ttft": ttft, "answers": answers}))
''' % {"max_tokens": MAX_TOKENS}


def user_messages(model: Path, tokens: int) -> list[str]:
    """TURNS user messages of about ``tokens`` tokens each, all different."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model)
    out = []
    for turn in range(TURNS):
        words = tokens
        for _ in range(5):
            text = f"Turn {turn}. " + " ".join(f"w{(i * 7 + turn) % 89}" for i in range(words))
            words = max(10, int(words * tokens / max(len(tok.encode(text)), 1)))
        out.append(text)
    return out


def mlx_lm_server(model: Path, users: list[str]) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port)],
                                stdout=open(Path(tmp) / "server.log", "wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", 300)
            return in_ns(None, CLIENT, f"http://127.0.0.1:{port}", str(model), json.dumps(users), timeout=1800)
        finally:
            stop(proc)


def one_node(model: Path, users: list[str]) -> dict:
    with local_node(model, CTX) as url:
        return in_ns(None, CLIENT, url, model.name, json.dumps(users), timeout=1800)


def two_stages(model: Path, users: list[str], pin: bool, logs_to: Path | None = None) -> dict:
    with two_stage_mesh(model, CTX, pin=pin, env={"MESHNODE_LOG_LEVEL": "debug"} if logs_to else None) as \
            (client, url, logs):
        try:
            return in_ns(client, CLIENT, url, model.name, json.dumps(users), timeout=1800)
        finally:
            if logs_to is not None:
                logs_to.mkdir(parents=True, exist_ok=True)
                for log in logs:
                    shutil.copy(log, logs_to / f"{log.parent.name}.log")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turn-tokens", type=int, default=400)
    ap.add_argument("--pin", action="store_true", help="2 stages: a core each (benchmarks.common.two_stage_mesh)")
    ap.add_argument("--only", choices=("server", "one", "two"))
    ap.add_argument("--logs", type=Path, help="copy the 2-stage nodes' logs into this folder")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    args = ap.parse_args()
    from meshnode.model.build import model_dir_for

    spec = dict(MODEL)
    model = model_dir_for(args.cache, spec.pop("family"), **spec)
    users = user_messages(model, args.turn_tokens)
    print(f"model {model.name}; {TURNS} turns of ~{args.turn_tokens} tokens each; answers of {MAX_TOKENS} tokens")
    runs = {}
    runs["mlx_lm.server"] = mlx_lm_server(model, users)  # the baseline, always
    if args.only in (None, "one"):
        runs["meshnode, one node"] = one_node(model, users)
    if args.only in (None, "two"):
        runs[f"meshnode, 2 stages{' (a core each)' if args.pin else ''}"] = two_stages(model, users, args.pin, args.logs)
    base = runs["mlx_lm.server"]
    for name, r in runs.items():
        turns = "  ".join(f"{t * 1000:6.0f}" for t in r["ttft"])
        ratio = r["ttft"][-1] / base["ttft"][-1]
        same = "same answers" if r["answers"] == base["answers"] else "ANSWERS DIFFER from mlx_lm.server"
        print(f"{name:32s} TTFT per turn (ms): {turns}   turn {TURNS}: {ratio:.2f}x mlx_lm.server; {same}")
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
