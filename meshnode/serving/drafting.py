"""Drafters for speculative decoding (meshnode.serving.speculative): cheap guesses of the next tokens.

A drafter sees the request's tokens so far (prompt and answer) and proposes up to k tokens that
may come next; the pipeline checks them all in one pass and keeps the ones the model confirms.
A wrong guess costs a little compute on each stage, never a different answer.

:class:`PromptLookup` (prompt lookup decoding) needs no model and no memory: it finds the most
recent earlier place where the last few tokens occurred, and proposes what followed them there.
Code edits, agent turns and chats that quote their context repeat long runs of it, which is
where it pays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Drafter(Protocol):
    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens now part of the request (confirmed by the model)."""

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that may follow the request's tokens (fewer, or none, when it has no guess)."""


class PromptLookup:
    """Proposes what followed the most recent earlier occurrence of the request's last n tokens
    (n from ``longest`` down to ``shortest``: the longest match wins).

    Every n-gram's latest end is indexed as tokens arrive, so a proposal costs a few dictionary
    lookups however long the context is.
    """

    def __init__(self, tokens: Sequence[int], longest: int = 3, shortest: int = 2):
        if not 1 <= shortest <= longest:
            raise ValueError(f"n-gram lengths {shortest}..{longest}")
        self.longest, self.shortest = longest, shortest
        self._tokens: list[int] = list(tokens)
        # n -> n-gram -> the index just past its latest occurrence that has a token after it
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(shortest, longest + 1)}
        self._indexed = 0  # n-grams ending at indexes <= this are in _ends

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(tokens)

    def _index(self, last_end: int) -> None:
        t = self._tokens
        for end in range(self._indexed + 1, last_end + 1):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(t[end - n:end])] = end
        self._indexed = max(self._indexed, last_end)

    def propose(self, k: int) -> list[int]:
        t = self._tokens
        size = len(t)
        if k <= 0 or size < self.shortest + 1:
            return []
        self._index(size - 1)  # every n-gram with a token after it (not the request's last one)
        for n in range(min(self.longest, size - 1), self.shortest - 1, -1):
            end = self._ends[n].get(tuple(t[size - n:]))
            if end is not None:
                return t[end:end + k]
        return []


TEST_DRAFTS_ENV = "MESHNODE_TEST_DRAFTS"


class ReferenceDrafter:
    """For tests and benchmarks only: guesses from known answers, each guess right with probability
    ``p``, so acceptance is controlled (random weights make any real drafter's unpredictable).

    Off unless the environment variable ``MESHNODE_TEST_DRAFTS`` names a JSON file
    ``{"p": 0.8, "seed": 1, "vocab": 512, "answers": [[token ids of a prompt and its reference answer], ...]}``
    (meshnode.serving.placements.speculation_for). A request whose tokens so far begin one of the
    answers gets that answer's next tokens, a wrong id in place of each with probability 1 - p
    (drawn from ``seed`` and the position: the same guesses in every run); any other request gets
    no guesses.
    """

    def __init__(self, tokens: Sequence[int], answers: Sequence[Sequence[int]], p: float, seed: int, vocab: int):
        import random

        self._tokens = list(tokens)
        self.p, self.seed, self.vocab = p, seed, vocab
        self._random = random.Random
        self._answer = next((list(a) for a in answers if list(a[:len(tokens)]) == self._tokens and len(a) > len(tokens)),
                            None)

    @classmethod
    def from_file(cls, path: str):
        """A drafter factory (tokens -> drafter, or None: this request does not speculate) reading
        a ``MESHNODE_TEST_DRAFTS`` file for each request, so a benchmark changes ``p`` between
        requests; ``{"off": true}`` in it: requests decode without speculation; ``{"prompt_lookup":
        true}``: they speculate with :class:`PromptLookup`."""
        import json

        def make(tokens: Sequence[int]):
            with open(path) as f:
                spec = json.load(f)
            if spec.get("off"):
                return None
            if spec.get("prompt_lookup"):
                return PromptLookup(tokens)
            return cls(tokens, spec["answers"], float(spec["p"]), int(spec.get("seed", 0)), int(spec["vocab"]))

        return make

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        answer, at = self._answer, len(self._tokens)
        if answer is None or answer[:at] != self._tokens:
            return []
        out = []
        for i in range(at, min(at + k, len(answer))):
            draw = self._random(self.seed * 1_000_003 + i)
            right = answer[i]
            out.append(right if draw.random() < self.p else (right + 1 + draw.randrange(self.vocab - 1)) % self.vocab)
        return out
