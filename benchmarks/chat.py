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

``--prefix-tokens 6000``: an agent-like session (issue 12b): every turn resends the same system
message of that many tokens (an agent's instructions and tool definitions) before the growing
conversation; same targets. ``--sessions 3``: three such chats one after another (an agent's next
task starts with the same system message, so its first turn resumes that from the prompt cache);
turn 4's TTFT is their median (one turn of one chat is a noisy figure on a 2-core machine).

    sudo .venv/bin/python -m benchmarks.chat [--turn-tokens 400] [--prefix-tokens 0] [--sessions 1] [--pin]
                                            [--only one|two|server]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import STREAM_CHAT, local_node, mlx_lm_server, two_stage_mesh  # noqa: E402
from harness.cluster import in_ns  # noqa: E402

# The model of benchmarks.busy: on these 2-core boxes a 1k-token prefill takes seconds.
MODEL = dict(
    family="llama", num_layers=8, hidden_size=192, intermediate_size=512, num_heads=4, num_kv_heads=2, dtype="float32"
)
CTX = 4096
TURNS = 4
MAX_TOKENS = 16

# argv: url, model, sessions (JSON list of lists of user messages), system message ("": none); one
# session after another, each a new chat with the same system message; prints {"ttft": [[...], ...],
# "answers": [[...], ...]}
CLIENT = (
    STREAM_CHAT
    + r"""
import sys
url, model, sessions, system = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
ttft, answers = [], []
for users in sessions:
    messages = [{"role": "system", "content": system}] if system else []
    ttft.append([])
    answers.append([])
    for user in users:
        messages.append({"role": "user", "content": user})
        first, _, text = stream_chat(url, model, messages, %(max_tokens)d)
        ttft[-1].append(first)
        answers[-1].append(text)
        messages.append({"role": "assistant", "content": text})
print(json.dumps({"ttft": ttft, "answers": answers}))
"""  # noqa: UP031 (a script template with literal braces: % leaves them as they are)
    % {"max_tokens": MAX_TOKENS}
)


def user_messages(model: Path, tokens: int, prefix_tokens: int = 0, sessions: int = 1) -> tuple[list[list[str]], str]:
    """For each of ``sessions`` chats, TURNS user messages of about ``tokens`` tokens each, all
    different; and a system message of about ``prefix_tokens`` ("" for 0) that they share."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model)
    system = sized_text(tok, "Instructions and tools. ", prefix_tokens, 97) if prefix_tokens else ""
    return [
        [sized_text(tok, f"Session {k} turn {turn}. ", tokens, turn + 7 * k) for turn in range(TURNS)]
        for k in range(sessions)
    ], system


def sized_text(tok, head: str, n: int, salt: int) -> str:
    """``head`` and words made from ``salt``: about ``n`` tokens of ``tok``."""
    words = n
    for _ in range(5):
        text = head + " ".join(f"w{(i * 7 + salt) % 89}" for i in range(words))
        words = max(10, int(words * n / max(len(tok.encode(text)), 1)))
    return text


def on_mlx_lm_server(model: Path, users: list[list[str]], system: str = "") -> dict:
    with mlx_lm_server(model) as url:
        return in_ns(None, CLIENT, url, str(model), json.dumps(users), system, timeout=1800)


def one_node(model: Path, users: list[list[str]], system: str = "", ctx: int = CTX) -> dict:
    with local_node(model, ctx) as url:
        return in_ns(None, CLIENT, url, model.name, json.dumps(users), system, timeout=1800)


def two_stages(
    model: Path, users: list[list[str]], pin: bool, logs_to: Path | None = None, system: str = "", ctx: int = CTX
) -> dict:
    with two_stage_mesh(model, ctx, pin=pin, env={"MESHNODE_LOG_LEVEL": "debug"} if logs_to else None) as (
        client,
        url,
        logs,
    ):
        try:
            return in_ns(client, CLIENT, url, model.name, json.dumps(users), system, timeout=1800)
        finally:
            if logs_to is not None:
                logs_to.mkdir(parents=True, exist_ok=True)
                for log in logs:
                    shutil.copy(log, logs_to / f"{log.parent.name}.log")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turn-tokens", type=int, default=400)
    ap.add_argument(
        "--prefix-tokens",
        type=int,
        default=0,
        help="an agent's unchanging system message, resent every turn (issue 12b: 6000)",
    )
    ap.add_argument("--pin", action="store_true", help="2 stages: a core each (benchmarks.common.two_stage_mesh)")
    ap.add_argument("--only", choices=("server", "one", "two"))
    ap.add_argument("--logs", type=Path, help="copy the 2-stage nodes' logs into this folder")
    ap.add_argument(
        "--sessions",
        type=int,
        default=1,
        help="chats one after another, each with the same system "
        "message (an agent's next task); turn 4's TTFT is their median",
    )
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    args = ap.parse_args()
    from meshnode.model.build import model_dir_for

    spec = dict(MODEL)
    model = model_dir_for(args.cache, spec.pop("family"), **spec)
    users, system = user_messages(model, args.turn_tokens, args.prefix_tokens, args.sessions)
    need = args.prefix_tokens + TURNS * (args.turn_tokens + MAX_TOKENS + 32) + 256
    ctx = max(CTX, 1 << (need - 1).bit_length())
    print(
        f"model {model.name}; {TURNS} turns of ~{args.turn_tokens} tokens each"
        f"{f' after a {args.prefix_tokens}-token system message' if system else ''}; answers of {MAX_TOKENS} "
        f"tokens; context {ctx}; {args.sessions} session(s)"
    )
    runs = {}
    runs["mlx_lm.server"] = on_mlx_lm_server(model, users, system)  # the baseline, always
    if args.only in (None, "one"):
        runs["meshnode, one node"] = one_node(model, users, system, ctx)
    if args.only in (None, "two"):
        runs[f"meshnode, 2 stages{' (a core each)' if args.pin else ''}"] = two_stages(
            model, users, args.pin, args.logs, system, ctx
        )
    base = runs["mlx_lm.server"]
    last = lambda r: statistics.median(session[-1] for session in r["ttft"])  # noqa: E731
    for name, r in runs.items():
        turns = " | ".join("  ".join(f"{t * 1000:6.0f}" for t in session) for session in r["ttft"])
        same = "same answers" if r["answers"] == base["answers"] else "ANSWERS DIFFER from mlx_lm.server"
        print(
            f"{name:32s} TTFT per turn (ms): {turns}   turn {TURNS} (median of {len(r['ttft'])}): "
            f"{last(r) * 1000:.0f} ms, {last(r) / last(base):.2f}x mlx_lm.server; {same}"
        )
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
