"""An MTP head drafting for a node that holds the whole model (meshnode.serving.mtp_drafting):
greedy tokens identical to mlx-lm's, and each draft the one the head makes from mlx-lm's own hidden
states of the confirmed positions (so the records of every forward pass reach it in order)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm import load
from mlx_lm.models.cache import KVCache

from meshnode.model.build import model_dir_for
from meshnode.model.mtp import MTPHead, hidden_states, shared_from
from meshnode.serving.mtp_drafting import MTPDrafter, mtp_drafters
from meshnode.serving.sampling import SamplingParams
from tests.speculation import TEXT, plain, speculate, stages_of

pytestmark = pytest.mark.timeout(120)
N = 24


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = model_dir_for(
        tmp_path_factory.getbasetemp() / "models", "llama", num_layers=4, hidden_size=64, dtype="float32"
    )
    model, tokenizer = load(str(path))
    prompt = tokenizer.encode(TEXT)
    return path, model, prompt, plain(model, prompt, N)


def _head(model) -> MTPHead:
    """A random head (norms near 1) sharing ``model``'s embedding and LM head."""
    mx.random.seed(7)
    head = MTPHead(model.args, shared_from(model))
    head.update(tree_map(lambda a: mx.random.normal(a.shape) * 0.2 + (1.0 if a.ndim == 1 else 0.0), head.parameters()))
    mx.eval(head.parameters())
    return head


def _reference_draft(head: MTPHead, model, tokens: list[int], k: int) -> list[int]:
    """The head's k guesses after ``tokens`` from mlx-lm's hidden states, in one fresh pass."""
    h, _ = hidden_states(model, mx.array([tokens]))
    head.cache, head.chained = KVCache(), 0
    return head.draft(h[0, : len(tokens) - 1], tokens[1:], k).tokens


@pytest.mark.parametrize("fixed", [3, None])
def test_greedy_tokens_are_mlx_lms_and_each_draft_is_the_heads_on_mlx_lms_hidden_states(case, fixed):
    path, model, prompt, want = case
    stages = stages_of(path, [0, 4])
    head = _head(stages[0].shard.model)
    made = mtp_drafters(head, stages[0].shard.model)
    seen: list[tuple[list[int], list[int]]] = []  # (tokens so far, the head's guesses)
    drafters: list[MTPDrafter] = []
    reference = prompt + want

    class Recorded(MTPDrafter):
        fixed_k = fixed

        def propose(self, k):
            guesses = super().propose(k)
            so_far = list(self._tokens)
            seen.append((so_far, guesses))
            # every other pass sends the true continuation: confirmed whole, more than one position
            if guesses and len(seen) % 2 == 0:
                return reference[len(so_far) : len(so_far) + len(guesses)]
            return guesses

    def factory(tokens):
        d = made(tokens)
        d.__class__ = Recorded
        drafters.append(d)
        return d

    passes: list = []
    got = speculate(stages, prompt, SamplingParams(max_tokens=N), factory, passes)
    assert got == want
    (drafter,) = drafters
    assert drafter.stopped == ""
    drafted = [(t, g) for t, g in seen if g]
    # with k fixed, every other pass is confirmed whole; the policy's k follows measured costs
    assert drafted and (fixed is None or any(a == fixed for _, a, _, _ in passes)), passes
    for tokens, guesses in drafted:
        assert _reference_draft(head, model, tokens, len(guesses)) == guesses, len(tokens)


def test_seeded_sampling_draws_what_plain_decoding_draws(case):
    path, model, prompt, _ = case
    params = SamplingParams(max_tokens=N, temperature=0.8, seed=1234)
    want = plain(model, prompt, N, params)
    stages = stages_of(path, [0, 4])
    made = mtp_drafters(_head(stages[0].shard.model), stages[0].shard.model)
    passes: list = []
    assert speculate(stages, prompt, params, made, passes) == want
    assert sum(d for d, _, _, _ in passes) > 0
