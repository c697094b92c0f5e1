"""How one request samples: what it asks (:class:`SamplingParams`), its sampler, logits
processors and log-probabilities from mlx-lm's pieces, and :class:`Sampled`, a token id with its
log-probabilities.

Two differences keep the answer equal to ``mlx_lm.generate`` on the whole prompt: the penalties also
see the prompt's tail (prefilled before ``generate_step``), and a seeded request draws token ``i``
from a key of ``(seed, i)`` alone, reproducible beside other requests and across a failover replay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from meshnode.serving.grammar import GrammarProcessor

if TYPE_CHECKING:
    from mlx_lm.sample_utils import LogitsProcessor
    from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: limits, temperature, filters, penalties, seed, logprobs, grammar."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # Tokens before a failover replay, so a seeded draw resumes.
    offset: int = 0
    # mlx-lm's other filters (0: off) and logits processors (None: off).
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Log-probabilities with this many alternatives (-1: none).
    top_logprobs: int = -1
    # An llguidance grammar the answer follows ("": none).
    grammar: str = ""

    @property
    def processed(self) -> bool:
        """Whether any logits processor runs (penalties, a bias, a grammar)."""
        return (
            bool(self.logit_bias)
            or bool(self.grammar)
            or any(p for p in (self.presence_penalty, self.frequency_penalty, self.repetition_penalty))
        )

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs >= 0


class Sampled(int):
    """A token id with its log-probability and ``top`` alternatives; an ``int``, so token sources
    pass it on unchanged."""

    logprob: float
    top: tuple[tuple[int, float], ...]

    def __new__(cls, token: int, logprob: float, top: tuple[tuple[int, float], ...] = ()) -> Sampled:
        self = super().__new__(cls, token)
        self.logprob, self.top = logprob, top
        return self


# How far back each penalty looks (make_logits_processors' default).
PENALTY_CONTEXT = 20


def make_request_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler; with a seed, the same filters drawn from the request's own keys."""
    sample, index = make_indexed_sampler(params), params.offset

    def step(logprobs: mx.array) -> mx.array:
        nonlocal index
        index += 1
        return sample(logprobs, index - 1)

    return step


def make_indexed_sampler(params: SamplingParams) -> Callable[[mx.array, int], mx.array]:
    """``sample(logprobs, index)`` draws token ``index``; seeded, from (seed, index) alone, so a
    speculative pass draws each position as one-at-a-time decoding would."""
    if params.seed is None or params.temperature == 0:
        plain = make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)
        return lambda logprobs, index: plain(logprobs)
    # Any int64 seed (OpenAI's range), folded into the key's uint64.
    seed = params.seed % 2**64
    top_p, min_p, top_k, inv_temp = params.top_p, params.min_p, params.top_k, 1.0 / params.temperature

    def sample(logprobs: mx.array, index: int) -> mx.array:
        key = draw_key(seed, index)
        # mlx-lm's make_sampler order: top_p, min_p, top_k.
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p != 0.0:
            logprobs = apply_min_p(logprobs, min_p)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        return mx.random.categorical(logprobs * inv_temp, key=key)

    return sample


def draw_key(seed: int, index: int) -> mx.array:
    """The random key of token ``index`` of a generation seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little"))


def make_request_processors(
    params: SamplingParams, before: Sequence[int], tokenizer: TokenizerWrapper | None = None
) -> list[LogitsProcessor] | None:
    """mlx-lm's logits processors for ``params``, the grammar last; ``before``: prompt tokens
    generate_step is not fed, whose tail the penalties see."""
    if not params.processed:
        return None
    grammar = []
    if params.grammar:
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer where it samples")
        grammar = [GrammarProcessor(params.grammar, tokenizer)]
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=params.presence_penalty,
        presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=params.frequency_penalty,
        frequency_context_size=PENALTY_CONTEXT,
    )
    tail = list(before)[-PENALTY_CONTEXT:]
    if not tail:
        return processors + grammar
    head = mx.array(tail, dtype=mx.uint32)

    def with_tail(processor: LogitsProcessor) -> LogitsProcessor:
        return lambda tokens, logits: processor(mx.concat([head, tokens.astype(mx.uint32)]), logits)

    return [with_tail(p) for p in processors] + grammar


def sampled(token: int, logprobs: mx.array, top: int) -> Sampled:
    """``token`` with its log-probability and the ``top`` likeliest tokens (after the processors,
    before the filters, as mlx_lm.server reports them)."""
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
        values = logprobs[ids]
        order = mx.argsort(-values)
        best = tuple(zip(cast(list[int], ids[order].tolist()), cast(list[float], values[order].tolist())))
    return Sampled(token, cast(float, logprobs[token].item()), best)
