"""The load- and acceptance-aware policy: cost model, priors, choices under load, acceptance feedback."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trt_lookahead.lookahead.config import Lookahead, LookaheadConfig
from trt_lookahead.lookahead.decoder import GREEDY_STEP
from trt_lookahead.lookahead.executor import priced_tokens
from trt_lookahead.lookahead.policy import GREEDY_PROBE_EVERY, LookaheadPolicy, Priors, StepCost, ladder

C = LookaheadConfig
PRIORS = Priors({"1/3/1": 1.5, "2/3/2": 1.8, "4/3/4": 2.1})  # compression (tokens per step) as tune measures it
FLAT = StepCost.linear(20.0, 0.05)  # a GPU-like step: tokens cost almost nothing
STEEP = StepCost.linear(20.0, 8.0)  # a small CPU: every token costs 40% of a one-token step


def test_ladder_doubles_the_columns_split_as_the_request_splits_them():
    # 2 columns: W = round(1.2 sqrt 2 = 1.70) = 2 leaves no tree column, so 1/N/1; 4: round(2.4) = 2, 2/N/2;
    # 8: round(3.39) = 3, G = 5; then the request's own config
    assert ladder(C(4, 3, 4)) == (GREEDY_STEP, C(1, 3, 1), C(2, 3, 2), C(4, 3, 4))
    assert ladder(C(5, 5, 11)) == (GREEDY_STEP, C(1, 5, 1), C(2, 5, 2), C(3, 5, 5), C(5, 5, 11))
    assert ladder(C(8, 3, 8)) == (GREEDY_STEP, C(1, 3, 1), C(2, 3, 2), C(3, 3, 5), C(8, 3, 8))
    # 30 columns: 16 split as 5/5/11 first
    assert ladder(C(15, 5, 15)) == (GREEDY_STEP, C(1, 5, 1), C(2, 5, 2), C(3, 5, 5), C(5, 5, 11), C(15, 5, 15))
    # within the request's G = 3: 8 columns are 5/5/3, the cut tree columns going to the window
    assert ladder(C(7, 5, 3)) == (GREEDY_STEP, C(1, 5, 1), C(2, 5, 2), C(5, 5, 3), C(7, 5, 3))
    assert ladder(C(15, 5, 1)) == (GREEDY_STEP, C(1, 5, 1), C(3, 5, 1), C(7, 5, 1), C(15, 5, 1))
    assert ladder(C(3, 4, 0)) == (GREEDY_STEP, C(2, 4, 0), C(3, 4, 0))  # a window only
    assert ladder(C(1, 3, 0)) == (GREEDY_STEP, C(1, 3, 0))
    assert ladder(GREEDY_STEP) == (GREEDY_STEP,)


def test_step_cost_interpolates_and_extrapolates_the_measured_points():
    cost = StepCost({1: [(1, 10.0), (4, 16.0), (16, 40.0)], 8: [(8, 30.0), (32, 90.0)]})
    assert cost(1, 1) == 10.0 and cost(10, 1) == pytest.approx(28.0)
    assert cost(32, 1) == pytest.approx(72.0)  # past the last point: the last two points' line
    assert cost(20, 8) == pytest.approx(60.0)
    assert cost(20, 4) == pytest.approx((3 / 7) * cost(20, 8) + (4 / 7) * cost(20, 1))  # linear between rows
    assert cost(20, 64) == cost(20, 8)  # beyond the measured rows: the nearest
    again = StepCost.from_dict(cost.to_dict())
    assert again(20, 4) == cost(20, 4)
    with pytest.raises(ValueError, match="at least two distinct token counts"):
        StepCost({1: [(1, 10.0)]})


def test_priors_are_the_measured_extra_tokens_and_interpolate_by_step_tokens():
    assert PRIORS.extra(C(2, 3, 2)) == pytest.approx(0.8)
    assert PRIORS.extra(GREEDY_STEP) == 0.0
    between = PRIORS.extra(C(2, 3, 1))  # T = 6, between 1/3/1 (T = 4) and 2/3/2 (T = 8)
    assert 0.5 < between < 0.8
    assert PRIORS.extra(C(1, 3, 0)) < PRIORS.extra(C(1, 3, 1))  # below the smallest measured T: less
    assert Priors({}).extra(C(4, 3, 4)) == 0.0
    assert Priors(PRIORS.to_dict()).extra(C(4, 3, 4)) == PRIORS.extra(C(4, 3, 4))


def choose(policy, n, config=None, supply=4, explicit=False, ratio=1.0):
    states = [policy.start(Lookahead(config or C(4, 3, 4), auto=not explicit)) for _ in range(n)]
    for s in states:
        s.ratio = ratio
    return states, policy.choose(states, [supply] * n)


def test_cheap_tokens_buy_the_largest_config_for_everyone():
    _, configs = choose(LookaheadPolicy(FLAT, PRIORS), 8)
    assert configs == [C(4, 3, 4)] * 8


def test_expensive_tokens_keep_everyone_greedy():
    _, configs = choose(LookaheadPolicy(STEEP, PRIORS), 8)
    assert configs == [GREEDY_STEP] * 8


def test_lookahead_shrinks_as_the_batch_grows():
    # a step whose cost grows with M beyond a budget (memory-bound, then compute-bound)
    cost = StepCost({1: [(1, 20.0), (16, 22.0), (64, 60.0), (256, 240.0)]})
    policy = LookaheadPolicy(cost, PRIORS)
    tokens = [sum(c.step_tokens for c in choose(policy, n)[1]) / n for n in (1, 4, 16)]
    assert tokens[0] > tokens[1] > tokens[2]


def test_a_request_whose_drafts_fail_runs_greedy_and_a_repetitive_one_climbs():
    policy = LookaheadPolicy(StepCost.linear(20.0, 1.0), PRIORS)
    failing, repetitive = policy.start(Lookahead(C(4, 3, 4), auto=True)), policy.start(Lookahead(C(4, 3, 4), auto=True))
    first = policy.choose([failing, repetitive], [4, 4])
    assert first[0] == first[1] != GREEDY_STEP
    greedy_steps = 0
    for _ in range(40):
        a, b = policy.choose([failing, repetitive], [4, 4])
        greedy_steps += a == GREEDY_STEP
        policy.observe(failing, a, 1)  # nothing accepted: only the model's own token
        policy.observe(repetitive, b, b.N)  # every draft accepted
    assert greedy_steps >= 30  # the rest are the occasional probes
    chosen = policy.choose([failing, repetitive], [4, 4])[1]
    assert chosen.step_tokens >= first[1].step_tokens
    assert policy.expected(repetitive, chosen) == pytest.approx(chosen.N, abs=0.01)  # all it can get
    assert repetitive.ratio > 2 > 1 > failing.ratio


def decode(policy, state, supply, steps, emitted, pads_rows=False):
    """The configs one request runs for `steps` steps with `supply` drafts, each step emitting `emitted(config)`."""
    configs = []
    for _ in range(steps):
        (config,) = policy.choose([state], [supply], pads_rows)
        configs.append(config)
        policy.observe(state, config, emitted(config))
    return configs


def test_a_greedy_request_is_probed_again_later():
    policy = LookaheadPolicy(StepCost.linear(20.0, 1.0), PRIORS)
    state = policy.start(Lookahead(C(4, 3, 4), auto=True))
    state.ratio = 0.0
    configs = decode(policy, state, 4, 60, lambda config: 1 if config == GREEDY_STEP else config.N)
    assert configs[0] == GREEDY_STEP and any(c != GREEDY_STEP for c in configs)


def test_a_request_the_priors_keep_greedy_probes_its_cheapest_rung_and_climbs_if_its_drafts_match():
    """On a steep step cost every rung is predicted slower than greedy: only probes can show that a request's
    drafts match. Every 8th greedy step in a row is one; a request whose drafts all match then stays on lookahead."""
    policy = LookaheadPolicy(STEEP, PRIORS)
    state = policy.start(Lookahead(C(4, 3, 4), auto=True))
    configs = decode(policy, state, 4, 20, lambda config: config.N)  # every draft accepted
    # greedy costs 28 ms and 1/3/1 52 ms for 1 + ratio x 0.5 tokens. The first probe (2 extra tokens against the
    # prior's 0.5) takes the ratio from 1 to 0.8 + 0.2 x 4 = 1.6: 1.8 tokens / 52 ms, still below greedy's 1 / 28;
    # the second, 8 steps later, to 2.08: 2.04 / 52 beats it, and the request stays on 1/3/1
    assert configs[:8] == [GREEDY_STEP] * 8 and configs[8] == C(1, 3, 1)  # the cheapest rung with drafts
    assert configs[9:17] == [GREEDY_STEP] * 8 and configs[17:] == [C(1, 3, 1)] * 3


@pytest.mark.parametrize("pads_rows", [False, True])  # one request: padding changes nothing
def test_probes_of_a_request_whose_drafts_fail_come_ever_more_rarely(pads_rows):
    policy = LookaheadPolicy(STEEP, PRIORS)
    state = policy.start(Lookahead(C(4, 3, 4), auto=True))
    configs = decode(policy, state, 4, 200, lambda config: 1, pads_rows)  # nothing accepted
    probes = [step for step, config in enumerate(configs) if config != GREEDY_STEP]
    # after 8 greedy steps, then 16, 32 and 64: the wait doubles after each failed probe
    assert probes == [8, 25, 58, 123]


def test_no_probe_without_drafts_to_verify():
    policy = LookaheadPolicy(STEEP, PRIORS)
    state = policy.start(Lookahead(C(4, 3, 4), auto=True))
    assert decode(policy, state, 0, 30, lambda config: 1) == [GREEDY_STEP] * 30
    assert state.draftless_run == 30 and policy.choose([state], [2]) == [C(1, 3, 1)]


def test_window_only_steps_learn_their_own_ratio_and_leave_the_drafts_one():
    # c = 20 + M ms; no drafts (supply 0), so the rungs are 1/3/0, 2/3/0, 4/3/0 (T = 2, 4, 8; priors 0.5 log 2 /
    # log 4 = 0.25, 0.5 and 2/3/2's 0.8), scaled by the window's own ratio r. Each step emits only what the column-0
    # chain matches, here nothing, so r falls by a fifth a step: predicted tokens per ms, r = 1: 1.8 / 28 = .0643 >
    # 1.5 / 24; r = .8: 1.64 / 28 = .0586 > 1.4 / 24 = .0583; r = .64 and .512: 2/3/0 (.0550, .0523); r = .41:
    # 2/3/0 .05021 > 1/3/0 .05011; r = .328: 1/3/0 1.082 / 22 = .0492 > 1.02 / 21 = .0486 (greedy with the margin);
    # r = .262: 1.066 / 22 = .0484, greedy; then r drifts back towards 1 (.299) and 1/3/0 is tried again
    policy = LookaheadPolicy(StepCost.linear(20.0, 1.0), PRIORS)
    state = policy.start(Lookahead(C(4, 3, 4), auto=True))
    state.ratio = 0.5
    configs = decode(policy, state, 0, 8, lambda config: 1)
    assert configs == [C(4, 3, 0)] * 2 + [C(2, 3, 0)] * 3 + [C(1, 3, 0), GREEDY_STEP, C(1, 3, 0)]
    assert state.window_ratio == pytest.approx(0.8 * (0.95 * 0.8**6 + 0.05))  # 6 failures, a drift, a failure
    assert state.ratio == pytest.approx(1 - 0.5 * 0.95**8)  # the drafts' ratio drifted back as after greedy steps
    assert state.draftless_run == 8 and state.probe_every == 8  # none of them probed the drafts
    policy.observe(state, C(4, 3, 4), 1)  # a step with drafts that accepted none: now the drafts' ratio learns
    assert state.ratio == pytest.approx(0.8 * (1 - 0.5 * 0.95**8)) and state.draftless_run == 0


def test_explicit_configs_are_honoured():
    policy = LookaheadPolicy(STEEP, PRIORS)
    explicit, auto = policy.start(Lookahead(C(7, 5, 7), auto=False)), policy.start(Lookahead(C(7, 5, 7), auto=True))
    chosen = policy.choose([explicit, auto], [7, 7])
    assert chosen[0] == C(7, 5, 7) and chosen[1].step_tokens < C(7, 5, 7).step_tokens


def test_candidate_rows_are_capped_by_the_pool_supply():
    _, configs = choose(LookaheadPolicy(FLAT, PRIORS), 2, supply=1)
    assert configs == [C(4, 3, 1)] * 2


def drawn_requests(policy, requests):
    """(states, supplies) of drawn (W, N, G, ratio, explicit, supply) requests."""
    states, supplies = [], []
    for W, N, G, ratio, explicit, supply in requests:
        state = policy.start(Lookahead(C(W, N, G), auto=not explicit))
        state.ratio = ratio
        states.append(state)
        supplies.append(supply)
    return states, supplies


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 8), st.integers(2, 5), st.integers(0, 8), st.floats(0, 4), st.booleans(),
                  st.integers(0, 8)),
        min_size=1, max_size=12,
    ),
    st.floats(1, 50), st.floats(0, 10), st.floats(0, 3),
)
def test_the_chosen_step_is_never_predicted_slower_than_batched_greedy(requests, base, per_token, per_row):
    policy = LookaheadPolicy(StepCost.linear(base, per_token, per_row), PRIORS)
    states, supplies = drawn_requests(policy, requests)
    configs = policy.choose(states, supplies)

    def speed(chosen):
        tokens = sum(c.step_tokens for c in chosen)
        expected = sum(policy.expected(s, c) for s, c in zip(states, chosen, strict=True))
        return expected / policy.cost(tokens, len(states))

    baseline = [GREEDY_STEP if s.auto else s.config for s in states]
    assert speed(configs) >= speed(baseline) - 1e-9
    for state, supply, config in zip(states, supplies, configs, strict=True):
        assert config == state.config if not state.auto else (
            config == GREEDY_STEP or (config.N == state.config.N and config.W <= state.config.W
                                      and min(state.config.G, supply) >= config.G)
        )
    assert np.isfinite(speed(configs))


def run_on(policy, real, steps, n=1, supply=4, outlier_at=None, pads_rows=False):
    """`steps` steps of n `auto` requests on an executor (padding rows or not) whose step of M tokens in B rows takes
    real(M, B) ms (10x that at step `outlier_at`); a request's drafts match as the priors say (its emitted tokens add
    up to its configs' compression). The configs chosen, and for each step whether a request was due to probe
    (chosen whatever the prediction, where a probe could pay)."""
    states = [policy.start(Lookahead(C(4, 3, 4), auto=True)) for _ in range(n)]
    extra = [0.0] * n  # each request's prior extra tokens so far: it emits their whole part
    chosen, probes = [], []
    for step in range(steps):
        probes.append(any(s.draftless_run >= s.probe_every for s in states))
        configs = policy.choose(states, [supply] * n, pads_rows)
        tokens = priced_tokens([c.step_tokens for c in configs], pads_rows)
        policy.observe_step(tokens, n, real(tokens, n) * (10 if step == outlier_at else 1) / 1000.0)
        for i, (state, config) in enumerate(zip(states, configs, strict=True)):
            before, extra[i] = extra[i], extra[i] + PRIORS.extra(config)
            policy.observe(state, config, 1 + int(extra[i]) - int(before))
        chosen.append(configs)
    return chosen, probes


def speed(real, configs):
    """Real tokens per ms of a step of `configs` whose drafts match as the priors say."""
    return sum(1 + PRIORS.extra(c) for c in configs) / real(sum(c.step_tokens for c in configs), len(configs))


@pytest.mark.parametrize("n", [1, 4])
def test_a_tuning_that_calls_lookahead_cheap_where_it_is_dear_costs_a_few_steps(n):
    """Tuned: tokens nearly free (FLAT); real: every token costs 40% of a one-token step (STEEP). The policy
    starts on 4/3/4, sees its steps cost far more than tuned, steps down the ladder and runs greedy (but for its
    requests' probes) from then on."""
    policy = LookaheadPolicy(FLAT, PRIORS)
    chosen, probes = run_on(policy, STEEP, 80, n)
    assert chosen[0] == [C(4, 3, 4)] * n
    settled = next(i for i, c in enumerate(chosen) if c == [GREEDY_STEP] * n)
    assert settled <= 10  # one step per rung down the ladder (requests stepping down apart under load)
    # a rung timed in one step only is tried once more UNCONFIRMED steps later (one slow step must not ban it)
    retries = [i for i in range(settled, 80) if chosen[i] != [GREEDY_STEP] * n and not probes[i]]
    assert len(retries) <= 3 and all(i < 40 for i in retries)
    assert speed(STEEP, [GREEDY_STEP] * n) > speed(STEEP, chosen[0])  # the cheaper choice indeed


@pytest.mark.parametrize("n", [1, 4])
def test_a_tuning_that_calls_lookahead_dear_where_it_is_cheap_is_corrected_by_the_probes(n):
    """Tuned: STEEP; real: FLAT. Greedy runs until the first probe times a step with drafts: from then on the
    corrected cost keeps lookahead, faster than greedy on the real executor."""
    policy = LookaheadPolicy(STEEP, PRIORS)
    chosen, _ = run_on(policy, FLAT, 80, n)
    assert chosen[0] == [GREEDY_STEP] * n
    settled = next(i for i, c in enumerate(chosen) if GREEDY_STEP not in c)
    assert settled <= 10  # the first probe comes after PROBE_EVERY = 8 greedy steps
    # but for one all-greedy step GREEDY_PROBE_EVERY steps on, which times greedy again
    assert sum(GREEDY_STEP in c for c in chosen[settled:]) == 1 == sum(c == [GREEDY_STEP] * n for c in chosen[settled:])
    assert all(speed(FLAT, c) > speed(FLAT, [GREEDY_STEP] * n) for c in chosen[settled:] if GREEDY_STEP not in c)
    assert chosen[-1] == [C(4, 3, 4)] * n  # each rung timed showed the next one cheaper too: it climbed to the top


def test_without_tuning_errors_the_choices_are_tunes():
    """Observed costs equal to the tuned ones change nothing."""
    for cost, settled in ((FLAT, [C(4, 3, 4)] * 2), (STEEP, [GREEDY_STEP] * 2)):
        chosen, probes = run_on(LookaheadPolicy(cost, PRIORS), cost, 40, 2)
        assert all(c == settled for c, probe in zip(chosen, probes, strict=True) if not probe)


@pytest.mark.parametrize(("tuned", "real"), [(FLAT, FLAT), (STEEP, STEEP), (FLAT, STEEP), (STEEP, FLAT)])
def test_one_slow_step_changes_the_choice_for_a_step_or_two_at_most(tuned, real):
    steady, _ = run_on(LookaheadPolicy(tuned, PRIORS), real, 60, 2)
    noisy, _ = run_on(LookaheadPolicy(tuned, PRIORS), real, 60, 2, outlier_at=30)
    assert sum(a != b for a, b in zip(steady, noisy, strict=True)) <= 2


def test_a_greedy_step_dearer_in_the_tuning_than_in_fact_is_timed_again():
    """Tuned on a busy machine: a one-token step 61 ms, and tokens cheap, so lookahead is chosen; in fact greedy
    costs 32 ms and lookahead steps far more. The lookahead steps are corrected as they run but the greedy step,
    never run, stays at the tuned cost until the greedy probe times it; then greedy is kept."""
    tuned, real = StepCost.linear(60.0, 1.0), StepCost.linear(20.0, 12.0)
    chosen, probes = run_on(LookaheadPolicy(tuned, PRIORS), real, 120)
    assert chosen[0] == [C(4, 3, 4)]
    settled = next(i for i, c in enumerate(chosen) if c == [GREEDY_STEP])
    assert settled <= GREEDY_PROBE_EVERY + 4
    assert all(c == [GREEDY_STEP] for c, probe in zip(chosen[settled:], probes[settled:], strict=True) if not probe)


def test_the_learnt_cost_is_tunes_until_observed_and_per_row_count():
    policy = LookaheadPolicy(STEEP, PRIORS)
    assert policy.cost(16, 1) == STEEP(16, 1) and policy.cost.observations == 0
    for _ in range(3):
        policy.observe_step(16, 1, 2 * STEEP(16, 1) / 1000.0)
    assert policy.cost(16, 1) == pytest.approx(2 * STEEP(16, 1))
    assert policy.cost(16, 2) == STEEP(16, 2)  # another row count learns on its own
    assert policy.cost(4, 1) == STEEP(4, 1)  # far below the observed steps: tune's
    assert policy.cost.observations == 3 and policy.cost.last == (16, 1, pytest.approx(2 * STEEP(16, 1)))
    long, short = policy.cost.curve(1, 64).copy(), policy.cost.curve(1, 20)  # kept per row count: a prefix
    assert len(short) == 21 and np.array_equal(short, long[:21])
    for _ in range(3):  # steps of 1 row twice as slow again: the curve read after each is learnt anew
        policy.observe_step(16, 1, 4 * STEEP(16, 1) / 1000.0)
    assert policy.cost.curve(1, 20)[16] == pytest.approx(4 * STEEP(16, 1))
    fixed = LookaheadPolicy(STEEP, PRIORS, learn=False)  # a replay of a tuning entry: its cost only
    fixed.observe_step(16, 1, 2 * STEEP(16, 1) / 1000.0)
    assert fixed.cost(16, 1) == STEEP(16, 1) and fixed.cost.observations == 0


# -- executors that pad every row to the step's widest (lookahead/executor.py `pads_rows`) -----------------


def test_a_padded_step_prices_a_lone_upgrade_at_every_rows_cost():
    """Eight rows, one request whose drafts match four times as well as the priors say, seven whose fail. Priced by
    real tokens, upgrading the one to 1/3/1 (4 tokens, 3 expected) is cheap: 10 tokens in 25.5 ms against 8 in 24;
    in a padded step it widens all eight rows to 4 tokens, 32 in all: 10 in 36 ms, and greedy is faster."""
    policy = LookaheadPolicy(StepCost.linear(20.0, 0.5), PRIORS)
    states = [policy.start(Lookahead(C(4, 3, 4), auto=True)) for _ in range(8)]
    for i, state in enumerate(states):
        state.ratio = 4.0 if i == 0 else 0.0
    assert policy.choose(states, [4] * 8) == [C(1, 3, 1)] + [GREEDY_STEP] * 7
    assert policy.choose(states, [4] * 8, pads_rows=True) == [GREEDY_STEP] * 8


def test_a_padded_step_gives_every_row_the_best_rung_that_fits_its_width():
    """Once the step is wide, narrower rows cost nothing: requests whose drafts match take the widest rung that
    fits, one with fewer pool candidates its capped rung, and a request with no drafts its window."""
    policy = LookaheadPolicy(FLAT, PRIORS)
    states = [policy.start(Lookahead(C(4, 3, 4), auto=True)) for _ in range(4)]
    configs = policy.choose(states, [4, 4, 2, 0], pads_rows=True)
    assert configs[:2] == [C(4, 3, 4)] * 2 and configs[2] == C(4, 3, 2) and configs[3] == C(4, 3, 0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 8), st.integers(2, 5), st.integers(0, 8), st.floats(0, 4), st.booleans(),
                       st.integers(0, 8)), min_size=1, max_size=10),
    st.floats(1, 50), st.floats(0, 10),
)
def test_a_padded_choice_is_never_predicted_slower_than_batched_greedy(requests, base, per_token):
    policy = LookaheadPolicy(StepCost.linear(base, per_token), PRIORS)
    states, supplies = drawn_requests(policy, requests)
    configs = policy.choose(states, supplies, pads_rows=True)

    def speed(chosen):
        rows = len(chosen)
        expected = sum(policy.expected(s, c) for s, c in zip(states, chosen, strict=True))
        return expected / policy.cost(rows * max(c.step_tokens for c in chosen), rows)

    assert speed(configs) >= speed([GREEDY_STEP if s.auto else s.config for s in states]) - 1e-9
    width = max(c.step_tokens for c in configs)
    for state, supply, config in zip(states, supplies, configs, strict=True):
        if not state.auto:
            assert config == state.config
            continue
        assert config == GREEDY_STEP or (config.N == state.config.N and config.W <= state.config.W
                                         and min(state.config.G, supply) >= config.G)
        fits = [c for c in policy.rungs(state.ladder, min(supply, state.config.G)) if c[0] <= width]
        assert policy.expected(state, config) == pytest.approx(max(policy.expected(state, c) for _, _, c in fits))


