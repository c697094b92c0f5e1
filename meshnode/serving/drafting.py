"""Drafters for speculative decoding (meshnode.serving.speculative): cheap guesses of the next tokens.

A wrong guess costs a little compute, never a different answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import mlx.nn as nn

    from meshnode.model.scheduler import TokenScheduler

log = logging.getLogger(__name__)


class Drafter(Protocol):
    # Whether asking costs nothing next to a step (asked at every token of a dry pause).
    free: bool
    # Set by a test harness (None: the head chooses): guesses per pass, passes in flight.
    fixed_k: int | None
    fixed_depth: int | None

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens now part of the request: those one forward pass confirmed, one call per pass
        (an MTP drafter pairs them with that pass's hidden states)."""

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that may follow the request's tokens."""


# A request's tokens so far -> its drafter (None: it does not speculate).
DrafterFactory = Callable[[Sequence[int]], "Drafter | None"]


class PromptLookup:
    """Proposes what followed the latest earlier occurrence of the request's last n tokens (longest n wins).

    Every n-gram's latest end is indexed as tokens arrive, so a proposal costs a few lookups.
    """

    free = True
    fixed_k: int | None = None
    fixed_depth: int | None = None

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
                    ends[tuple(t[end - n : end])] = end
        self._indexed = max(self._indexed, last_end)

    def propose(self, k: int) -> list[int]:
        t = self._tokens
        size = len(t)
        if k <= 0 or size < self.shortest + 1:
            return []
        self._index(size - 1)  # every n-gram with a token after it (not the request's last one)
        for n in range(min(self.longest, size - 1), self.shortest - 1, -1):
            end = self._ends[n].get(tuple(t[size - n :]))
            if end is not None:
                return t[end : end + k]
        return []


class DraftModel:
    """The ``draft_model`` setting's model, loaded whole and shared by the node's requests."""

    def __init__(self, model: nn.Module, name: str):
        from mlx.utils import tree_flatten
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        if not can_trim_prompt_cache(make_prompt_cache(model)):
            raise ValueError(f"draft model {name}: its caches cannot be cut back (recurrent layers)")
        self.model, self.name = model, name
        self.nbytes = sum(v.nbytes for v in dict(tree_flatten(model.parameters())).values())
        self.vocab_size = int(getattr(model.args, "vocab_size", 0) or 0)

    @classmethod
    def load(cls, name: str) -> DraftModel:
        from mlx_lm import load

        model = load(name)[0]
        return cls(model, name)

    def drafter(self, tokens: Sequence[int]) -> ModelDrafter:
        return ModelDrafter(self.model, tokens)


async def load_draft(
    name: str | None, scheduler: TokenScheduler, model_id: str | None, vocab_size: int | None
) -> DraftModel | None:
    """The draft model ``name`` for ``model_id``; None, logged, where it cannot serve (requests then decode without)."""
    if not name:
        log.error('speculative = "draft_model" needs draft_model (a folder or a Hub id); speculation is off')
        return None
    try:
        draft = await scheduler.call(lambda: DraftModel.load(name))
    except Exception as exc:  # noqa: BLE001 - a bad draft model must not stop the node
        log.error("draft model %s could not be loaded (%s: %s); speculation is off", name, type(exc).__name__, exc)
        return None
    if vocab_size and draft.vocab_size != vocab_size:
        log.error(
            "draft model %s has a vocabulary of %d, %s has %d; speculation is off",
            name,
            draft.vocab_size,
            model_id,
            vocab_size,
        )
        return None
    log.info(
        "draft model %s loaded for %s: %.1f MiB, taken off the memory offered", name, model_id, draft.nbytes / 2**20
    )
    return draft


class ModelDrafter:
    """Greedy guesses of a draft model, its cache cut back to the confirmed positions each pass."""

    PREFILL = 512  # positions per step when it catches up with a prompt
    free = False  # each guess is a step of the draft model
    fixed_k: int | None = None
    fixed_depth: int | None = None

    def __init__(self, model: nn.Module, tokens: Sequence[int]):
        from mlx_lm.models.cache import make_prompt_cache

        self._model = model
        self._cache = make_prompt_cache(model)
        self._seq: list[int] = list(tokens)  # the request's tokens
        self._fed: list[int] = []  # the tokens whose positions are in the cache
        self._valid = 0  # how many of _fed are known to equal the request's

    def extend(self, tokens: Sequence[int]) -> None:
        self._seq.extend(tokens)

    def propose(self, k: int) -> list[int]:
        import mlx.core as mx
        from mlx_lm.models.cache import trim_prompt_cache

        from meshnode.model.shard import any_thread_stream

        if k <= 0:
            return []
        fed, seq = self._fed, self._seq
        common = self._valid
        while common < min(len(fed), len(seq)) and fed[common] == seq[common]:
            common += 1
        common = min(common, len(seq) - 1)  # the last token is fed again for the first guess
        if len(fed) > common:
            trim_prompt_cache(self._cache, len(fed) - common)
            del fed[common:]
        feed = seq[common:]
        guesses: list[int] = []
        with mx.stream(any_thread_stream()):
            for i in range(0, len(feed) - 1, self.PREFILL):
                self._model(mx.array([feed[i : min(i + self.PREFILL, len(feed) - 1)]]), cache=self._cache)
                mx.eval([c.state for c in self._cache])
            step = feed[-1:]
            for _ in range(k):
                logits = self._model(mx.array([step]), cache=self._cache)
                guesses.append(cast(int, mx.argmax(logits[0, -1]).item()))
                step = guesses[-1:]
        fed.extend(feed)
        fed.extend(guesses[:-1])
        self._valid = len(seq)
        return guesses
