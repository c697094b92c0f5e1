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
