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

import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Drafter(Protocol):
    # Whether asking costs nothing next to a step (no model: a few lookups). Such a drafter is asked
    # at every token of a pause for finding nothing, which ends once it has a guess
    # (meshnode.serving.draft_length.DraftLength.found); one with a model waits for the pause's end.
    free: bool

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

    free = True

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
    and optionally ``"k": 4``: guess that many every pass, whatever they cost (tests: passes with
    guesses and rejections on a machine where guessing does not pay), and ``"depth": 2``: at most
    that many passes in flight (benchmarks: what a cancelled pass costs at each depth).
    (meshnode.serving.placements.speculation_for). A request whose tokens so far begin one of the
    answers gets that answer's next tokens, a wrong id in place of each with probability 1 - p
    (drawn from ``seed`` and the position: the same guesses in every run); any other request gets
    no guesses.
    """

    free = True

    def __init__(self, tokens: Sequence[int], answers: Sequence[Sequence[int]], p: float, seed: int, vocab: int,
                 fixed_k: int | None = None, fixed_depth: int | None = None):
        self.fixed_k = fixed_k  # guesses per pass whatever they cost (meshnode.serving.speculative)
        self.fixed_depth = fixed_depth  # passes in flight at most, instead of the placement's
        self._tokens = list(tokens)
        self.p, self.seed, self.vocab = p, seed, vocab
        self._answer = next((list(a) for a in answers if list(a[:len(tokens)]) == self._tokens and len(a) > len(tokens)),
                            None)

    @classmethod
    def from_file(cls, path: str, configured: Callable[[Sequence[int]], Any] | None = None):
        """A drafter factory (tokens -> drafter, or None: this request does not speculate) reading
        a ``MESHNODE_TEST_DRAFTS`` file for each request, so a benchmark changes ``p`` between
        requests; ``{"off": true}`` in it: requests decode without speculation; ``{"prompt_lookup":
        true}``: they speculate with :class:`PromptLookup`; only ``{"k": 4}``: with the drafter the
        settings chose (``configured``: a draft model), that many guesses every pass."""
        import json

        def make(tokens: Sequence[int]):
            with open(path) as f:
                spec = json.load(f)
            if spec.get("off"):
                return None
            if spec.get("prompt_lookup"):
                return PromptLookup(tokens)
            if "answers" not in spec and configured is not None:
                drafter = configured(tokens)
                drafter.fixed_k = spec.get("k")
                return drafter
            return cls(tokens, spec["answers"], float(spec["p"]), int(spec.get("seed", 0)), int(spec["vocab"]),
                       spec.get("k"), spec.get("depth"))

        return make

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(tokens)

    def propose(self, k: int) -> list[int]:
        answer, at = self._answer, len(self._tokens)
        if answer is None or answer[:at] != self._tokens:
            return []
        return [reference_guess(answer, i, self.p, self.seed, self.vocab) for i in range(at, min(at + k, len(answer)))]


def reference_guess(answer: Sequence[int], i: int, p: float, seed: int, vocab: int) -> int:
    """:class:`ReferenceDrafter`'s guess at position ``i`` of ``answer``: right with probability ``p``,
    else another id of the vocabulary, drawn from (seed, i) alone (the same in every run and process)."""
    draw = random.Random(seed * 1_000_003 + i)
    right = answer[i]
    return right if draw.random() < p else (right + 1 + draw.randrange(vocab - 1)) % vocab


class DraftModel:
    """A small model with the served model's tokenizer, loaded whole on the node (``speculative =
    "draft_model"``, setting ``draft_model``: a folder or a Hub id, as mlx-lm loads it). Its weights
    are taken off the memory the node offers to the plan. Shared by the node's requests; each has
    its own KV cache (:class:`ModelDrafter`), and its steps run under the node's MLX baton."""

    def __init__(self, model, name: str):
        from mlx.utils import tree_flatten
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        if not can_trim_prompt_cache(make_prompt_cache(model)):
            raise ValueError(f"draft model {name}: its caches cannot be cut back (recurrent layers)")
        self.model, self.name = model, name
        self.nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        self.vocab_size = int(getattr(model.args, "vocab_size", 0) or 0)

    @classmethod
    def load(cls, name: str) -> "DraftModel":
        from mlx_lm import load

        model, _ = load(name)
        return cls(model, name)

    def drafter(self, tokens: Sequence[int]) -> "ModelDrafter":
        return ModelDrafter(self.model, tokens)


class ModelDrafter:
    """Greedy guesses of a draft model, its cache kept in step with the request: positions of
    guesses the served model did not confirm are cut back before the next guesses."""

    PREFILL = 512  # positions per step when it catches up with a prompt
    free = False  # each guess is a step of the draft model
    fixed_k: int | None = None  # tests only (MESHNODE_TEST_DRAFTS {"k": n}): that many guesses every pass

    def __init__(self, model, tokens: Sequence[int]):
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
        common = min(common, len(seq) - 1)  # the last token is fed again: its logits give the first guess
        if len(fed) > common:
            trim_prompt_cache(self._cache, len(fed) - common)
            del fed[common:]
        feed = seq[common:]
        guesses: list[int] = []
        with mx.stream(any_thread_stream()):
            for i in range(0, len(feed) - 1, self.PREFILL):
                self._model(mx.array([feed[i:min(i + self.PREFILL, len(feed) - 1)]]), cache=self._cache)
                mx.eval([c.state for c in self._cache])
            step = feed[-1:]
            for _ in range(k):
                logits = self._model(mx.array([step]), cache=self._cache)
                guesses.append(int(mx.argmax(logits[0, -1]).item()))
                step = guesses[-1:]
        fed.extend(feed)
        fed.extend(guesses[:-1])
        self._valid = len(seq)
        return guesses
