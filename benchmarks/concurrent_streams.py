"""Continuous batching benchmark: N concurrent streaming chats on one node against mlx_lm.server.

N clients (threads here) each stream one greedy chat of ~``--tokens`` tokens at the same moment;
the aggregate figure is all completion tokens (from the usage chunk) over the wall time from the
first request sent to the last stream ended (prefill included). Single-stream decode tokens/s is
benchmarks.common.http_decode_tps (first text chunk to last chunk, best of 3). Both servers run
the same model, one after the other (never at once), in this run:
  - ``mlx_lm.server`` (batches concurrent requests with mlx-lm's BatchGenerator),
  - meshnode on one node (``meshnode run``; setting ``batching``, on by default).
Targets: aggregate >= 1.0x mlx_lm.server; single stream >= 0.95x. Each server's answers are
checked to be the same text (greedy).

``--two-stages`` (root): also a 2-stage mesh (two ``meshnode run`` processes on namespace hosts, the
client on a third; ``--pin``: a core each), with concurrent decode steps taking turns (the default)
and with ``lockstep`` (micro-batches through both stages, meshnode.serving.lockstep); target:
4 streams' aggregate >= 2.5x one stream, here taken while all four decode (prefill left out), on
chats whose greedy answers run to ``--tokens`` (:func:`long_prompts`).
``--small``: a model a third as wide, whose per-token costs (hops, Python) weigh as a bigger model's
do on a fast GPU.

    .venv/bin/python -m benchmarks.concurrent_streams [--streams 4] [--tokens 128] [--repeats 2]
    sudo .venv/bin/python -m benchmarks.concurrent_streams --two-stages [--pin] [--only-two] [--small]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    bench_model_dir,
    http_decode_tps,
    local_node,
    mlx_lm_server,
    sse_events,
    two_stage_mesh,
)

CTX = 4096
SMALL = dict(hidden_size=256, intermediate_size=688, num_heads=4, num_kv_heads=2)  # --small
TOPICS = [
    "a lighthouse keeper and the sea",
    "a clockmaker in a mountain town",
    "two rivals who become friends",
    "a robot that learns to paint",
    "the last train of the night",
    "a garden that grows in winter",
    "a map with a missing island",
    "a cat who runs a bookshop",
]


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}. " * 3 for i in range(n)]


FORMS = ("Write a long story about {0}. " * 3, "Tell me everything about {0}.", "Once upon a time there was {0}.")


def long_prompts(model: Path, n: int, tokens: int) -> list[str]:
    """``n`` chats whose greedy answer (mlx-lm's, this process) runs to ``tokens`` without ending:
    random weights end some answers early, which would shorten the 2-stage figure's window while all
    four decode (or leave none)."""
    from mlx_lm import load, stream_generate

    m, tokenizer = load(str(model))
    found = []
    for text in (form.format(topic) for form in FORMS for topic in TOPICS):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        if sum(1 for _ in stream_generate(m, tokenizer, prompt, max_tokens=tokens)) >= tokens:
            found.append(text)
            if len(found) == n:
                return found
    raise SystemExit(
        f"fewer than {n} of the candidate chats run to {tokens} tokens on {model.name}; try fewer --tokens"
    )


def stream_one(url: str, model: str, text: str, max_tokens: int) -> tuple[int, str, list[float]]:
    """(completion tokens, text, the arrival time of each text chunk) of one streamed greedy chat."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    count, out, times = None, "", []
    with urllib.request.urlopen(req, timeout=900) as r:
        for event in sse_events(r):
            if event.get("usage"):
                count = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or ():
                piece = choice["delta"].get("content")
                if piece:
                    out += piece
                    times.append(time.perf_counter())
    return (count if count is not None else len(times)), out, times


def decode_window_tps(times: list[list[float]], counts: list[int] | None = None) -> float:
    """Tokens/s of all streams together while every one of them decodes (from the last first chunk
    to the first last chunk): batched decode, without the prompts' prefill; 0 if there is no such
    window. ``times``: each stream's text chunks; a token that ends inside a character streams none
    (random weights make many), so with ``counts`` (each stream's completion tokens) a stream's
    chunks in the window count as ``count / chunks`` tokens each; without, as one."""
    start, end = max(t[0] for t in times if t), min(t[-1] for t in times if t)
    if end <= start or not all(times):
        return 0.0
    per_chunk = [c / len(t) for c, t in zip(counts, times)] if counts else [1.0] * len(times)
    return sum(w * sum(start < x <= end for x in t) for w, t in zip(per_chunk, times)) / (end - start)


def concurrent_tps(url: str, model: str, texts: list[str], max_tokens: int) -> tuple[float, float, list[str]]:
    """Aggregate completion tokens/s of ``texts`` streamed at once (prefill included), their decode
    rate together (:func:`decode_window_tps`), and their answers."""
    results: list = [None] * len(texts)
    go = threading.Barrier(len(texts) + 1)

    def client(i: int) -> None:
        go.wait()
        results[i] = stream_one(url, model, texts[i], max_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return (
        sum(c for c, _, _ in results) / wall,
        decode_window_tps([t for _, _, t in results], [c for c, _, _ in results]),
        [text for _, text, _ in results],
    )


def measure(url: str, model: str, texts: list[str], max_tokens: int, repeats: int) -> dict:
    stream_one(url, model, texts[0], 8)  # warm up
    runs = [concurrent_tps(url, model, texts, max_tokens) for _ in range(repeats)]
    single, _ = http_decode_tps(url, model, max_tokens, repeats=3, text=texts[0])
    return {
        "aggregate_tps": max(r[0] for r in runs),
        "decode_tps": max(r[1] for r in runs),
        "single_tps": single,
        "answers": runs[0][2],
        "texts": texts,
    }


def on_mlx_lm_server(model: Path, texts: list[str], max_tokens: int, repeats: int) -> dict:
    with mlx_lm_server(model) as url:
        return measure(url, str(model), texts, max_tokens, repeats)


def one_node(model: Path, texts: list[str], max_tokens: int, repeats: int) -> dict:
    with local_node(model, CTX) as url:
        return measure(url, model.name, texts, max_tokens, repeats)


# measure() in the client's namespace: argv = repository root, url, model, texts (JSON), max_tokens, repeats.
MEASURE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from benchmarks.concurrent_streams import measure
print(json.dumps(measure(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))))
"""


def two_stages(model: Path, texts: list[str], max_tokens: int, repeats: int, pin: bool, batching: bool = True) -> dict:
    """The same on a 2-stage mesh (benchmarks.common.two_stage_mesh), the client on a third host;
    ``batching``: the nodes' ``lockstep`` on (else requests take turns a step each, the default)."""
    from harness.cluster import in_ns

    env = {"MESHNODE_LOCKSTEP": "true"} if batching else None
    with two_stage_mesh(model, CTX, pin=pin, env=env) as (client, url, _):
        return in_ns(client, MEASURE, ROOT, url, model.name, json.dumps(texts), max_tokens, repeats, timeout=3600)


def mlx_lm_batch_ceiling(model: Path, rows: int, steps: int = 60) -> float:
    """Decode tokens/s of mlx-lm's own BatchGenerator in this process with ``rows`` requests (no
    server, no network): what batching can give on this machine at most."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    m, _ = load(str(model))
    gen = BatchGenerator(m, max_tokens=10**6)
    gen.insert([[1, 2, 3, 4, 5, 6, 7, 8]] * rows, max_tokens=[steps + 10] * rows)
    for _ in range(5):  # the prompts' prefill and a warm-up
        gen.next()
    t0, n = time.perf_counter(), 0
    for _ in range(steps):
        _, responses = gen.next()
        n += len(responses)
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="concurrent rounds per server (best counts)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    ap.add_argument("--two-stages", action="store_true", help="also on 2 stages (namespace hosts; needs root)")
    ap.add_argument("--pin", action="store_true", help="2 stages: a core each (benchmarks.common.two_stage_mesh)")
    ap.add_argument("--only-two", action="store_true", help="only the 2-stage mesh")
    ap.add_argument("--small", action="store_true", help="a model a third of the benchmark model's width")
    args = ap.parse_args()
    model = bench_model_dir(args.cache, **(SMALL if args.small else {}))
    texts = prompts(args.streams)
    print(f"model {model.name}; {args.streams} concurrent streaming chats of up to {args.tokens} tokens")
    runs = (
        {}
        if args.only_two
        else {
            "mlx_lm.server": on_mlx_lm_server(model, texts, args.tokens, args.repeats),
            "meshnode, one node": one_node(model, texts, args.tokens, args.repeats),
        }
    )
    if args.two_stages or args.only_two:
        long = long_prompts(model, args.streams, args.tokens)
        for name, batching in (("2 stages, lockstep", True), ("meshnode, 2 stages", False)):
            two = runs[name] = two_stages(model, long, args.tokens, args.repeats, args.pin, batching)
            print(
                f"{name}: {args.streams} streams {two['aggregate_tps']:.1f} tok/s with their prefill, "
                f"{two['decode_tps']:.1f} tok/s while all decode; one stream {two['single_tps']:.1f} tok/s: "
                f"{two['decode_tps'] / two['single_tps']:.2f}x one stream"
            )
    if args.two_stages or args.only_two:
        one, many = mlx_lm_batch_ceiling(model, 1), mlx_lm_batch_ceiling(model, args.streams)
        print(
            f"mlx-lm's BatchGenerator in one process: {args.streams} requests {many:.1f} tok/s, one {one:.1f} "
            f"tok/s: {many / one:.2f}x (what batching can give here)"
        )
    for name, r in runs.items():
        # against the first run of the same chats (mlx_lm.server's; the 2-stage runs ask long_prompts)
        base_name = next(k for k, v in runs.items() if v["texts"] == r["texts"])
        base = runs[base_name]
        # (a stream's end may hold an incomplete character: meshnode sends it as U+FFFD, mlx_lm.server drops it)
        same = (
            "same answers"
            if [a.rstrip("\ufffd") for a in r["answers"]] == [a.rstrip("\ufffd") for a in base["answers"]]
            else f"ANSWERS DIFFER from {base_name}"
        )
        print(
            f"{name:22s} aggregate {r['aggregate_tps']:7.1f} tok/s ({r['aggregate_tps'] / base['aggregate_tps']:.2f}x)"
            f"   single stream {r['single_tps']:6.1f} tok/s ({r['single_tps'] / base['single_tps']:.2f}x); {same}"
        )
    print(
        json.dumps(
            {
                k: {**v, "answers": [a[:40] for a in v["answers"]], "texts": [t[:40] for t in v["texts"]]}
                for k, v in runs.items()
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
