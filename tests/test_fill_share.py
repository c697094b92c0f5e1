"""Whether to fill the pipeline is measured, not assumed: a full pipeline's time between passes
against one pass's whole traversal (PassCosts.filled_share).

Stages on machines of their own compute at once, and a full pipeline yields a pass every
1 / stages of a traversal. Two nodes on one device need not: where both stages share a GPU (over
loopback) and one stage's step leaves much of it idle, the share lies between 1 / stages and 1, and
a head that assumed 1 / stages would choose one-position passes where passes of several guesses
are faster; a device that one stage's work fills measures near 1. Pure logic first, then
the real loop on local stages (which share one thread: a device shared, in effect), dense and MoE,
float32, bf16 and 4-bit.
"""

from __future__ import annotations

from harness.drafts import ReferenceDrafter
from meshnode.serving.draft_length import NOISE, REMEASURE, WINDOW, DraftLength, PassCosts, filled_rate
from meshnode.serving.sampling import SamplingParams
from tests.speculation import TEXT, model_cases, plain, speculate, stages_of

model_case = model_cases()


def confirmed(length: DraftLength, passes: int = 30) -> DraftLength:
    """``length`` after ``passes`` one-guess passes, 4 in 5 confirmed."""
    for i in range(passes):
        length.observe(1, 0 if i % 5 == 2 else 1)
    return length


def test_filled_share_is_measured_against_a_traversal_of_the_same_positions():
    costs = PassCosts(one=0.1, extra=0.03)
    assert costs.filled_share(2) == 0.5 and costs.filled_share(3) == 1 / 3  # the prior: stages at once
    for _ in range(40):
        costs.observe_filled(1, 0.05)  # half a traversal between one-position passes
    assert abs(costs.filled_share(2) - 0.5) < 1e-6
    for _ in range(40):
        costs.observe_filled(3, 0.16)  # three positions: 0.1 + 2 * 0.03, a whole traversal apart
    assert abs(costs.filled_share(2) - 1.0) < 1e-3
    costs.observe_filled(1, 100.0)  # a stall: capped, so that it cannot rule filling out for long
    assert costs.filled_share(2) <= 1.0 + 0.2 * 2.0
    assert PassCosts().filled_share(2) == 0.5  # nothing to measure against yet: the prior
    PassCosts().observe_filled(1, 0.05)  # (and nothing measured)


def test_filled_rate_at_a_share_of_one_is_passes_against_plain_steps():
    for alpha, k, ratio in [(0.8, 0, 0.3), (0.8, 3, 0.3), (0.5, 1, 0.9), (1.0, 4, 0.1)]:
        alone = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
        assert abs(filled_rate(alpha, k, 1 + ratio * k, 1.0) - alone / (1 + ratio * k)) < 1e-9
    # Two stages at once, every pass kept: twice the tokens of one traversal per pass.
    assert abs(filled_rate(1.0, 0, 1.0, 0.5) - 2.0) < 1e-9


def test_where_stages_share_a_device_guesses_go_inside_the_pass_not_behind_it():
    # A GPU's costs: a further position at 0.3 of a step. Guesses 4 in 5 right.
    shared = confirmed(DraftLength(PassCosts(one=0.1, extra=0.03, share=1.0), k_max=8, fills=True, stages=2))
    apart = confirmed(DraftLength(PassCosts(one=0.1, extra=0.03, share=0.5), k_max=8, fills=True, stages=2))
    assert 0.75 < shared.alpha < 0.85
    k = shared.choose()
    assert k >= 2 and not shared.fill_ok(0)  # one device: longer passes, nothing behind
    assert apart.choose() >= 1 and apart.fill_ok(0)  # machines of their own: passes fill the pipeline
    # This CPU's costs (a further position at 0.9 of a step), machines of their own: one-position
    # passes fill the pipeline.
    cpu = confirmed(DraftLength(PassCosts(one=0.1, extra=0.09, share=0.55), k_max=8, fills=True, stages=2))
    assert cpu.choose() == 0 and cpu.fill_ok(0) and not cpu.paused()
    # The same CPU costs on one device: no pass behind pays, nor guesses inside: plain steps, then a
    # probe of one guess inside a pass (not behind the plain one).
    both = confirmed(DraftLength(PassCosts(one=0.1, extra=0.09, share=1.0), k_max=8, fills=True, stages=2))
    assert both.choose() == 0 and not both.fill_ok(0) and both.paused()
    for _ in range(both.plain_left):
        both.observe(0, 0)
    assert both.choose() == 1 and not both.fill_ok(0)


def test_a_share_that_rules_filling_out_lapses_and_is_measured_again():
    """Nothing measures the share while no pass goes behind another: a share measured under a
    passing load (or a stall) must not rule filling out for good on machines that can fill. Its
    measures lapse after WINDOW * REMEASURE passes."""
    costs = PassCosts(one=0.1, extra=0.09, share=1.0)
    length = confirmed(DraftLength(costs, k_max=8, fills=True, stages=2))
    waited = 0
    while True:
        k = length.choose()
        if k == 0 and length.fill_ok(0):
            break
        length.observe(k, k)  # plain steps in a pause, probes of one guess (confirmed)
        waited += 1
        assert waited < 1000, costs.filled_share(2)
    assert WINDOW * REMEASURE <= waited < 2 * WINDOW * REMEASURE, waited  # (a pause under way ends first)
    assert costs.filled_share(2) <= 1 - NOISE
    for _ in range(2):  # measured again: a traversal apart (one device) ...
        costs.observe_filled(1, 0.1)
        assert costs.filled_share(2) <= 1 - NOISE  # (one or two measures are not the median)
    costs.observe_filled(1, 0.1)
    assert costs.filled_share(2) > 1 - NOISE  # ... three times: off again
    # Where passes fill the pipeline, they keep the share measured.
    apart = PassCosts(one=0.1, extra=0.09, share=0.55)
    filling = DraftLength(apart, k_max=8, fills=True, stages=2)
    for _ in range(200):
        filling.choose()
        if filling.fill_ok(0):
            apart.observe_filled(1, 0.055)
    assert abs(apart.filled_share(2) - 0.55) < 1e-9


