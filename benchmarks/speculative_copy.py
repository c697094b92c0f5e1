"""Speculative decoding with the real drafters (prompt lookup, a draft model) on a copy-heavy
workload: a 2-stage mesh against one process, in the same run.

    sudo .venv/bin/python -m benchmarks.speculative_copy [--tokens 96] [--rounds 3] [--edit-every 12]
        [--quoted-from 40]

A model asked to repeat a document with changes (a code edit, an agent quoting a file back) says
mostly what its prompt holds, which is where prompt lookup guesses right. Random weights never
copy, so the model is scripted (harness/scripted.py): the bench llama's size and cost (16 layers,
hidden 768, float32, every layer computing), with the head saying after each token of a chain of
distinct tokens the next one. The prompt (token ids, /v1/completions) is the chain as a document
with one token in every ``--edit-every`` changed, followed by the chain's first token; the answer
is the chain, which the document holds except at the changes. ``--quoted-from N``: the document
holds the chain from its N-th token on, so the answer says N tokens of its own before it quotes
(an agent that explains, then repeats a file: prompt lookup finds nothing, then runs). The draft model is a scripted
llama of 2 layers and hidden 256 with the same tokenizer that knows the chain except one
successor in every ``--draft-miss-every``.

Two meshnode processes on namespace hosts, each pinned to a core of its own, serve the model in 2
pipeline stages (the client asks the first stage's node, which relays to the head); mlx-lm runs
in this process on one core. Each round measures, in turns: plain mlx-lm, mlx-lm's speculation
with the same draft model, the mesh without speculation, with prompt lookup, with the draft
model. Every answer is checked equal to mlx-lm's. Prints the medians of the rounds' ratios and
the head's acceptance and tokens per pass.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import BENCH_MODEL, two_stage_mesh  # noqa: E402
from benchmarks.speculative import head_url_of, mesh_request, mlx_decode, pass_figures  # noqa: E402

SEED = 5
DRAFT = dict(family="llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, dtype="float32")

CLIENT = r"""
import json, sys, time, urllib.request
url, model, n, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}).encode()
t0 = time.perf_counter(); first = None; text = ""
req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=900) as r:
    for line in r:
        if line.startswith(b"data: {"):
            ev = json.loads(line[6:])
            piece = ev["choices"][0].get("text") if ev.get("choices") else None
            if piece:
                first = first or time.perf_counter()
                text += piece
