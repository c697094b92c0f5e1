"""What the in-process speculative decoding tests share (test_speculative, test_fill_share): the
model cases (dense and MoE, float32, bf16 and 4-bit), a prompt that repeats itself, mlx-lm's own
tokens to compare with, local stages, and one speculative request through them."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from meshnode.model.build import model_dir_for
from meshnode.model.shard import Shard
from meshnode.serving.draft_length import PassCosts
from meshnode.serving.generation import PipelineModel, generate_tokens
from meshnode.serving.local_stage import LocalStage
from meshnode.serving.sampling import SamplingParams
from meshnode.serving.speculative import Speculation

CASES = {
    "llama-f32": ("llama", {"dtype": "float32"}),
    "llama-bf16": ("llama", {"dtype": "bfloat16"}),
    "qwen3-4bit": ("qwen3", {"dtype": "bfloat16", "quantize": "4bit"}),
    "qwen3_moe-f32": ("qwen3_moe", {"dtype": "float32"}),
}
# Repeats itself, as code edits and agent turns do: prompt lookup finds runs to propose.
TEXT = "def add(a, b): return a + b. for i in range(10): print(i). def add(a, b): return a + b. for i in"


def model_cases():
    """A module's ``model_case`` fixture: (case name, model folder, mlx-lm model, tokenizer), once
    per case in CASES (``model_case = model_cases()`` in the test module)."""

    @pytest.fixture(scope="module", params=sorted(CASES))
    def model_case(request, tmp_path_factory):
        family, kw = CASES[request.param]
        path = model_dir_for(tmp_path_factory.getbasetemp() / "models", family, num_layers=4, hidden_size=64, **kw)
        model, tokenizer = load(str(path))
        return request.param, path, model, tokenizer

    return model_case


def plain(model, prompt: list[int], n: int, params: SamplingParams | None = None) -> list[int]:
    """mlx-lm's own tokens (the whole model, one process, no speculation)."""
    from meshnode.serving.sampling import make_request_sampler

    sampler = make_request_sampler(params) if params is not None else None
    return [
        int(t)
        for t, _ in zip((t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=sampler)), range(n))
    ]


def stages_of(path, cuts):
    return [LocalStage(Shard(path, a, b)) for a, b in zip(cuts, cuts[1:])]


def speculate(stages, prompt, params, drafter, passes=None, depth=None, costs=None):
    """``depth``: passes in flight at once (local stages take one by default: they share a thread;
    more here runs the remote case's logic, passes of guesses behind the one in flight).
    ``costs``: the pass costs (measured on the passes, where None)."""

    def on_pass(drafted, accepted, tokens, cancelled):
        if passes is not None:
            passes.append((drafted, accepted, tokens, cancelled))

    spec = Speculation(drafter=drafter, on_pass=on_pass, k_max=4, depth=depth, costs=costs or PassCosts())
    return [int(t) for t in generate_tokens(PipelineModel(stages, "t"), prompt, params, speculation=spec)]


class Patchy:
    """A drafter that guesses the reference's next tokens only while the request's length is inside
    one of ``windows`` ([start, end) pairs), and finds nothing elsewhere (as prompt lookup past
    what the prompt holds). ``free``: asked at every token of a pause for finding nothing, as
    prompt lookup is (meshnode.serving.drafting.Drafter.free)."""

    fixed_k = fixed_depth = None

    def __init__(self, tokens, reference, windows, free: bool = False):
        self._tokens, self.reference, self.windows, self.free = list(tokens), reference, windows, free

    def extend(self, tokens):
        self._tokens.extend(tokens)

    def propose(self, k):
        at = len(self._tokens)
        if not any(a <= at < b for a, b in self.windows) or self.reference[:at] != self._tokens:
            return []
        return self.reference[at : at + k]
