"""What a request asks of the sampler (no MLX), and :class:`Sampled`, a token id with log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __new__(cls, token: int, logprob: float, top: tuple[tuple[int, float], ...] = ()):
        self = super().__new__(cls, token)
        self.logprob, self.top = logprob, top
        return self
