"""What the head prices a pass at (meshnode.serving.draft_length.PassCosts), and when it times one.

The timings are a head's on a CPU with OpenBLAS (benchmarks.speculative, a 2-stage mesh): the
first passes of a placement take a multiple of their later time (MLX building kernels for new
shapes, a peer's start), and a further position's cost is not a line in the positions (STEADY). A
least-squares line over every pass seen, older ones fading, would price a further position far
above what it costs, so that the head guesses too little where guesses pay; and a pass priced below
a plain step would have it guess at every step where nothing is right. Pure logic: the timings go
in by hand.
"""

from __future__ import annotations

from meshnode.serving.draft_length import REMEASURE, WINDOW, DraftLength, PassCosts

# (positions, ms) of lone passes in the order a head on OpenBLAS timed them (benchmarks.speculative
# --p 0 0.8, traced): its first seconds under a load (a peer's start-up measurements), then what
# each size costs.
LOADED = [
    (1, 100),
    (1, 84),
    (2, 95),
    (2, 87),
    (1, 85),
    (2, 93),
    (3, 114),
    (3, 121),
    (1, 86),
    (3, 118),
    (2, 98),
    (2, 90),
]
STEADY = {1: [40, 40, 39, 41, 40], 2: [45, 45, 46, 45], 3: [55, 54, 55, 56], 4: [41, 43, 42, 42], 5: [53, 52, 54]}


def timed(costs: PassCosts, passes) -> PassCosts:
    for n, ms in passes:
        costs.observe(n, ms / 1000)
    return costs


def steady():
    return [(n, ms) for n, times in STEADY.items() for ms in times]


def test_a_pass_is_priced_against_the_steps_of_its_time_so_a_load_since_gone_does_not_count():
    # Then only steps (k = 0 chosen: the pipeline full of one-position passes, or a pause).
    costs = timed(PassCosts(), LOADED + [(1, 40), (1, 41), (1, 40), (1, 42), (1, 40), (1, 39), (1, 41), (1, 40)])
    assert abs(costs.cost(1) - 0.040) < 0.001  # the steps of now
    # Passes timed under the load, against the steps timed with them: 1.1 and 1.4 steps (three
    # positions, timed twice, priced by the line through every pass: 1.2). Their seconds against
    # the steps of now would say 2.3 and 3.0, and the head would stop guessing.
    assert 1.05 < costs.relative(2) < 1.15 and 1.1 < costs.relative(3) < 1.5


def test_each_size_is_priced_by_its_own_recent_times():
    costs = timed(PassCosts(), steady())
    assert abs(costs.cost(1) - 0.040) < 1e-9
    assert abs(costs.relative(2) - 45 / 40) < 0.01
    assert abs(costs.relative(3) - 55 / 40) < 0.01
    assert abs(costs.relative(4) - 1.05) < 0.01  # cheaper than 3: measured, not a line's
    # A size not timed often enough is priced by the line through the sizes' medians.
    assert abs(costs.relative(8) - (1 + 7 * costs.ratio())) < 1e-9 and 0 < costs.ratio() < 0.15


def test_a_sizes_first_pass_is_not_kept_and_only_recent_ones_count():
    costs = PassCosts()
    costs.observe(1, 0.3)  # it built MLX's kernels for this shape
    assert costs.cost(1) is None
    costs.observe(1, 0.1)
    assert costs.cost(1) == 0.1
    for _ in range(WINDOW):
        costs.observe(1, 0.05)  # the machine got faster (a load went away): the old times leave
    assert costs.cost(1) == 0.05


def test_a_pass_is_never_priced_below_a_step_so_wrong_guesses_never_seem_to_pay():
    # Passes of five timed at 0.95 of a step (their noise, or steps timed under a little load):
    # priced below a step, k = 4 would pay at every acceptance, and at p = 0 the head would send a
    # pass of four wrong guesses for every token.
    costs = timed(PassCosts(), [(1, 56), (1, 56)] + [(5, 53)] * 9)
    assert costs.relative(5) == 1.0
    length = DraftLength(costs, k_max=4)
    for _ in range(20):
        length.observe(4, 0)  # nothing confirmed
    assert length.choose() == 0


def test_where_passes_fill_the_pipeline_some_go_alone_to_be_timed_one_guess_longer_every_other_time():
    costs = PassCosts(one=0.04, extra=0.004, share=0.5)
    length = DraftLength(costs, k_max=8, fills=True, stages=2)
    for i in range(30):
        length.observe(1, 0 if i % 5 == 2 else 1)  # 4 guesses in 5 confirmed
    chosen = []
    for _ in range(3 * REMEASURE):
        k = length.choose()
        chosen.append((k, length.fill_ok(0)))
    timed_ones = [i for i, (_, fills) in enumerate(chosen) if not fills]
    assert timed_ones == [REMEASURE - 1, 2 * REMEASURE - 1, 3 * REMEASURE - 1], chosen
    best = chosen[0][0]
    assert best >= 1 and all(k == best for k, fills in chosen if fills)
    assert [chosen[i][0] for i in timed_ones] == [best, 0, best + 1]  # the size in use, a step, one longer


