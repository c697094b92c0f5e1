"""Issue 10b benchmark: a short answer beside a long title request (Open WebUI's new-chat pattern).

For every new chat Open WebUI sends the answer request and, at the same moment, a title request
with a ~1k-token prompt. This measures the answer's time to first token (TTFT) alone and with a
1k-token request started just before it, and prints the ratio (target <= 1.5x):
  - on one node (one `meshnode run` process on loopback), and
  - on 2 stages (two `meshnode run` processes on namespace hosts; the client talks to the first
    stage, as a client of any node does; needs root).
``--rounds`` pairs per mode (median reported); ``--openwebui N`` also runs N rounds of the full
pattern through the ``openai`` client on the 2 stages (answer streamed + title, at once) and
checks every answer against mlx-lm and that none was lost.

    sudo .venv/bin/python benchmarks/busy.py [--rounds 5] [--openwebui 20] [--only one|two]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import STREAM_CHAT, local_node, two_stage_mesh  # noqa: E402
from harness.cluster import in_ns  # noqa: E402

# A small float32 llama: on these 2-core boxes (reference BLAS) its 1k-token prefill takes
# a few seconds, long enough to starve an answer that waits behind it, short enough for 20 rounds.
MODEL = dict(
    family="llama", num_layers=8, hidden_size=192, intermediate_size=512, num_heads=4, num_kv_heads=2, dtype="float32"
)
ANSWER = [{"role": "user", "content": "Why is the sea salty?"}]
ANSWER_TOKENS = 24
TITLE_TOKENS = 10
CTX = 2048

# The client side: runs where the client lives (this process, or the mesh's client namespace).
# argv: url, model, title words, rounds, mode ("ttft" | "openwebui")
CLIENT = (
    STREAM_CHAT
    + r"""
import json, statistics, sys, threading, time, urllib.request
url, model, words, rounds, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
ANSWER = %(answer)s
ROUND = [0]
def TITLE_NOW():
    # every new chat's title prompt is another conversation: none starts like another (which the
    # prompt cache would resume; the chat's own turns are benchmarks/chat.py's)
    ROUND[0] += 1
    return [{"role": "user",
             "content": "Chat %%d. ### Task: generate a concise title for the chat below.\n" %% ROUND[0] +
             " ".join("word%%d" %% ((i * 7 + ROUND[0] * 13) %% 97) for i in range(words))}]

def post(messages, max_tokens, stream):
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": stream}).encode()
    return urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", data=body,
                                  headers={"Content-Type": "application/json"}), timeout=600)

def answer():
    return stream_chat(url, model, ANSWER, %(answer_tokens)d)

def title(out):
    t0 = time.perf_counter()
    with post(TITLE_NOW(), %(title_tokens)d, False) as r:
        json.loads(r.read())
    out.append(time.perf_counter() - t0)

if mode == "ttft":
    answer(); t = []; title(t)  # warm-up
    alone, beside, titles = [], [], []
    for _ in range(rounds):
        alone.append(answer()[0])
        th = threading.Thread(target=title, args=(titles,)); th.start()
        time.sleep(0.05)  # the title's prefill is under way
        beside.append(answer()[0])
        th.join()
    print(json.dumps({"alone": statistics.median(alone), "beside": statistics.median(beside),
                      "title": statistics.median(titles), "alone_all": alone, "beside_all": beside}))
else:
    from openai import OpenAI
    c = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    texts, lost, ttfts = [], [], []
    def ask(out):
        try:
            t0 = time.perf_counter(); first = None; text = ""
            for ch in c.chat.completions.create(model=model, messages=ANSWER, max_tokens=%(answer_tokens)d,
                                                temperature=0, stream=True):
                if ch.choices and ch.choices[0].delta.content:
                    first = first or time.perf_counter(); text += ch.choices[0].delta.content
            out.append(text); ttfts.append(first - t0)
        except Exception as e:
            lost.append(repr(e))
    def name(out):
        try:
            c.chat.completions.create(model=model, messages=TITLE_NOW(), max_tokens=%(title_tokens)d, temperature=0)
        except Exception as e:
            lost.append(repr(e))
    for _ in range(rounds):
        a = threading.Thread(target=ask, args=(texts,)); b = threading.Thread(target=name, args=([],))
        a.start(); b.start(); a.join(); b.join()
    print(json.dumps({"texts": texts, "lost": lost, "ttft_median": statistics.median(ttfts) if ttfts else None}))
