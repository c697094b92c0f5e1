"""Models whose greedy next token depends on the last token only, through a table: for tests and
benchmarks that need a model to say something known (random weights never end an answer, never
copy their prompt), at any size.

:func:`script_successors` rewrites a float model built by ``meshnode.model.build.build_model``
(untied output head): every layer adds nothing to the residual stream (the attention's and the
MLP's output projections are zeroed, so each layer still computes what it costs), so the last
hidden state is the normed embedding of the last token; the output head's row of each scripted
next token is the hidden state of the token before it (other rows are zero). Hidden states all
have the same norm, so a token's own row scores highest.
"""

from __future__ import annotations

from pathlib import Path

SILENCED = ("o_proj.weight", "down_proj.weight")  # what each layer adds to the residual stream


def script_successors(path: Path, follows: dict[int, int], *, sharpness: float = 10.0) -> None:
    """Rewrite the model at ``path`` (one safetensors file, untied head) so that greedy decoding
    follows ``follows``: after token ``a`` it says ``follows[a]``."""
    import mlx.core as mx
    from mlx_lm import load

    if len(set(follows.values())) != len(follows):
        raise ValueError("two tokens are scripted to the same next token (a row of the head can say only one)")
    model, _ = load(str(path))
    if getattr(model.args, "tie_word_embeddings", False):
        raise ValueError(f"{path}: a scripted model needs an untied output head")
    [weights] = list(Path(path).glob("*.safetensors"))
    tensors = mx.load(str(weights))
    for name in tensors:
        if name.endswith(SILENCED):
            tensors[name] = mx.zeros_like(tensors[name])
    model.load_weights(list(tensors.items()))
    hidden = model.model(mx.array([list(follows)]))[0]
    head = mx.zeros_like(tensors["lm_head.weight"])
    head[mx.array(list(follows.values()))] = hidden.astype(head.dtype) * sharpness
    tensors["lm_head.weight"] = head
    mx.save_safetensors(str(weights), tensors, metadata={"format": "mlx"})