def test_a_pass_faster_than_the_steps_timed_has_them_timed_again():
    # A loaded start: steps at 89 ms; then the load goes while passes fill the pipeline (no step
    # timed). Against the old steps its passes come out at 0.5-0.7 of a step; priced at 1 (never
    # below) every size would look free, and at p = 0 the head would guess six tokens a pass.
    costs = timed(PassCosts(), [(1, 102), (1, 89), (2, 97), (2, 96), (3, 57), (3, 57)])
    assert costs.fit()[0] is None  # the step is to be timed again ...
    costs.observe_filled(3, 0.06)  # (meanwhile the old steps still time a traversal for the share)
    assert costs.measured_share is not None
    length = DraftLength(costs, k_max=8, fills=True, stages=2)
    assert length.choose() == 0 and not length.fill_ok(0)  # ... by a plain step alone
    timed(costs, [(1, 41), (3, 55), (4, 42), (4, 43)])
    assert abs(costs.cost(1) - 0.041) < 1e-9 and 1.0 < costs.relative(3) < 1.4


def test_one_slow_pass_does_not_price_every_guess():
    # A head on OpenBLAS (benchmarks.speculative --p 0.8, traced): steps at 40 ms, then passes of
    # two positions at 1.05 and 2.03 steps (the second slowed by something else on the machine).
    # A least-squares line through them would price a further position at 0.54 of a step, and k
    # would stay 0 for the rest of the run.
    costs = timed(PassCosts(), [(1, 40), (1, 40), (1, 41), (1, 40), (2, 42), (2, 42), (2, 81)])
    assert costs.ratio() < 0.1  # the faster of two: noise only ever slows a pass
    length = DraftLength(costs, k_max=8, fills=True, stages=2)
    for i in range(30):
        length.observe(1, 0 if i % 5 == 2 else 1)  # 4 guesses in 5 confirmed
    assert length.choose() >= 2
    # Where every pass says so, a further position costs what they say.
    dear = timed(PassCosts(), [(1, 40), (1, 40), (1, 40), (3, 110), (3, 108), (3, 108), (2, 40), (2, 74)])
    assert 0.8 < dear.ratio() < 0.9


def test_passes_are_timed_again_across_a_placements_requests_not_only_within_one():
    # A request of 48 tokens at p = 0.8 chooses about 14 passes where they fill the pipeline; were
    # the count toward REMEASURE started again with each request, no pass would be timed after the
    # first, and one slow pass would price every guess for the rest of the run. The placement's
    # requests count together.
    costs = PassCosts(one=0.04, extra=0.004, share=0.5)
    timed_at = []
    for request in range(4):
        length = DraftLength(costs, k_max=8, fills=True, stages=2)
        for i in range(30):
            length.observe(1, 0 if i % 5 == 2 else 1)  # 4 guesses in 5 confirmed
        for step in range(14):
            length.choose()
            if not length.fill_ok(0):
                timed_at.append(request * 14 + step)
    assert timed_at == [REMEASURE - 1, 2 * REMEASURE - 1, 3 * REMEASURE - 1], timed_at


def test_where_the_size_in_use_is_a_plain_step_it_and_one_guess_are_timed_in_turn():
    # Guesses priced dear by one slow pass: k = 0, one-position passes filling the pipeline. Turns of
    # (k, a step, k + 1) would time two plain steps for every pass with a guess: here the two alternate.
    costs = timed(PassCosts(share=0.5), [(1, 40), (1, 40), (1, 40), (2, 64), (2, 64), (2, 64)])
    length = DraftLength(costs, k_max=8, fills=True, stages=2)
    for i in range(30):
        length.observe(1, 0 if i % 5 == 2 else 1)
    chosen = [length.choose() for _ in range(4 * REMEASURE)]
    timed_ones = [chosen[i] for i in range(REMEASURE - 1, 4 * REMEASURE, REMEASURE)]
    assert set(chosen) - {0} == {1} and timed_ones == [0, 1, 0, 1], chosen


def test_a_size_is_priced_by_the_faster_of_its_two_middle_times():
    costs = timed(PassCosts(), [(1, 40), (1, 40), (1, 40), (2, 40), (2, 42.4), (2, 47.2), (2, 56.4), (2, 87.2)])
    assert abs(costs.relative(2) - 1.18) < 1e-9  # not 1.3, the mean of 1.18 and 1.41