class Costs(PassCosts):
    """A fixed fit (the choices do not depend on this machine's timings); records what the
    request measures: passes timed alone and passes timed in a full pipeline (their positions)."""

    def __init__(self, share: float):
        self.alone: list[int] | None = None
        self.filled: list[int] = []
        super().__init__(one=0.1, extra=0.03, share=share)
        self.alone = []

    def observe(self, positions: int, seconds: float) -> None:
        if self.alone is None:  # the starting fit
            return super().observe(positions, seconds)
        self.alone.append(positions)

    def observe_filled(self, positions: int, seconds: float) -> None:
        self.filled.append(positions)


def run(model_case, costs: Costs) -> tuple[list[int], list[int], list[tuple]]:
    """A greedy request of 32 tokens over two local stages, every guess right, up to 3 passes in flight."""
    name, path, model, tokenizer = model_case
    prompt = tokenizer.encode(TEXT)
    want = plain(model, prompt, 32)
    passes: list = []
    got = speculate(
        stages_of(path, [0, 2, 4]),
        prompt,
        SamplingParams(max_tokens=32),
        lambda h: ReferenceDrafter(h, [prompt + want], 1.0, 0, model.args.vocab_size),
        passes,
        depth=3,
        costs=costs,
    )
    return got, want, passes


def test_a_request_measures_the_share_on_passes_that_filled_the_pipeline(model_case):
    costs = Costs(share=0.5)
    got, want, passes = run(model_case, costs)
    assert got == want
    # Passes went behind the one in flight, and each that came out behind another was timed so.
    assert len(costs.filled) >= 4 and min(costs.filled) >= 2, (costs.filled, costs.alone)


def test_on_a_shared_device_no_pass_is_sent_behind_another(model_case):
    costs = Costs(share=1.0)
    got, want, passes = run(model_case, costs)
    assert got == want
    assert not costs.filled  # nothing went behind a pass in flight ...
    assert max(costs.alone) >= 3, costs.alone  # ... its guesses went inside it
    assert all(c == 0 for *_, c in passes)


def test_with_a_fixed_k_the_share_is_measured_against_lone_passes_of_that_size():
    """The tests' and benchmarks' fixed k sends passes of one size only: no fit, but the lone ones
    still time a traversal of that many positions."""
    costs = PassCosts()
    costs.observe(5, 0.45)  # the size's first: it built MLX's kernels for its shapes (not kept)
    costs.observe(5, 0.2)
    assert costs.fit() == (None, None)
    costs.observe_filled(5, 0.1)
    assert abs(costs.measured_share - 0.5) < 1e-9
    costs.observe_filled(3, 0.1)  # another size: nothing to compare it with
    assert abs(costs.measured_share - 0.5) < 1e-9


def test_the_node_metrics_show_what_the_head_measured():
    from meshnode.metrics import NodeMetrics

    metrics = NodeMetrics()
    assert metrics.speculation()["filled_share"] is None and metrics.speculation()["position_cost"] is None
    metrics.pass_costs(0.31, 0.52)
    view = metrics.speculation()
    assert view["position_cost"] == 0.31 and view["filled_share"] == 0.52
    text = metrics.render().decode()
    assert "meshnode_speculative_filled_share 0.52" in text and "meshnode_speculative_position_cost 0.31" in text
    metrics.pass_costs(0.9, None)
    assert metrics.speculation()["filled_share"] is None


def test_a_stall_or_two_does_not_rule_filling_out_but_a_shared_device_does():
    # What a head on OpenBLAS times (benchmarks.speculative --p 0.8): shares of 0.55, then two
    # passes at 2.0 and 1.81 (a passing load: the traversal they are measured against was timed
    # without it). A running average would rise to about 1 and rule filling out for hundreds of passes.
    costs = PassCosts(one=0.1, extra=0.005)
    for seconds in (0.055, 0.055, 0.2, 0.181, 0.055):
        costs.observe_filled(1, seconds)
        assert costs.filled_share(2) <= 1 - NOISE, seconds
    # The same at a mesh's start (the first measures): filling stays on.
    start = PassCosts(one=0.1, extra=0.005)
    for seconds in (0.2, 0.197):
        start.observe_filled(1, seconds)
    assert start.filled_share(2) == 0.5 and start.measured_share == 1.97
    # Two nodes on one device: a traversal apart every time, ruled out from the third measure.
    shared = PassCosts(one=0.1, extra=0.005)
    for _ in range(2):
        shared.observe_filled(1, 0.1)
        assert shared.filled_share(2) <= 1 - NOISE  # the prior stands for the measures not made yet
    shared.observe_filled(1, 0.1)
    assert shared.filled_share(2) > 1 - NOISE and shared.measured_share == 1.0
