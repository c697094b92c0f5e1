"""Speculative decoding across a 2-stage mesh against one process, in the same run.

    sudo .venv/bin/python -m benchmarks.speculative [--tokens 48] [--rounds 3] [--entry relay|head|both]
        [--fixed K,DEPTH ...] [--json out.json]
    .venv/bin/python -m benchmarks.speculative --loopback --mlx-cores all [--size bench|1b] ...   (a lent GPU)

Random weights make any real drafter's acceptance unpredictable, so acceptance is controlled: the
head's drafter is the test one (harness.drafts.ReferenceDrafter, given to the nodes as a test hook)
proposing the reference continuation (mlx-lm's greedy answer, computed first), each guess right
with probability p = 0, 0.5, 0.8, 1.0 (the same guesses at the same positions in every run). The
same guesses drive mlx-lm's own speculative decoding in this process (a stand-in draft model that
returns them: no draft compute on either side). Prompt lookup, the real drafter, runs on the same
request too (random weights rarely repeat themselves, so it shows what speculation costs when its
guesses find nothing).

Two meshnode processes on namespace hosts, each pinned to a core of its own (two "machines"),
serve the bench model in 2 pipeline stages; mlx-lm runs in this process, pinned to one core (one
machine: ``--mlx-cores all`` gives it every core, as if one machine had both). ``--loopback`` (with
``--mlx-cores all``) puts both nodes on 127.0.0.1 unpinned and needs no root or namespaces: for a
lent GPU (MLX's CUDA build), where the two processes share the one device and the figures are its
absolute tokens/s and what the split adds per token (``--size 1b``: a model big enough that its
step is the GPU's compute, not its kernel launches). The head keeps a
pass of guesses in flight behind the one being checked (meshnode.serving.passes), so both stages
compute at once while the guesses come right. Each round measures, in
turns: plain mlx-lm, mlx-lm's speculation at each p, the mesh without speculation, the mesh with
the test drafter at each p, the mesh with prompt lookup. Decode speed is timed from the first
streamed token to the last; every mesh answer is checked equal to mlx-lm's (greedy). Prints one
line per p: ``p=0.8 mesh/plain 1.62 mesh/mlx-spec 0.97 spec/nospec 1.71`` (medians of the rounds'
ratios: 2-stage speculative decode over plain mlx-lm, over mlx-lm's own speculation, over the
same mesh without speculation), and the head's acceptance and tokens per pass. ``--fixed 0,2 1,2``
also measures, in the same rounds, the mesh with k guesses in every pass and at most DEPTH passes in
flight (the test drafter's ``k`` and ``depth``: what the head's own choice of both is up against).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    PROMPT,
    STREAM_CHAT,
    bench_model_dir,
    exact_backend,
    first_difference,
    mlx_device,
    two_stage_mesh,
)
from harness.drafts import reference_guess  # noqa: E402

PS = (0.0, 0.5, 0.8, 1.0)
# changes to the bench model: "1b" is a model whose step a GPU's compute, not its launches, dominates
# (float32 as the bench model, where rounding seldom flips a greedy token; on a GPU it still can: docs/speculative.md)
SIZES = {
    "bench": {},
    "1b": dict(num_layers=24, hidden_size=2048, intermediate_size=5632, num_heads=16, num_kv_heads=8),
    # a step as short on a CPU as a GPU's: what the machinery adds per step shows
    "tiny": dict(num_layers=4, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2),
}
SEED = 11
MLX_K = 4  # mlx-lm's draft tokens per pass (its default is 2; 4 suits guesses right 80% of the time)

CLIENT = (
    STREAM_CHAT
    + r"""