"""  # noqa: UP031 (a script template full of %% and braces: % is its least error-prone form)
    % {"answer": repr(ANSWER), "answer_tokens": ANSWER_TOKENS, "title_tokens": TITLE_TOKENS}
)


def client_code() -> str:
    return CLIENT


def reference(model: Path) -> str:
    from mlx_lm import generate, load

    m, tok = load(str(model))
    return generate(
        m, tok, prompt=tok.apply_chat_template(ANSWER, add_generation_prompt=True), max_tokens=ANSWER_TOKENS
    )


def title_words(model: Path, tokens: int = 1000) -> int:
    """Words of filler that make the title prompt about ``tokens`` tokens long."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model)
    words = tokens
    for _ in range(6):
        text = " ".join(f"word{i % 97}" for i in range(words))
        n = len(tok.encode(text))
        words = max(10, int(words * tokens / max(n, 1)))
    return words


def run_client(args: list[str], host=None, timeout: float = 900) -> dict:
    """The client side, here (``host`` None) or inside the namespace host ``host``."""
    return in_ns(host, CLIENT, *args, timeout=timeout)


def one_node(model: Path, words: int, rounds: int) -> dict:
    with local_node(model, CTX) as url:
        return run_client([url, model.name, str(words), str(rounds), "ttft"])


def two_stages(model: Path, words: int, rounds: int, openwebui: int, pin: bool = False) -> tuple[dict, dict | None]:
    """``pin``: see benchmarks.common.two_stage_mesh."""
    with two_stage_mesh(model, CTX, pin=pin) as (client, url, logs):
        ttft = run_client([url, model.name, str(words), str(rounds), "ttft"], client)
        owui = run_client([url, model.name, str(words), str(openwebui), "openwebui"], client) if openwebui else None
        for log in logs:
            lost = log.read_text().count("generation lost")
            if lost:
                print(f"{log.parent.name}: {lost} 'generation lost' lines in the log")
        return ttft, owui


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--openwebui", type=int, default=0, help="rounds of the openai-client pattern on 2 stages")
    ap.add_argument("--only", choices=("one", "two"))
    ap.add_argument(
        "--pin",
        action="store_true",
        help="2 stages: each stage's process on its own core, as on two machines (default: both "
        "share every core, which adds contention between stages that two machines do not have)",
    )
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    args = ap.parse_args()
    from meshnode.model.build import model_dir_for

    spec = dict(MODEL)
    model = model_dir_for(args.cache, spec.pop("family"), **spec)
    words = title_words(model)
    print(f"model {model.name}; title prompt ~1000 tokens ({words} words); answer max_tokens {ANSWER_TOKENS}")
    result = {}
    if args.only != "two":
        r = one_node(model, words, args.rounds)
        result["one_node"] = r
        print(
            f"one node:  answer TTFT alone {r['alone'] * 1000:.0f} ms, beside a 1k-token title "
            f"{r['beside'] * 1000:.0f} ms: {r['beside'] / r['alone']:.2f}x (target <= 1.5x); "
            f"title {r['title']:.2f} s"
        )
    if args.only != "one":
        r, owui = two_stages(model, words, args.rounds, args.openwebui, pin=args.pin)
        result["two_stages"] = r
        print(
            f"2 stages{' (a core each)' if args.pin else ''}:  answer TTFT alone {r['alone'] * 1000:.0f} ms, "
            "beside a 1k-token title "
            f"{r['beside'] * 1000:.0f} ms: {r['beside'] / r['alone']:.2f}x (target <= 1.5x); "
            f"title {r['title']:.2f} s"
        )
        if owui is not None:
            want = reference(model)
            wrong = sum(1 for t in owui["texts"] if t != want)
            print(
                f"Open WebUI pattern, {args.openwebui} rounds on 2 stages: {len(owui['lost'])} lost, "
                f"{wrong} answers differing from mlx-lm, answer TTFT median {owui['ttft_median']:.2f} s"
            )
            result["openwebui"] = {
                "rounds": args.openwebui,
                "lost": len(owui["lost"]),
                "wrong": wrong,
                "errors": owui["lost"][:3],
            }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
