"""Scripted guesses for speculative decoding, for tests and benchmarks (harness/hooked_node.py).

Random weights make any real drafter's acceptance unpredictable, so tests and benchmarks control
it: :class:`ReferenceDrafter` guesses from known answers, each guess right with probability ``p``.
A node started with ``--drafts FILE`` gives its requests the drafter that file asks for
(:func:`drafters_from_file`, meshnode.serving.settings.PlacementSettings.drafters), read again
for each request, so a benchmark changes ``p`` between requests. The file is JSON:

- ``{"p": 0.8, "seed": 1, "vocab": 512, "answers": [[token ids of a prompt and its reference
  answer], ...]}``, optionally with ``"k": 4`` (that many guesses every pass, whatever they cost:
  passes with guesses and rejections on a machine where guessing does not pay) and ``"depth": 2``
  (at most that many passes in flight: what a cancelled pass costs at each depth). A request whose
  tokens so far begin one of the answers gets that answer's next tokens, a wrong id in place of
  each with probability 1 - p (drawn from ``seed`` and the position: the same guesses in every
  run); any other request gets no guesses;
- ``{"off": true}``: requests decode without speculation;
- ``{"prompt_lookup": true}``: they speculate with prompt lookup;
- only ``{"k": 4}``: with the drafter the node's options chose (a draft model), that many guesses
  every pass.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence

from meshnode.serving.drafting import DrafterFactory, PromptLookup


class ReferenceDrafter:
    """Guesses from known answers, each guess right with probability ``p`` (see the module docstring)."""

    free = True

    def __init__(
        self,
        tokens: Sequence[int],
        answers: Sequence[Sequence[int]],
        p: float,
        seed: int,
        vocab: int,
        fixed_k: int | None = None,
        fixed_depth: int | None = None,
    ):
        self.fixed_k = fixed_k  # guesses per pass whatever they cost (meshnode.serving.speculative)
        self.fixed_depth = fixed_depth  # passes in flight at most, instead of the placement's
        self._tokens = list(tokens)
        self.p, self.seed, self.vocab = p, seed, vocab
        self._answer = next(
            (list(a) for a in answers if list(a[: len(tokens)]) == self._tokens and len(a) > len(tokens)), None
        )

    @classmethod
    def from_file(cls, path: str, configured: DrafterFactory | None = None) -> DrafterFactory:
        """A drafter factory (tokens -> drafter, or None: this request does not speculate) reading
        the file at ``path`` for each request; ``configured``: the drafter factory the node's
        options chose."""

        def make(tokens: Sequence[int]):
            with open(path) as f:
                spec = json.load(f)
            if spec.get("off"):
                return None
            if spec.get("prompt_lookup"):
                return PromptLookup(tokens)
            if "answers" not in spec and configured is not None:
                drafter = configured(tokens)
                if drafter is not None:
                    drafter.fixed_k = spec.get("k")
                return drafter
            return cls(
                tokens,
                spec["answers"],
                float(spec["p"]),
                int(spec.get("seed", 0)),
                int(spec["vocab"]),
                spec.get("k"),
                spec.get("depth"),
            )

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


def drafters_from_file(path: str) -> Callable[[DrafterFactory], DrafterFactory]:
    """A node's drafters as the file at ``path`` asks, in place of the ones its options chose
    (meshnode.serving.settings.PlacementSettings.drafters)."""
    return lambda configured: ReferenceDrafter.from_file(path, configured=configured)