import sys
url, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
first, total, text = stream_chat(url, model, [{"role": "user", "content": sys.argv[4]}], n)
print(json.dumps({"first": first, "total": total, "text": text}))
"""
)


class GuessModel:
    """A stand-in draft model for mlx-lm's speculative decoding that returns ReferenceDrafter's
    guesses: fed the token at position i, its logits pick the guess for position i + 1."""

    def __init__(self, answer: list[int], p: float, vocab: int):
        self.answer, self.p, self.vocab = answer, p, vocab
        self.layers = [None]

    def make_cache(self):
        from mlx_lm.models.cache import KVCache

        return [KVCache()]

    def __call__(self, inputs, cache):
        import mlx.core as mx

        n = inputs.shape[1]
        start = cache[0].offset
        cache[0].update_and_fetch(mx.zeros((1, 1, n, 1)), mx.zeros((1, 1, n, 1)))
        ids = [
            reference_guess(self.answer, i + 1, self.p, SEED, self.vocab) if i + 1 < len(self.answer) else 0
            for i in range(start, start + n)
        ]
        return mx.where(mx.arange(self.vocab)[None, None, :] == mx.array(ids)[None, :, None], 30.0, 0.0)


def position_cost(model, prompt, positions: int = 5, repeats: int = 3) -> float:
    """What each further position of a step costs against a one-position step, in mlx-lm on the
    whole model here: what speculation's guesses cost (~0 where a step streams the weights once
    for all positions, as on a GPU; ~1 where every position is computed anew)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    best = {}
    for n in (1, positions):
        for _ in range(repeats):
            started = time.perf_counter()
            mx.eval(model(mx.array([prompt[-n:]]), cache=cache))
            best[n] = min(best.get(n, 1e9), time.perf_counter() - started)
            trim_prompt_cache(cache, n)
    return (best[positions] / best[1] - 1) / (positions - 1)