def test_rows_sharing_a_padded_step_probe_together_and_more_rarely_than_one_alone():
    """On a steep step cost everyone stays greedy but for probes. Padded, a probe widens all eight rows, so it
    waits as many times longer as that costs over one request's probe alone, and every row with drafts rides in
    it: their probes fall due together from then on."""
    policy = LookaheadPolicy(STEEP, PRIORS)
    states = [policy.start(Lookahead(C(4, 3, 4), auto=True)) for _ in range(8)]
    probes = []
    for step in range(120):
        configs = policy.choose(states, [4] * 8, pads_rows=True)
        if configs != [GREEDY_STEP] * 8:
            assert all(c.G for c in configs)  # all rows probe in the same step
            probes.append(step)
        for state, config in zip(states, configs, strict=True):
            policy.observe(state, config, 1)  # nothing accepted
    # alone a probe widens 1 -> 4 tokens: STEEP costs 52 / 28 - 1 = 0.86 more; eight rows 8 -> 32 tokens cost
    # 276 / 84 - 1 = 2.29 more, 2.67 times that: the first probe waits 8 x 2.67 = 21.3 steps, the next 16 x 2.67
    assert probes == [22, 22 + 1 + 43]  # alone: [8, 25] (test_probes_of_a_request_whose_drafts_fail_...)


