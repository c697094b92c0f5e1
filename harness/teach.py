"""Teach a tiny test model to say given answers: a few hundred steps of plain MLX training on the
CPU (seconds), so that greedy decoding answers each prompt with its answer token for token.

Random weights never emit a tool call or close a think block; a model taught these exchanges
does, which is what end-to-end tests of tool calls need (an agent's whole loop: the call, the
result sent back, the final answer). Overfitting a handful of sequences is the point.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten


def teach(
    model_dir: Path, exchanges: list[tuple[list[int], list[int]]], *, steps: int = 150, learning_rate: float = 1e-2
) -> float:
    """Train the model in ``model_dir`` (float32) on (prompt ids, answer ids) pairs, loss on the
    answers only, and write its weights back; returns the last loss."""
    from mlx_lm import load

    model, _ = load(str(model_dir))
    width = max(len(p) + len(a) for p, a in exchanges)
    inputs, targets, masks = [], [], []
    for prompt, answer in exchanges:
        seq = prompt + answer
        pad = width - len(seq)
        inputs.append(seq[:-1] + [0] * pad)
        targets.append(seq[1:] + [0] * pad)
        masks.append([0] * (len(prompt) - 1) + [1] * len(answer) + [0] * pad)
    x, y, m = mx.array(inputs), mx.array(targets), mx.array(masks, dtype=mx.float32)

    def loss_fn(model):
        logits = model(x)
        ce = nn.losses.cross_entropy(logits, y, reduction="none")
        return (ce * m).sum() / m.sum()

    optimizer = optim.Adam(learning_rate=learning_rate)
    value_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step():
        loss, grads = value_and_grad(model)
        optimizer.update(model, grads)
        return loss

    loss = None
    for _ in range(steps):
        loss = step()
        mx.eval(state, loss)
    for old in Path(model_dir).glob("*.safetensors"):
        old.unlink()
    weights = dict(tree_flatten(model.parameters()))
    if getattr(model.args, "tie_word_embeddings", False):
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    mx.save_safetensors(str(Path(model_dir) / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    return loss.item()