def mlx_decode(model, tokenizer, prompt, n: int, draft=None) -> float:
    from mlx_lm import stream_generate

    kw = {"draft_model": draft, "num_draft_tokens": MLX_K} if draft is not None else {}
    times = [time.perf_counter() for _ in stream_generate(model, tokenizer, prompt, max_tokens=n, **kw)]
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "meshnode" / "bench")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--p", type=float, nargs="+", default=list(PS), help="the acceptances to measure")
    ap.add_argument(
        "--mlx-cores",
        choices=("one", "all"),
        default="one",
        help="mlx-lm on one core (one machine, as each mesh node) or on every core",
    )
    ap.add_argument(
        "--entry",
        choices=("relay", "head", "both"),
        default="relay",
        help="the node the client asks: the first stage's, which relays to the head (as a "
        "client that asks any node), the head's, or both in turns (rows 'via head')",
    )
    ap.add_argument(
        "--fixed",
        nargs="*",
        default=[],
        metavar="K,DEPTH",
        help="also measure k guesses in every pass and at most DEPTH passes in flight (rows 'k=K depth=D')",
    )
    ap.add_argument(
        "--loopback",
        action="store_true",
        help="both nodes on 127.0.0.1 and unpinned, the client here: no namespaces, no root (a lent GPU, "
        "where the two processes share one device)",
    )
    ap.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="bench",
        help="the bench model (~100M, float32), or a ~1.1B one for a GPU",
    )
    args = ap.parse_args()
    if args.loopback and args.mlx_cores == "one":  # the nodes, started from here, would inherit that core
        ap.error("--loopback runs everything on one machine: give it every core (--mlx-cores all)")
    ps = tuple(args.p)
    fixed = [tuple(int(v) for v in f.split(",")) for f in args.fixed]
    # (row suffix, the test drafter's settings beyond p): the head's own choice, then each --fixed
    ways = [("", {})] + [(f" k={k} depth={d}", {"k": k, "depth": d}) for k, d in fixed]

    import os

    cores = sorted(os.sched_getaffinity(0))
    if args.mlx_cores == "one":  # before MLX starts its threads: they inherit it
        os.sched_setaffinity(0, {cores[0]})

    import platform

    from mlx_lm import load, stream_generate

    from harness.cluster import in_ns

    messages = [{"role": "user", "content": PROMPT}]
    for seed in range(4):  # random weights: the first seed whose greedy answer runs past --tokens
        model_dir = bench_model_dir(args.cache, **SIZES[args.size], **({"seed": seed} if seed else {}))
        model, tokenizer = load(str(model_dir))
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        reference = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=args.tokens + 16)]
        if len(reference) >= args.tokens and tokenizer.eos_token_id not in reference[: args.tokens]:
            break
    else:
        print("the reference answer ends early with every seed tried; pick another --tokens", file=sys.stderr)
        return 1
    vocab = model.args.vocab_size
    text = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=args.tokens))
    answer = list(prompt) + reference
    cost = position_cost(model, prompt)
    print(
        f"# {platform.platform()} ({os.cpu_count()} CPUs), MLX on {mlx_device()}, mlx-lm on "
        f"{'one core' if args.mlx_cores == 'one' else 'every core'}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {model_dir.name}; {args.tokens} tokens; "
        f"{args.rounds} rounds",
        flush=True,
    )

    rows: dict[str, list[float]] = {}
    stats: dict[str, dict] = {}

    def note(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        drafts = Path(tmp) / "drafts.json"
        drafts.write_text(json.dumps({"off": True}))
        env = {"MESHNODE_SPECULATIVE": "prompt_lookup"}
        with two_stage_mesh(
            model_dir, 1024, pin=not args.loopback, env=env, cores=cores, loopback=args.loopback, drafts=drafts
        ) as (client, url, logs):
            relay_url, head_url = url, head_url_of(client, url)
            entries = {
                "relay": [("", relay_url)],
                "head": [("", head_url)],
                "both": [("", relay_url), (" via head", head_url)],
            }[args.entry]

            def mesh(label: str, spec: dict, url: str = entries[0][1]) -> float:
                tps, stats[label] = mesh_request(
                    client,
                    head_url,
                    drafts,
                    spec,
                    text,
                    label,
                    args.tokens,
                    lambda: in_ns(client, CLIENT, url, model_dir.name, args.tokens, PROMPT, timeout=900),
                )
                return tps

            for _, entry in entries:  # the nodes' first request (kernels compiled) takes core time
                mesh("warm-up", {"off": True}, entry)
                # ...and their first passes of several positions, and cuts of the caches, compile theirs
                # (which would otherwise slow the first measured round). The costs of a pass are then
                # measured, as on a node that has served a while.
                mesh("warm-up speculating", {"p": 0.5, "seed": SEED, "vocab": vocab, "answers": [answer]}, entry)
            print(
                f"the client asks {' and '.join(name for name in ('relay', 'head') if args.entry in (name, 'both'))}"
                f" ({relay_url if args.entry != 'head' else head_url}"
                f"{' and ' + head_url if args.entry == 'both' else ''})",
                flush=True,
            )
            from harness.cluster import mesh_view

            split = ", ".join(
                f"layers {s['start_layer']}-{s['end_layer'] - 1} on {s['nodes'][0]}"
                for s in mesh_view(url, client=client, timeout=10)["plan"]["stages"]
            )
            print(f"the plan: {split} (the head last)", flush=True)
            for r in range(args.rounds):
                plain = mlx_decode(model, tokenizer, prompt, args.tokens)
                note("mlx plain", plain)
                for via, entry in entries:
                    nospec = mesh("nospec" + via, {"off": True}, entry)
                    note("mesh nospec" + via, nospec)
                    note("nospec/plain" + via, nospec / plain)
                for p in ps:
                    mlx_spec = mlx_decode(model, tokenizer, prompt, args.tokens, GuessModel(answer, p, vocab))
                    note(f"mlx-spec p={p}", mlx_spec)
                    for (via, entry), (way, settings) in itertools.product(entries, ways):
                        spec_tps = mesh(
                            f"p={p}{way}{via}",
                            {"p": p, "seed": SEED, "vocab": vocab, "answers": [answer], **settings},
                            entry,
                        )
                        note(f"mesh p={p}{way}{via}", spec_tps)
                        note(f"p={p}{way}{via} mesh/plain", spec_tps / plain)
                        note(f"p={p}{way}{via} mesh/mlx-spec", spec_tps / mlx_spec)
                        note(f"p={p}{way}{via} spec/nospec", spec_tps / rows["mesh nospec" + via][-1])
                lookup = mesh("prompt lookup", {"prompt_lookup": True})
                note("mesh prompt lookup", lookup)
                note("lookup/nospec", lookup / nospec)
                print(
                    f"round {r + 1}: mlx-lm {plain:.2f} tok/s, "
                    + ", ".join(
                        f"mesh without speculation{via} {rows['mesh nospec' + via][-1]:.2f}, "
                        + ", ".join(
                            f"p={p}{way}{via} {rows[f'mesh p={p}{way}{via}'][-1]:.2f}" for p in ps for way, _ in ways
                        )
                        for via, _ in entries
                    )
                    + f", prompt lookup {lookup:.2f}",
                    flush=True,
                )
            measured = mesh_view(head_url, client=client, timeout=10)["metrics"]["speculation"]

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(
        "\n| p | mesh tok/s | mlx-lm spec tok/s | mesh/plain | mesh/mlx-spec | spec/nospec | acceptance | tokens/pass |"
    )
    print("|---|---|---|---|---|---|---|---|")
    vias = [via for via, _ in entries]
    rowed = [way + via for via in vias for way, _ in ways]
    for p in ps:
        for via in rowed:
            acc, per = pass_figures(stats[f"p={p}{via}"])
            print(
                f"| {p}{via} | {med[f'mesh p={p}{via}']:.2f} | {med[f'mlx-spec p={p}']:.2f} | "
                f"{med[f'p={p}{via} mesh/plain']:.2f} | {med[f'p={p}{via} mesh/mlx-spec']:.2f} | "
                f"{med[f'p={p}{via} spec/nospec']:.2f} | {acc:.2f} | {per:.2f} |"
            )
    print(f"\neach further position of a step costs {cost:.2f} of a one-position step here (mlx-lm, whole model)")
    share = measured.get("filled_share")
    print(
        f"the head measured: a further position of a pass {measured.get('position_cost')} of a one-position pass; "
        + (
            f"a full pipeline yields a pass every {share} of a lone pass's traversal "
            f"(1 / stages where the stages compute at once)"
            if share is not None
            else "no full pipeline timed"
        )
    )
    print(
        f"mlx-lm plain {med['mlx plain']:.2f} tok/s; "
        + "; ".join(
            f"mesh without speculation{via} {med['mesh nospec' + via]:.2f} ({med['nospec/plain' + via]:.2f}x plain)"
            for via in vias
        )
        + f"; prompt lookup {med['mesh prompt lookup']:.2f} ({med['lookup/nospec']:.2f}x without)"
    )
    for via in vias:  # what the split adds to each token: its hops, serialization, HTTP and relay
        print(
            f"the 2-stage split{via} adds {1000 / med['mesh nospec' + via] - 1000 / med['mlx plain']:.2f} ms per token "
            f"to mlx-lm's {1000 / med['mlx plain']:.2f} ms (MLX on {mlx_device()})"
        )
    for p in ps:
        for via in rowed:
            print(
                f"p={p}{via} mesh/plain {med[f'p={p}{via} mesh/plain']:.2f} "
                f"mesh/mlx-spec {med[f'p={p}{via} mesh/mlx-spec']:.2f} "
                f"spec/nospec {med[f'p={p}{via} spec/nospec']:.2f}"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "medians": med,
                    "rounds": rows,
                    "last_round_passes": stats,
                    "position_cost": cost,
                    "head_measured": measured,
                },
                indent=1,
            )
        )
    return 0