end = time.perf_counter()
print(json.dumps({"first": (first or end) - t0, "total": end - t0, "text": text}))
"""


def copy_workload(root: Path, tokens: int, edit_every: int, draft_miss_every: int, quoted_from: int = 0):
    """The scripted model, its draft model and the prompt: ``(model_dir, draft_dir, prompt, chain)``;
    the prompt's document holds the chain from token ``quoted_from`` on."""
    from mlx_lm import load

    from harness.scripted import script_successors
    from meshnode.model.build import SPECIAL_TOKENS, build_model

    kw = {k: v for k, v in BENCH_MODEL.items() if k != "family"}
    model_dir = build_model(root / "copy-llama", BENCH_MODEL["family"], tie_word_embeddings=False, **kw)
    draft_dir = build_model(
        root / "copy-llama-draft",
        DRAFT["family"],
        tie_word_embeddings=False,
        **{k: v for k, v in DRAFT.items() if k != "family"},
    )
    _, tokenizer = load(str(draft_dir))  # the same tokenizer as the model's
    draw = random.Random(SEED)
    # Tokens of printable text (no special token, no lone byte of a longer character).
    ordinary = [
        i
        for i in range(len(SPECIAL_TOKENS), len(tokenizer))
        if (piece := tokenizer.decode([i])).isprintable() and piece.isascii() and piece.strip()
    ]
    draw.shuffle(ordinary)
    if len(ordinary) < 2 * tokens + 2:
        raise SystemExit(f"--tokens {tokens}: the vocabulary has {len(ordinary)} printable tokens, too few")
    chain, spare = ordinary[: tokens + 1], ordinary[tokens + 1 :]
    follows = dict(zip(chain, chain[1:]))
    script_successors(model_dir, follows)
    # The draft knows the chain but for one successor in every draft_miss_every (a token off it).
    misses = iter(spare)
    script_successors(
        draft_dir,
        {
            a: (next(misses) if i % draft_miss_every == draft_miss_every - 1 else b)
            for i, (a, b) in enumerate(follows.items())
        },
    )
    # The document: the chain with one token in every edit_every changed (never the first).
    edits = iter(reversed(spare))
    document = [next(edits) if i % edit_every == edit_every // 2 else t for i, t in enumerate(chain)]
    return model_dir, draft_dir, document[quoted_from:] + chain[:1], chain


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--edit-every", type=int, default=12, help="one token in this many of the document changed")
    ap.add_argument(
        "--draft-miss-every", type=int, default=8, help="the draft model wrong about one successor in this many"
    )
    ap.add_argument(
        "--quoted-from",
        type=int,
        default=0,
        help="the document holds the chain from this token on (the answer quotes it after that many)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[0]})  # mlx-lm on one core (one machine, as each node); before MLX starts

    from mlx_lm import load, stream_generate

    from harness.cluster import in_ns

    rows: dict[str, list[float]] = {}
    stats: dict[str, dict] = {}

    def note(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, draft_dir, prompt, chain = copy_workload(
            Path(tmp), args.tokens, args.edit_every, args.draft_miss_every, args.quoted_from
        )
        model, tokenizer = load(str(model_dir))
        draft, _ = load(str(draft_dir))
        reference = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=args.tokens)]
        if reference != chain[1 : args.tokens + 1]:
            raise SystemExit(f"the scripted model does not say its chain: {reference} against {chain[1:]}")
        text = tokenizer.decode(reference)
        print(
            f"# {platform.platform()} ({os.cpu_count()} CPUs), MLX on CPU, mlx-lm on one core, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; scripted bench llama (16 layers, hidden "
            f"768, float32); prompt {len(prompt)} tokens, one in {args.edit_every} of its document changed"
            f"{f', quoted from the answer token {args.quoted_from} on' if args.quoted_from else ''}; "
            f"draft model 2 layers, hidden 256, wrong once in {args.draft_miss_every}; {args.tokens} tokens; "
            f"{args.rounds} rounds",
            flush=True,
        )
        drafts = Path(tmp) / "drafts.json"
        drafts.write_text(json.dumps({"off": True}))
        env = {"MESHNODE_SPECULATIVE": "draft_model", "MESHNODE_DRAFT_MODEL": str(draft_dir)}
        with two_stage_mesh(model_dir, 1024, pin=True, env=env, cores=cores, drafts=drafts) as (client, url, logs):
            head_url = head_url_of(client, url)

            def mesh(label: str, spec: dict) -> float:  # spec {}: the draft model the settings load
                tps, stats[label] = mesh_request(
                    client,
                    head_url,
                    drafts,
                    spec,
                    text,
                    label,
                    args.tokens,
                    lambda: in_ns(client, CLIENT, url, model_dir.name, args.tokens, json.dumps(prompt), timeout=900),
                )
                return tps

            mesh("warm-up", {"off": True})  # the nodes' first request (kernels compiled) takes core time
            for r in range(args.rounds):
                plain = mlx_decode(model, tokenizer, prompt, args.tokens)
                mlx_spec = mlx_decode(model, tokenizer, prompt, args.tokens, draft)
                nospec = mesh("nospec", {"off": True})
                lookup = mesh("prompt lookup", {"prompt_lookup": True})
                drafted = mesh("draft model", {})
                for name, value in (
                    ("mlx plain", plain),
                    ("mlx-spec", mlx_spec),
                    ("mesh nospec", nospec),
                    ("mesh lookup", lookup),
                    ("mesh draft", drafted),
                    ("lookup/plain", lookup / plain),
                    ("lookup/nospec", lookup / nospec),
                    ("draft/plain", drafted / plain),
                    ("draft/mlx-spec", drafted / mlx_spec),
                    ("draft/nospec", drafted / nospec),
                    ("mlx-spec/plain", mlx_spec / plain),
                    ("nospec/plain", nospec / plain),
                ):
                    note(name, value)
                print(
                    f"round {r + 1}: mlx-lm {plain:.2f} tok/s, mlx-lm's speculation with the draft model "
                    f"{mlx_spec:.2f}, mesh without speculation {nospec:.2f}, prompt lookup {lookup:.2f}, "
                    f"draft model {drafted:.2f}",
                    flush=True,
                )

    med = {k: statistics.median(v) for k, v in rows.items()}

    def passes(label: str) -> str:
        acc, per = pass_figures(stats[label])
        return f"acceptance {acc:.2f}, {per:.2f} tokens per pass"

    print(
        f"\nmlx-lm plain {med['mlx plain']:.2f} tok/s; mlx-lm's speculation with the draft model "
        f"{med['mlx-spec']:.2f} ({med['mlx-spec/plain']:.2f}x plain); mesh without speculation "
        f"{med['mesh nospec']:.2f} ({med['nospec/plain']:.2f}x plain)"
    )
    print(
        f"prompt lookup: mesh {med['mesh lookup']:.2f} tok/s, mesh/plain {med['lookup/plain']:.2f}, "
        f"spec/nospec {med['lookup/nospec']:.2f} ({passes('prompt lookup')})"
    )
    print(
        f"draft model: mesh {med['mesh draft']:.2f} tok/s, mesh/plain {med['draft/plain']:.2f}, "
        f"mesh/mlx-spec {med['draft/mlx-spec']:.2f}, spec/nospec {med['draft/nospec']:.2f} "
        f"({passes('draft model')})"
    )
    if args.json:
        args.json.write_text(json.dumps({"medians": med, "rounds": rows, "last_round_passes": stats}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
