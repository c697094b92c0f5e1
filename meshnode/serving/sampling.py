"""What a request asks of the sampler: a plain dataclass every part can import (the API builds
it, a remote head receives it in a GenerateRequest, failover carries it over), with no MLX."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # Tokens of this generation already produced elsewhere: a replay after failover passes how many
    # it carries over, so a seeded draw continues where it was instead of starting again.
    offset: int = 0