def mesh_request(
    client, head_url: str, drafts: Path, spec: dict, want: str, label: str, tokens: int, ask: Callable[[], dict]
) -> tuple[float, dict]:
    """One request to a benchmark's mesh with the test drafter file (harness/drafts.py) set to
    ``spec``: its decode tokens/s (first streamed token to the last) and what it moved of the
    head's speculation counters. ``ask()``: the client's JSON (first, total, text), whose text must
    be ``want`` (mlx-lm's answer)."""
    drafts.write_text(json.dumps(spec))
    before = speculation_counters(client, head_url)
    out = ask()
    if out["text"] != want:
        if exact_backend():
            raise SystemExit(f"{label}: the mesh's answer differs from mlx-lm's:\n{out['text']!r}\n{want!r}")
        # On a GPU or OpenBLAS mlx-lm's own greedy answer depends on how the work is cut (prompt chunks,
        # positions per step: benchmarks/greedy_invariance.py), so it is reported, not fatal; the test drafter's
        # guesses (mlx-lm's answer) are wrong after that point, which only slows the request.
        print(
            f"{label}: the mesh's answer left mlx-lm's at character {first_difference(out['text'], want)} "
            f"of {len(want)}",
            flush=True,
        )
    after = speculation_counters(client, head_url)
    return (tokens - 1) / (out["total"] - out["first"]), {k: after[k] - before[k] for k in after}


def pass_figures(moved: dict) -> tuple[float, float]:
    """(acceptance, tokens per pass) of what requests moved of the speculation counters (nan: none)."""
    acc = moved["accepted"] / moved["drafted"] if moved["drafted"] else float("nan")
    return acc, moved["tokens"] / moved["passes"] if moved["passes"] else float("nan")


def head_url_of(client, url) -> str:
    """The HTTP address of the plan's head (its last stage), as the node at ``url`` sees the mesh."""
    from harness.cluster import mesh_view

    view = mesh_view(url, client=client, timeout=10)
    head = view["plan"]["stages"][-1]["nodes"][0]
    node = next(n for n in view["nodes"] if n["node_id"] == head)
    return f"http://{node['address']}:{node['http_port']}"


def speculation_counters(client, head_url) -> dict:
    """The head's speculation counters (its /metrics)."""
    from harness.cluster import mesh_view

    s = mesh_view(head_url, client=client, timeout=10)["metrics"]["speculation"]
    return {k: s[k] for k in ("passes", "drafted", "accepted", "tokens")}


if __name__ == "__main__":
    sys.exit(main())