@pytest.mark.parametrize("pads_rows", [False, True])
def test_probes_that_could_not_pay_at_this_load_stop_once_their_step_is_timed(pads_rows):
    """Eight rows on STEEP (tuned and real), drafts matching as the priors say. Even drafts matching as well as a
    ratio can say (MAX_RATIO 4: 1/3/1 then emits its N = 3 tokens) cannot pay here: padded, 24 tokens in 276 ms
    against greedy's 8 in 84; unpadded, one row's 1/3/1 makes 10 tokens in 108 ms. Probes run while their steps'
    cost is tune's guess (and once more to confirm a knot one step made), then stop; alone, on the same cost, a
    request keeps probing (its 1/3/1 could pay: 3 tokens in 52 ms against 1 in 28)."""
    chosen, _ = run_on(LookaheadPolicy(STEEP, PRIORS), STEEP, 240, 8, pads_rows=pads_rows)
    probes = [step for step, configs in enumerate(chosen) if configs != [GREEDY_STEP] * 8]
    assert probes and max(probes) < 120  # what each probe timed stays known STALE = 256 steps
    alone, _ = run_on(LookaheadPolicy(STEEP, PRIORS), STEEP, 240, 1, pads_rows=pads_rows)
    assert sum(c != [GREEDY_STEP] for c in alone[120:]) >= 4


def test_padded_probes_that_could_pay_keep_running():
    """The same eight rows where a token costs a tenth of a one-token step: the priors keep them greedy (8 tokens
    in 36 ms against 1/3/1's 12 in 84) but drafts matching at MAX_RATIO would pay (24 in 84), so they keep probing."""
    cheaper = StepCost.linear(20.0, 2.0)
    chosen, _ = run_on(LookaheadPolicy(cheaper, PRIORS), cheaper, 240, 8, pads_rows=True)
    assert sum(configs != [GREEDY_STEP] * 8 for configs in chosen[120:]) >= 2
