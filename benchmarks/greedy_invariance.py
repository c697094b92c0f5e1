"""Is mlx-lm's own greedy answer the same however the work is cut, on this device?

    .venv/bin/python -m benchmarks.greedy_invariance [--size bench|1b] [--tokens 160] [--seed 0]

A mesh cuts a prompt into chunks (meshnode/serving/prefill.py sizes them from measured speeds:
16 to a few hundred positions) and, speculating, checks k + 1 positions in one step. Where the
device rounds a matrix product differently for different shapes, either can move a logit by an ulp,
and where the model's top two logits are that close, the greedy token changes and the rest of the
answer with it. This runs mlx-lm alone, in one process, three ways against its default (the prompt
in one 2048-position chunk, one position per step): the prompt in chunks of 64 and of 16, and
mlx-lm's own speculative decoding with the model drafting for itself (every step computes 5
positions, all accepted). It prints, for each, where its answer first leaves the default's and the
gap between the default's top two logits there. No way changes what is computed, only how it
is rounded, so an answer that leaves the default's was flipped at such a close call by rounding.
On MLX's CPU build with its own reference BLAS, which computes a row's result whatever the shape it
is part of, every way gives the same answer.
"""

from __future__ import annotations

import sys
import time

from benchmarks.common import PROMPT, bench_model_dir, first_difference, mlx_device, parse_args
from benchmarks.speculative import SIZES


def top_gap(model, prompt: list[int], answer: list[int], at: int) -> float:
    """The gap between the two largest logits of the step that chose ``answer[at]``, in one pass."""
    import mlx.core as mx

    logits = model(mx.array([prompt + answer[:at]]))[0, -1].astype(mx.float32)
    top = mx.sort(logits)[-2:]
    return float(top[1] - top[0])


def main() -> int:
    def more(ap):
        ap.add_argument("--size", choices=sorted(SIZES), default="bench")
        ap.add_argument("--seed", type=int, default=0)

    args = parse_args(__doc__, more)
    from mlx_lm import load, stream_generate

    path = bench_model_dir(args.cache, **SIZES[args.size], **({"seed": args.seed} if args.seed else {}))
    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)

    def answer(**kw) -> list[int]:
        return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=args.tokens, **kw)]

    print(
        f"# MLX on {mlx_device()}, {path.name}, prompt {len(prompt)} tokens, {args.tokens} tokens, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        flush=True,
    )
    default = answer()
    ways = {
        "prompt in chunks of 64": dict(prefill_step_size=64),
        "prompt in chunks of 16": dict(prefill_step_size=16),
        "mlx-lm speculating, 4 drafts, all right": dict(draft_model=model, num_draft_tokens=4),
        "the default again": {},
    }
    same = True
    for name, kw in ways.items():
        other = answer(**kw)
        at = first_difference(default, other)
        if at is None:
            print(f"{name}: the same {len(default)} tokens")
            continue
        same = False
        print(
            f"{name}: leaves the default's answer at token {at} of {len(default)}; the default's top two "
            f"logits there are {top_gap(model, prompt, default, at):.2e} apart"
        )
    print("every way gives the default's answer" if same else "the answer depends on how the work is cut here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
