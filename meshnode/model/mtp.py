"""A multi-token-prediction (MTP) head: the model's own drafter, one decoder block after the last.

Given the last layer's hidden state h_t (before the final norm) and the embedding of x_{t+1}, the head
computes ``eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)])``, runs its decoder block (the backbone
family's own, with its own KV cache), the final norm and the LM head: logits for x_{t+2}. Chained on
its own output it drafts k tokens. Layouts on disk: ``meshnode.weights.mtp_layout``; loaders:
``meshnode.model.mtp_load``.

Its cache holds one entry per position; ``settle`` cuts off those a draft chained on its own guesses.
A decode loop: ``extend`` the prompt's positions but the last; each round ``draft(hidden states of
the positions not yet fed, the token after each, k)``, verify in one pass, ``settle()``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

# (tokens so far, logits) -> logits: mlx-lm's logits processors.
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class Shared:
    """What the head borrows from the backbone: the token embedding and the LM head."""

    embed: Callable[[mx.array], mx.array]
    lm_head: Callable[[mx.array], mx.array]


@dataclass
class Draft:
    """k guessed tokens, each one's probability under the head's (processed) distribution, and
    the distributions themselves when asked for (speculative sampling needs them)."""

    tokens: list[int]
    probs: list[float]
    dists: list[mx.array] = field(default_factory=list)


def shared_from(model: nn.Module) -> Shared:
    """The embedding and LM head of an mlx-lm llama-like model (``model.model.embed_tokens``, and
    ``model.lm_head`` unless tied)."""
    embed = model.model.embed_tokens
    head = getattr(model, "lm_head", None)
    return Shared(embed=embed, lm_head=head if head is not None else embed.as_linear)


def block_class(model_type: str) -> Callable[[Any], nn.Module]:
    """The decoder block class of mlx-lm's ``model_type`` family (``TransformerBlock``)."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    block: Callable[[Any], nn.Module] | None = getattr(module, "TransformerBlock", None)
    if block is None:
        raise ValueError(f"mlx-lm family {model_type!r} has no TransformerBlock an MTP head can use")
    return block


def hidden_states(model: nn.Module, inputs: mx.array, cache: Sequence[Any] | None = None) -> tuple[mx.array, mx.array]:
    """(last layer's hidden states before the final norm, logits) of an mlx-lm llama-like model;
    ``inputs``: token ids (B, L). The head's input is the hidden state the final norm hides."""
    inner = model.model
    h = inner.embed_tokens(inputs)
    caches = list(cache) if cache is not None else [None] * len(inner.layers)
    mask = create_attention_mask(h, caches[0])
    for layer, c in zip(inner.layers, caches):
        h = layer(h, mask, cache=c)
    out = inner.norm(h)
    head = getattr(model, "lm_head", None)
    return h, head(out) if head is not None else inner.embed_tokens.as_linear(out)


class MTPHead(nn.Module):
    """One MTP layer: the two norms, the projection, a decoder block, the final norm, and the
    embedding and LM head, shared with the backbone or (``own_embed``/``own_head``) the head's own."""

    def __init__(
        self,
        args: Any,
        shared: Shared | None = None,
        *,
        own_embed: bool = False,
        own_head: bool = False,
        block: Callable[[Any], nn.Module] | None = None,
    ):
        super().__init__()  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
        dims, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(dims, eps=eps)
        self.hnorm = nn.RMSNorm(dims, eps=eps)
        self.eh_proj = nn.Linear(2 * dims, dims, bias=False)
        self.block = (block or block_class(args.model_type))(args)
        self.norm = nn.RMSNorm(dims, eps=eps)
        if own_embed:
            self.embed = nn.Embedding(args.vocab_size, dims)
        if own_head:
            self.head = nn.Linear(dims, args.vocab_size, bias=False)
        if shared is None and not (own_embed and own_head):
            raise ValueError("an MTP head without its own embedding and LM head needs the backbone's")
        # plain attributes, not children: the backbone's weights and the cache are no parameters
        self.shared = shared
        self.cache = KVCache()
        self.chained = 0  # entries the last draft chained on its own guesses
        self.args = args

    # -- the layer ------------------------------------------------------------------------------

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        if "embed" in self:
            embedded: mx.array = self.embed(tokens)
            return embedded
        assert self.shared is not None
        return self.shared.embed(tokens)

    def logits(self, out: mx.array) -> mx.array:
        """Logits of the block's output ``out`` (the final norm, then the LM head)."""
        x = self.norm(out)
        if "head" in self:
            return self.head(x)
        assert self.shared is not None
        return self.shared.lm_head(x)

    def __call__(self, hidden: mx.array, tokens: mx.array, cache: Any | None = None) -> tuple[mx.array, mx.array]:
        """(block output before the final norm, logits) for (B, L, D) hidden states and the (B, L)
        tokens that follow each; ``cache`` (None: none) gets L entries."""
        e = self.enorm(self.embed_tokens(tokens))
        x = self.eh_proj(mx.concatenate([e, self.hnorm(hidden)], axis=-1))
        out = self.block(x, create_attention_mask(x, cache), cache)
        return out, self.logits(out)

    # -- drafting -------------------------------------------------------------------------------

    @property
    def offset(self) -> int:
        """Entries in the head's cache: positions it has seen."""
        return int(self.cache.offset)

    def reset(self) -> None:
        self.cache = KVCache()
        self.chained = 0

    def trim(self, n: int) -> int:
        """Drop the cache's last ``n`` entries (rejected guesses); the number dropped."""
        n = self.cache.trim(n)
        self.chained = max(0, self.chained - n)
        return int(n)

    def settle(self) -> int:
        """Drop the entries the last draft chained on its own guesses: only the backbone's true
        hidden states stay; the verified positions come in with the next ``draft``."""
        return self.trim(self.chained)

    def extend(self, hidden: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """Feed true positions: ``hidden`` (L, D) or (1, L, D) from the backbone, ``tokens`` (L,) the
        token after each; (last output, its logits)."""
        hidden = hidden.reshape(1, -1, hidden.shape[-1])
        out, logits = self(hidden, tokens.reshape(1, -1), self.cache)
        return out[:, -1:], logits[:, -1]

    def draft(
        self,
        hidden: mx.array,
        next_tokens: mx.array | Sequence[int] | int,
        k: int,
        *,
        temperature: float = 0.0,
        logits_processors: Sequence[LogitsProcessor] = (),
        history: mx.array | None = None,
        keep_dists: bool = False,
    ) -> Draft:
        """``k`` tokens guessed after the true positions ``hidden`` (their hidden states, L of them)
        and ``next_tokens`` (the token after each; the last is the newest token): greedy at
        temperature 0, else sampled; ``history``: the tokens so far, for ``logits_processors``."""
        if not isinstance(next_tokens, mx.array):
            next_tokens = mx.array([next_tokens] if isinstance(next_tokens, int) else list(next_tokens))
        tokens = next_tokens.reshape(-1)
        out, logits = self.extend(hidden, tokens)
        seen = history if history is not None else tokens
        draft = Draft([], [])
        for i in range(k):
            if i:  # chain on the head's own output: guessed, settled off after verification
                out, logits = self.extend(out, mx.array([draft.tokens[-1]]))
                self.chained += 1
            for processor in logits_processors:
                logits = processor(seen, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if temperature > 0:
                logprobs = logprobs / temperature
                logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
                token = mx.random.categorical(logprobs)
            else:
                token = mx.argmax(logprobs, axis=-1)
            prob = mx.exp(logprobs[0, token[0]])
            mx.eval(token, prob)
            draft.tokens.append(int(token[0]))
            draft.probs.append(float(prob))
            if keep_dists:
                draft.dists.append(mx.exp(logprobs[0]))
            if logits_processors:
                seen = mx.concatenate([seen.reshape(-1), token.reshape(-1)])
        return draft

    def quantized_bits(self) -> int | None:
        """The fewest bits any of the head's quantized layers has (None: not quantized)."""
        bits = [m.bits for _, m in self.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
        return min(bits) if bits else None

    def own_bytes(self) -> dict[str, int]:
        """The head's own tensors (its names -> bytes), for ``mtp_layout.mtp_footprint``."""
        from mlx.utils import tree_flatten

        return {name: int(a.nbytes) for name, a in dict(tree_flatten(self.parameters())).items()}  # type: ignore[no-untyped-call]  # mlx's Module has no annotations
