"""The draft gate forecasts a drafting step's tokens from each request's own acceptance and the
measured step times per load, picks the faster choice, and keeps exploring the other one."""

from __future__ import annotations

import math

import pytest

from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.engine.spec.gate_estimates import newcomer_ratio, seed_scales
from dspark_server.engine.spec.reuse_rules import MIN_RATIO_CHOICES, SETTLED_CHOICES

IDS8 = [f"r{i}" for i in range(8)]


def drafts_all(gate: DraftGate, ids: list[str]) -> bool:
    """The gate's choice for a step, which must be all or nothing here."""
    chosen = gate.choose(ids)
    assert chosen in ([], list(range(len(ids))))
    return bool(chosen)


def _warm(gate: DraftGate, ids: list[str], draft: tuple[int, float], plain_s: float) -> None:
    """One drafting step (each request emits ``draft[0]`` tokens in ``draft[1]`` s), one plain."""
    assert drafts_all(gate, ids) is True
    gate.record(ids, True, [draft[0]] * len(ids), draft[1])
    assert drafts_all(gate, ids) is False
    gate.record(ids, False, [1] * len(ids), plain_s)


def test_gate_measures_both_then_follows_the_faster_and_explores() -> None:
    gate = DraftGate(
        explore_every=4,
        max_explore_interval=4,
        max_explore_overhead=0.5,
        forced_explore_overhead=0.5,  # (the cap binds: it is what this test is about)
        min_samples=1,
        prior_samples=0,
        request_smoothing=0.5,
        explore_run=1,
    )
    _warm(gate, IDS8, (10, 1.0), 1.0)  # drafting: 80 tokens/s, plain: 8 tokens/s
    picks = [drafts_all(gate, IDS8) for _ in range(8)]
    # every explore_every-th step goes to the slower choice
    assert picks.count(True) == 6 and picks.count(False) == 2
    # the requests turn hard: their own forecasts fall below one token per drafting step's time
    for _ in range(6):
        gate.record(IDS8, True, [1] * 8, 2.0)
    picks = [drafts_all(gate, IDS8) for _ in range(8)]
    assert picks.count(False) == 6
    # another load bucket keeps its own step times, seeded from the nearest measured bucket
    # (times scaled by the load ratio): no warm-up alternation there
    wide = [f"x{i}" for i in range(64)]
    assert DraftGate.bucket_of(64) == DraftGate.bucket_of(8) + 3
    first = drafts_all(gate, wide)
    assert [drafts_all(gate, wide) for _ in range(2)] == [first, first]
    draft_rate, plain_rate = gate.rates()[DraftGate.bucket_of(64)]
    assert plain_rate == pytest.approx(gate.rates()[DraftGate.bucket_of(8)][1] / 8)


def test_one_hard_request_does_not_switch_drafting_off_for_the_next() -> None:
    # the c=1 failure on the widened twin: the first request accepted nothing for its first
    # drafting steps, and the gate, averaging all requests of the load bucket, chose plain for
    # every later request too
    gate = DraftGate(
        min_samples=2,
        request_smoothing=0.5,
        smoothing=0.05,
        max_explore_interval=64,
        forced_explore_overhead=0.5,  # (the cap binds: it is what this test is about)
        prior_samples=0,
        explore_run=1,
    )
    for _ in range(4):  # warm-up: two drafting steps in a run, then two plain ones
        drafted = drafts_all(gate, ["hard"])
        gate.record(["hard"], drafted, [1], 0.100 if drafted else 0.030)
    # the hard one: 1 token per 100 ms drafting vs 1 per 30 ms plain -> plain
    assert drafts_all(gate, ["hard"]) is False
    # an easy request after it: the gate explores it within max_explore_interval steps, and one
    # good drafting step (7 tokens) is enough to draft from then on
    picks = [drafts_all(gate, ["easy"]) for _ in range(gate.max_explore_interval)]
    assert picks.count(True) == 1
    gate.record(["easy"], True, [7], 0.100)
    assert sum(drafts_all(gate, ["easy"]) for _ in range(8)) >= 6  # plain only explored
    # ...while the hard request, were it still running beside another hard one, would not draft
    assert gate.forecast_tokens(["easy"]) > 3.3 > gate.forecast_tokens(["hard2"])


def test_costly_exploration_is_rare_but_bounded() -> None:
    # a draft step takes 6x a plain step and emits 1.2x its tokens: each exploring step loses
    # 6 * (1 - 0.2) = 4.8 plain-step times, so a 2% budget allows one every 241 steps, and at a
    # rate ratio of 0.198 the odds (0.198 / 0.9)² = 0.048 stretch it to 4,980; the interval cap
    # (256) keeps the forecast fresh, but never at more than ``forced_explore_overhead`` of the
    # time: at 0.5% that is one exploration every 963 steps (at 2%, 241: the cap, 256, binds)
    # (explore_fraction 1: no partial exploration, whole drafting steps only)
    ids = [f"r{i}" for i in range(64)]
    lost = 0.060 * (1 - (76 / 0.060) / (64 / 0.010))  # 4.8 plain steps' time
    for forced, every in ((0.005, 963), (0.02, 256)):
        gate = DraftGate(
            explore_every=4,
            max_explore_interval=256,
            min_samples=1,
            explore_fraction=1.0,
            prior_samples=0,
            explore_run=1,
            max_explore_overhead=0.02,
            odds_power=2.0,
            forced_explore_overhead=forced,
        )
        drafts_all(gate, ids)
        gate.record(ids, True, [1] * 52 + [2] * 12, 0.060)  # 76 tokens, 1.1875 per request
        drafts_all(gate, ids)
        gate.record(ids, False, [1] * 64, 0.010)
        assert gate.explore_interval(lost, 0.010) == 241
        odds = gate.exploration_odds(76 / 0.060, 64 / 0.010)
        assert odds == pytest.approx((76 / 0.060 / (64 / 0.010) / 0.9) ** 2)
        assert gate.explore_interval(lost, 0.010, 0.02 * odds) == 256  # (not an exploration's)
        assert gate.explore_interval(lost, 0.010, 0.02 * odds, gate.forced_interval(lost, 0.010)) == every
        picks = [drafts_all(gate, ids) for _ in range(2 * every)]
        assert picks.count(True) == 2 and picks[every - 1] and picks[2 * every - 1]
    # near break-even the whole budget is spent: a rate at 0.9x plain's has odds 1
    assert gate.exploration_odds(0.9, 1.0) == pytest.approx(1.0) and gate.exploration_odds(0.45, 1.0) == 0.25
    # by default the odds fall with the fourth power: at temperature 1 on the demo pair, one
    # request, drafting's forecast at ~0.58x plain's rate (odds 0.17 instead of 0.41)
    assert DraftGate().exploration_odds(0.45, 1.0) == 0.0625
    capped = DraftGate(explore_every=4, max_explore_interval=64)
    assert capped.explore_interval(lost, 0.010) == 64
    assert capped.explore_interval(0.0, 0.010) == 4
    with pytest.raises(ValueError, match="forced_explore_overhead"):
        DraftGate(forced_explore_overhead=0.0)


def test_while_plain_is_faster_a_few_requests_explore_drafting_for_all() -> None:
    """Exploring with a whole drafting step at 64 requests loses 4.8 plain steps' time; drafting
    for the 8 requests known least (in a step where the rest take plain tokens) costs a fraction
    of it, and keeps every request's forecast and the regime's prior learning."""
    ids = [f"r{i}" for i in range(64)]
    gate = DraftGate(
        explore_every=4,
        max_explore_interval=4096,
        min_samples=1,
        partial_explore_overhead=0.01,
        prior_samples=0,
        request_smoothing=0.5,
        explore_run=1,
        odds_power=2.0,
    )
    assert gate.choose(ids) == list(range(64))  # warm-up: one of each
    gate.record(ids, True, [1] * 52 + [2] * 12, 0.060, regimes=[1.0] * 64)
    assert gate.choose(ids) == []
    gate.record(ids, False, [1] * 64, 0.010)
    assert gate.explore_size(64) == 8 and gate.explore_size(4) == 1
    # no partial step measured yet: its loss is taken as 8/64 of a whole one's (4.8 plain steps'),
    # on a budget of 1% times the odds of drafting winning
    whole = 0.060 * (1 - (76 / 0.060) / (64 / 0.010))
    odds = gate.exploration_odds(76 / 0.060, 64 / 0.010)
    assert gate.explore_interval(whole * 8 / 64, 0.010, 0.01) == 61  # at odds 1
    interval = gate.explore_interval(whole * 8 / 64, 0.010, 0.01 * odds)
    assert interval == math.ceil(whole * 8 / 64 / (0.01 * odds * 0.010)) == 1244
    picks = [gate.choose(ids) for _ in range(interval)]
    assert all(p == [] for p in picks[:-1])
    assert picks[-1] == list(range(8))  # all drafted once, at the same step: the first eight
    # the explored requests turn out easy, and the partial step cost 1.2 plain steps' time
    gate.record([ids[i] for i in picks[-1]], True, [4.0] * 8, 0.012, regimes=[1.0] * 8, num_requests=64)
    draft_rate, _ = gate.rates()[DraftGate.bucket_of(64)]
    assert draft_rate == pytest.approx((76 / 64 + 4.0) / 2 / 0.060)  # prior moved, step time kept
    assert gate.forecast_tokens([ids[0]]) > gate.forecast_tokens([ids[8]])
    lost = 0.012 - 0.010 * (8 * 4.0 + 56) / 64
    assert lost < 0.0  # drafting for a few paid: explorations as often as allowed
    picks = [gate.choose(ids) for _ in range(gate.explore_every)]
    assert picks[-1] == list(range(8, 16))  # the next eight, who have not drafted yet
    # a request leaving takes its forecast along; the whole-step exploration is capped
    gate.record([ids[i] for i in picks[-1]], True, [1.0] * 8, 0.020, regimes=[1.0] * 8, num_requests=64)
    full = [gate.choose(ids) for _ in range(256)]
    assert sum(len(p) == 64 for p in full) <= 1


def test_forecasts_follow_each_request_and_are_dropped_when_it_leaves() -> None:
    gate = DraftGate(min_samples=1, request_smoothing=0.5, smoothing=1.0)
    drafts_all(gate, ["a", "b"])
    gate.record(["a", "b"], True, [7, 1], 0.05)
    assert gate.forecast_tokens(["a"]) == pytest.approx(0.5 * 4 + 0.5 * 7)  # prior 4 = mean
    assert gate.forecast_tokens(["b"]) == pytest.approx(0.5 * 4 + 0.5 * 1)
    drafts_all(gate, ["a"])  # b finished: its forecast goes; a newcomer starts from the prior
    assert gate.forecast_tokens(["b"]) == pytest.approx(4.0)


def test_gate_ignores_unusable_timings() -> None:
    gate = DraftGate()
    gate.record(["a"] * 4, True, [10] * 4, 0.0)
    gate.record(["a"] * 4, True, [10] * 4, float("nan"))
    assert gate.rates() == {}
    assert drafts_all(gate, ["a", "b", "c", "d"]) is True


def test_warm_up_measures_both_choices_before_one_slow_step_can_decide() -> None:
    gate = DraftGate(min_samples=3)
    draft_steps = iter([(1, 0.030), (5, 0.015), (5, 0.015)])  # a cold first draft step, then normal
    picks = []
    for _ in range(6):
        drafted = drafts_all(gate, ["a"])
        picks.append(drafted)
        tokens, seconds = next(draft_steps) if drafted else (1, 0.007)
        gate.record(["a"], drafted, [tokens], seconds)
    # drafting steps first, in a run (only the first of them follows plain steps), then plain ones
    assert picks == [True, True, True, False, False, False]
    draft_rate, plain_rate = gate.rates()[DraftGate.bucket_of(1)]
    # step times start from the median of their first samples: the cold 30 ms step is left out
    assert draft_rate == pytest.approx((11 / 3) / 0.015) and plain_rate == pytest.approx(1 / 0.007)
    assert drafts_all(gate, ["a"]) is True  # a's own forecast: 0.5 * (0.5 * prior + 0.5 * 1) ... ≈ 4


def test_a_newcomer_starts_from_its_sampling_regimes_prior() -> None:
    # greedy requests accept far more than sampled ones: after greedy traffic trained the load
    # bucket's mean, a temperature-1 newcomer must start from what temperature-1 requests emitted
    gate = DraftGate(min_samples=1, smoothing=1.0, prior_smoothing=1.0, request_smoothing=0.5)
    gate.record(["g1", "g2"], True, [5.0, 5.0], 0.05, regimes=[0.0, 0.0])
    gate.record(["s1", "s2"], True, [1.5, 1.5], 0.05, regimes=[1.0, 1.0])
    assert gate.forecast_tokens(["new"], [1.0]) == pytest.approx(1.5)
    assert gate.forecast_tokens(["new"], [0.0]) == pytest.approx(5.0)
    # an unseen regime, or no regimes given: the bucket's mean (of the last step: smoothing 1)
    assert gate.forecast_tokens(["new"], [0.7]) == pytest.approx(1.5)
    assert gate.forecast_tokens(["new"]) == pytest.approx(1.5)
    # a load bucket without samples of its regimes: its own mean, scaled by the regime's standing
    # over every load (its plans verify fewer drafts at this load, so fewer tokens for everyone)
    eight = [f"m{i}" for i in range(8)]
    gate.record(eight, True, [2.0] * 8, 0.2)  # regimes unknown: the bucket mean is 2.0
    assert gate.forecast_tokens([f"n{i}" for i in range(8)], [0.0] * 8) == pytest.approx(8 * 2.0 * 5.0 / 2.0)


def test_forecasts_are_corrected_by_what_drafting_kept_per_regime() -> None:
    # the greedy calibration underestimates acceptance on this traffic (plans expect 2 tokens,
    # requests keep 3): drafting (3 tokens in 2.5 plain steps' time) pays, though the plans'
    # expectation alone (2 tokens) says it does not; sampled requests keep what they expect
    # (one step's word taken as it is here; the next test weighs it against the calibration's)
    gate = DraftGate(min_samples=1, smoothing=1.0, request_smoothing=0.5, ratio_prior_steps=0)
    ids = ["g1", "g2", "s1", "s2"]
    regimes = [0.0, 0.0, 1.0, 1.0]
    gate.record(ids, True, [2.0, 2.0, 1.5, 1.5], 0.025, regimes=regimes, kept=[3, 3, 1.5, 1.5])
    gate.record(ids, False, [1] * 4, 0.010)
    assert gate.realised_ratio(0.0) == pytest.approx(1.5) and gate.realised_ratio(1.0) == pytest.approx(1.0)
    assert gate.realised_ratio(0.7) == 1.0  # not measured: no correction
    assert gate.forecast_tokens(["g1"], [0.0]) == pytest.approx((0.5 * 1.75 + 0.5 * 2.0) * 1.5)  # own EMA
    assert gate.forecast_tokens(["s1"], [1.0]) == pytest.approx(0.5 * 1.75 + 0.5 * 1.5)
    greedy = ["n1", "n2", "n3", "n4"]
    assert gate.choose(greedy, [0.0] * 4) == [0, 1, 2, 3]  # 12 tokens / 25 ms beat 4 / 10 ms
    assert gate.choose(["m1", "m2", "m3", "m4"], [1.0] * 4) == []  # 6 / 25 ms do not
    # without the kept tokens there is nothing to correct by
    plain = DraftGate(min_samples=1, smoothing=1.0)
    plain.record(ids, True, [2.0, 2.0, 1.5, 1.5], 0.025, regimes=regimes)
    assert plain.realised_ratio(0.0) == 1.0


def test_a_few_unlucky_steps_do_not_outvote_the_calibration() -> None:
    # served cold on the K=8 twin at one request, code, temperature 0: the first dozen drafting
    # steps kept 1-3 tokens where their plans expected ~2.5 (one step's kept / expected spreads by
    # ~0.6 of itself), the ratio of those few fell to 0.55-0.7 and held plain steps for ~150
    # steps, though over the whole run requests kept 1.03x what the plans expected
    def gate_after(kept: list[int]) -> DraftGate:
        gate = DraftGate(min_samples=1, smoothing=1.0, request_smoothing=1.0)
        for i, k in enumerate(kept):
            gate.record([f"r{i}"], True, [2.5], 0.040, regimes=[0.0], kept=[k])
        gate.record(["r"], False, [1], 0.020)  # break-even: 2 tokens a drafting step
        return gate

    unlucky = gate_after([2, 1, 1, 3])  # 1.75 / 2.5 = 0.7 taken as it is
    assert 0.9 < unlucky.realised_ratio(0.0) == pytest.approx((4 * 0.7 + 16) / 20)
    # a newcomer's forecast (2.5 x 0.94) still clears the bar into drafting (2 x 1.15)
    assert unlucky.choose(["new"], [0.0]) == [0]
    # a lasting shortfall is learnt all the same: 200 steps at 0.7 weigh 200 against 16
    short = gate_after([2, 1, 2, 2, 1] * 40)  # 1.6 / 2.5 = 0.64
    assert short.realised_ratio(0.0) == pytest.approx((200 * 0.64 + 16) / 216)
    assert short.choose(["new"], [0.0]) == []
    plain_weight = DraftGate(min_samples=1, smoothing=1.0, request_smoothing=1.0, ratio_prior_steps=0)
    plain_weight.record(["a"], True, [2.5], 0.040, regimes=[0.0], kept=[1])
    assert plain_weight.realised_ratio(0.0) == pytest.approx(0.5)  # (0.4, clipped)


def test_newcomers_are_explored_while_their_prior_rests_on_few_samples() -> None:
    # a fresh server's first request (a short warm-up prompt) accepted little: on that prior
    # alone, every later request stayed on plain steps and the prior never learnt otherwise
    gate = DraftGate(explore_every=4, min_samples=1, prior_samples=3, smoothing=0.05, request_smoothing=0.5)
    gate.choose(["warm"], [0.0])
    gate.record(["warm"], True, [1.2], 0.004, regimes=[0.0], kept=[1])
    gate.choose(["warm"], [0.0])
    gate.record(["warm"], False, [1], 0.001)
    drafted, first = [], []
    for name in ("a", "b", "c"):
        picks = []
        for _ in range(6):
            picks.append(bool(gate.choose([name], [0.0])))
            if picks[-1]:  # it drafted: 5.5 tokens expected, 6 kept, as code at temperature 0
                gate.record([name], True, [5.5], 0.004, regimes=[0.0], kept=[6])
            else:
                gate.record([name], False, [1], 0.001)
        drafted.append(sum(picks))
        first.append(picks.index(True))
    # a: plain on the weak prior (1.2 tokens < 4, a drafting step's time in plain steps), then
    # explored at its 4th step; its own forecast pays from then on. The prior has learnt too:
    # b and c draft from the start (but for the plain step explored now and then)
    assert first[0] == 3 and drafted[0] == 3 and min(first[1:]) <= 1 and min(drafted[1:]) >= 4
    # a regime whose prior is settled is not explored for each newcomer
    settled = DraftGate(explore_every=4, min_samples=1, prior_samples=2)
    for _ in range(2):
        settled.choose(["s"], [1.0])
        settled.record(["s"], True, [1.1], 0.004, regimes=[1.0])
    settled.record(["s"], False, [1], 0.001)
    assert not any(settled.choose(["new"], [1.0]) for _ in range(8))


def test_newcomers_are_not_explored_where_even_a_generous_prior_loses() -> None:
    # served cold on the demo pair at one request, a drafting step cost ~6 plain steps' time for
    # 2-3 tokens; exploring each newcomer until the prior stood on 20 steps cost ~9% of the
    # first 12 requests. A prior of 2 steps read generously (x 2.25) still loses here
    gate = DraftGate(prior_samples=20, smoothing=0.2)
    for _ in range(2):  # the warm-up: two drafting steps
        assert gate.choose(["warm"], [0.0]) == [0]
        gate.record(["warm"], True, [2.0], 0.006, regimes=[0.0], kept=[2])
    drafting = 0
    for k in range(10):  # ten requests of 100 steps each, one at a time
        for _ in range(100):
            if gate.choose([f"n{k}"], [0.0]):
                drafting += 1
                gate.record([f"n{k}"], True, [2.0], 0.006, regimes=[0.0], kept=[2])
            else:
                gate.record([f"n{k}"], False, [1], 0.001)
    assert drafting == 0
    # where the same prior read generously is near plain steps' rate, the first newcomer is
    # explored after the warm-up's plain step and explore_every more
    near = DraftGate(prior_samples=20, smoothing=0.2)
    for _ in range(2):
        near.choose(["warm"], [0.0])
        near.record(["warm"], True, [3.0], 0.006, regimes=[0.0], kept=[3])
    picks = []
    for _ in range(8):
        picks.append(bool(near.choose(["a"], [0.0])))
        if picks[-1]:
            near.record(["a"], True, [3.0], 0.006, regimes=[0.0], kept=[3])
        else:
            near.record(["a"], False, [1], 0.001)
    assert picks.index(True) == 5 and sum(picks) == 3


def test_a_stale_forecast_returns_to_its_regimes_prior() -> None:
    # a request that drafted through a hard stretch would otherwise keep its low forecast until
    # its next exploration, while high forecasts are refreshed at every drafting step: forecasts
    # left alone would be biased low, and the gate would keep plain steps where drafting pays
    gate = DraftGate(
        min_samples=1, smoothing=1.0, prior_smoothing=1.0, request_smoothing=1.0, forecast_half_life=8.0
    )
    gate.record(["easy"], True, [5.0], 0.004, regimes=[0.0])  # the regime's prior: 5 tokens
    gate.record(["hard"], True, [1.0], 0.004, regimes=[0.0])  # ... now 1 (smoothing 1)
    gate.record(["easy"], True, [5.0], 0.004, regimes=[0.0])  # ... 5 again
    gate.record(["hard"], False, [1], 0.001)
    assert gate.forecast_tokens(["hard"], [0.0]) == pytest.approx(1.0)  # just drafted: its own
    for _ in range(8):
        gate.choose(["hard"], [0.0])  # steps in which it does not draft
    assert gate.forecasts.drafted_at["hard"] == 0  # it last drafted before the first of these steps
    assert gate.forecast_tokens(["hard"], [0.0]) == pytest.approx(5.0 + (1.0 - 5.0) * 0.5)
    for _ in range(16):
        gate.choose(["hard"], [0.0])
    assert gate.forecast_tokens(["hard"], [0.0]) == pytest.approx(5.0 + (1.0 - 5.0) * 0.5**3)


def test_one_requests_hard_stretch_does_not_become_the_prior_it_returns_to() -> None:
    # at one request, the last drafting steps before a drop to plain steps are that request's own
    # hard stretch: a prior that followed them as fast as the step times (smoothing 0.05) sat at
    # ~2.6 tokens where the traffic kept ~4.9 (HumanEval, temperature 0, in-process), so the
    # forecast was drawn back to its own low value and 27% of the steps were plain against 10%
    gate = DraftGate(min_samples=1, forecast_half_life=8.0, explore_every=64)
    for r in range(10):  # earlier requests: 5 tokens a drafting step, 3 plain steps' time
        for _ in range(20):
            gate.record([f"r{r}"], True, [5.0], 0.003, regimes=[0.0], kept=[5])
            gate.record([f"r{r}"], False, [1], 0.001)
    for _ in range(20):  # the request now running hits a hard stretch
        gate.record(["hard"], True, [1.5], 0.003, regimes=[0.0], kept=[1])
    prior = gate.forecast_tokens(["new"], [0.0])
    assert prior > 4.5  # what the traffic kept, not the hard stretch
    # its own forecast (1.5 tokens < 3 plain steps' time) is drawn back to that prior by half
    # every 8 steps; drafting is entered at 3.45 (the entry margin) after ~12 plain steps (at the
    # end of a held plain choice: 17), long before an exploration (64 steps) would bring it back
    plain_steps = 0
    while not gate.choose(["hard"], [0.0]) and plain_steps < 63:
        plain_steps += 1
    assert 8 <= plain_steps <= 20


def test_a_drafting_step_after_plain_ones_prices_the_switch_not_drafting() -> None:
    # served at one request, the first drafting step after plain ones took 6-8 ms (cold drafter
    # weights and code) where drafting steps in a run took 4.2-4.5: priced as drafting, the cold
    # step kept the gate on plain steps, so every drafting step was cold, for good
    gate = DraftGate(
        min_samples=1, smoothing=1.0, request_smoothing=1.0, max_explore_overhead=0.5, explore_run=3
    )
    assert drafts_all(gate, ["a"]) is True  # warm-up
    gate.record(["a"], True, [3.0], 0.004)
    assert drafts_all(gate, ["a"]) is False
    gate.record(["a"], False, [1], 0.001)
    # 3 tokens per 4 ms < 1 per 1 ms: plain, but for an exploration run of three drafting steps
    picks = [False]
    for _ in range(40):
        picks.append(drafts_all(gate, ["a"]))
        if not picks[-1]:
            gate.record(["a"], False, [1], 0.001)
        elif picks[-2]:  # drafting after drafting: a warm step (its catch-up call: 20 us)
            gate.record(["a"], True, [3.0], 0.004, switch_seconds=0.00002)
        else:  # the switch: 3 ms slower than a warm step, and 2 ms of put-off writes
            gate.record(["a"], True, [3.0], 0.007, switch_seconds=0.002)
    first = picks.index(True)
    assert picks[first : first + 4] == [True, True, True, False]
    bucket = gate._bucket(1)
    assert bucket.draft_seconds.value == pytest.approx(0.004)  # the cold steps left it alone
    # their excess and the catch-up; the warm steps' own catch-ups are not a switch
    assert bucket.switch_seconds.value == pytest.approx(0.005)


def test_an_exploration_run_ends_when_its_requests_change() -> None:
    # a run measures warm drafting steps of the requests it explores; a newcomer joining it
    # would pay its whole prompt's catch-up (at four requests on the demo pair ~10-20 ms a step
    # against ~6 warm), so the run stops there and the next choice is made in full
    picks = []
    for join in (False, True):
        gate = DraftGate(
            min_samples=1,
            smoothing=1.0,
            request_smoothing=1.0,
            explore_run=3,
            prior_samples=0,
            explore_fraction=1.0,
        )
        ids = ["a", "b"]
        assert drafts_all(gate, ids) is True  # warm-up
        gate.record(ids, True, [1.5, 1.5], 0.006)
        assert drafts_all(gate, ids) is False
        gate.record(ids, False, [1, 1], 0.001)
        while not drafts_all(gate, ids):  # plain (0.5 tokens/ms against 2) until an exploration
            gate.record(ids, False, [1, 1], 0.001)
        gate.record(ids, True, [1.5, 1.5], 0.006)
        if join:
            ids = ids + ["c"]  # (the same load bucket)
        picks.append(drafts_all(gate, ids))
    assert picks == [True, False]


def test_starting_to_draft_pays_the_switch_staying_does_not() -> None:
    # 4.5 tokens per 4 ms drafting step beat 1 per 1 ms plain step in a run of drafting steps,
    # but not from plain steps, whose switch into drafting costs 6 ms more (2 ms a step over
    # the three-step run it starts)
    # (max_hold=0: the test sets the gate's state between choices, which a held choice ignores)
    gate = DraftGate(
        min_samples=1, smoothing=1.0, request_smoothing=1.0, explore_run=3, enter_margin=1.0, max_hold=0
    )
    bucket = gate._bucket(1)
    bucket.draft_seconds.update(0.004, 1.0)
    bucket.plain_seconds.update(0.001, 1.0)
    bucket.switch_seconds.update(0.006, 1.0)
    gate.forecasts.own["b"] = 4.5
    gate._last_drafted = False
    assert drafts_all(gate, ["b"]) is False
    gate._last_drafted = True
    assert drafts_all(gate, ["b"]) is True
    # with a cheaper switch (0.9 ms: 0.3 ms a step), starting pays too
    bucket.switch_seconds.update(0.0009, 1.0)
    gate._last_drafted = False
    assert drafts_all(gate, ["b"]) is True


def test_from_plain_steps_drafting_must_win_by_the_margin_once_drafting_it_stays_near_even() -> None:
    # near break-even the choice would flip on noise, and every flip into drafting pays the
    # switch: entering needs enter_margin (1.15) over plain steps' rate, staying needs
    # stay_ratio (0.95) of it
    gate = DraftGate(min_samples=1, smoothing=1.0, request_smoothing=1.0, explore_run=3, prior_samples=0)
    assert (gate.enter_margin, gate.stay_ratio) == (1.15, 0.95)
    bucket = gate._bucket(1)
    bucket.draft_seconds.update(0.004, 1.0)
    bucket.plain_seconds.update(0.001, 1.0)
    cases = ((4.4, False, True), (4.8, True, True), (3.9, False, True), (3.7, False, False))
    for tokens, from_plain, from_drafting in cases:
        gate.forecasts.own["b"] = tokens  # 4.4 per 4 ms: 1.1x plain; 4.8: 1.2x; 3.9: 0.975x; 3.7: 0.925x
        gate._hold = None  # (a forecast moves through ``record``, which ends a held choice)
        bucket.since_plain = bucket.since_explore = 0  # (no exploration is due)
        gate._last_drafted, gate._run_left = False, 0
        assert drafts_all(gate, ["b"]) is from_plain, tokens
        bucket.since_plain = bucket.since_explore = 0
        gate._last_drafted, gate._run_left, gate._hold = True, 0, None
        assert drafts_all(gate, ["b"]) is from_drafting, tokens
    with pytest.raises(ValueError):
        DraftGate(enter_margin=0.9)
    with pytest.raises(ValueError, match="stay_ratio"):
        DraftGate(stay_ratio=1.1)


def test_plain_steps_are_explored_only_when_the_plain_step_time_is_stale() -> None:
    # a plain step emits one token whatever the request: exploring one refreshes the load's plain
    # step time and nothing else, so while other plain steps measure it, a request that drafts
    # well is not interrupted (each interruption also paid the switch back into drafting)
    def run(fresh_plain: bool) -> int:
        gate = DraftGate(min_samples=1, smoothing=1.0, request_smoothing=1.0, explore_every=4)
        assert drafts_all(gate, ["e"]) is True
        gate.record(["e"], True, [1.6], 0.004)
        assert drafts_all(gate, ["e"]) is False
        gate.record(["e"], False, [1], 0.0035)  # 1.6 tokens per 4 ms beat 1 per 3.5 ms
        plain = 0
        for step in range(200):
            drafted = drafts_all(gate, ["e"])
            plain += not drafted
            gate.record(["e"], drafted, [1.6] if drafted else [1], 0.004 if drafted else 0.0035)
            if fresh_plain and step % 3 == 0:
                gate.record_plain(1, 0.0035)  # another request's plain step at this load
        return plain

    assert run(fresh_plain=False) >= 3  # stale: explored now and then
    assert run(fresh_plain=True) == 0


def test_refreshing_the_plain_step_time_costs_at_most_its_budget() -> None:
    # one request drafting well (5 tokens per 2.3 ms against 1 per 0.7 ms): each plain step that
    # refreshes the plain step time loses ~0.24 ms; at one request on the demo pair a 2% budget
    # took one plain step in five (the time lost was more than the budget, the first drafting
    # step after a plain one being slower), so the refresh has a budget of its own, 0.5%
    def refreshes(**kw: float) -> int:
        gate = DraftGate(min_samples=1, smoothing=1.0, request_smoothing=1.0, **kw)  # type: ignore[arg-type]
        _warm(gate, ["e"], (5, 0.0023), 0.0007)
        plain = 0
        for _ in range(600):
            drafted = drafts_all(gate, ["e"])
            plain += not drafted
            gate.record(["e"], drafted, [5] if drafted else [1], 0.0023 if drafted else 0.0007)
        return plain

    default, old = refreshes(), refreshes(refresh_overhead=0.02)
    lost = 0.0007 * (1 - (1 / 0.0007) / (5 / 0.0023))
    assert default * lost / (600 * 0.0023) <= 0.006
    assert default >= 10 and old >= 3 * default
    with pytest.raises(ValueError, match="refresh_overhead"):
        DraftGate(refresh_overhead=0.0)


def test_a_seeded_buckets_first_measurement_replaces_the_seed() -> None:
    """A load bucket seen for the first time starts from the nearest measured one's step times,
    scaled; its first measured step replaces that estimate (it must not be outvoted by it)."""
    gate = DraftGate(min_samples=2, explore_run=1)
    small = IDS8[:2]  # bucket of 2 requests
    for _ in range(2):  # warm-up: two drafting steps, then two plain ones
        assert drafts_all(gate, small) is True
        gate.record(small, True, [4.0] * 2, 0.010)
    for _ in range(2):
        assert drafts_all(gate, small) is False
        gate.record(small, False, [1] * 2, 0.004)
    big = [f"b{i}" for i in range(8)]  # two buckets up: seeded as 4x the small one's times
    assert drafts_all(gate, big) is False  # one plain step first: it measures the plain seed
    gate.record(big, False, [1] * 8, 0.016)
    assert drafts_all(gate, big) is True  # drafting looks 2x cheaper than it is: it drafts
    assert gate.rates()[gate.bucket_of(8)][0] == pytest.approx(4.0 / 0.040)
    gate.record(big, True, [4.0] * 8, 0.080)  # the first step after plain ones: the switch's
    assert drafts_all(gate, big) is True
    gate.record(big, True, [4.0] * 8, 0.080)  # a warm drafting step: twice the seed
    assert gate.rates()[gate.bucket_of(8)][0] == pytest.approx(4.0 / 0.080)


def test_a_seeded_plain_step_time_is_measured_before_it_is_believed() -> None:
    """At a load first seen, the plain step time is a neighbour's scaled by 2 per bucket: on the
    K=8 twin served at four requests that said 78 ms where a plain step took 31-34, and drafting
    (~70 ms for ~2.1 tokens a request) was chosen and held on it. One plain step measures it."""
    gate = DraftGate(min_samples=1, smoothing=1.0, request_smoothing=1.0, prior_samples=0)
    _warm(gate, ["a"], (4, 0.020), 0.010)  # one request: 4 tokens in 20 ms beat 1 in 10
    four = ["p", "q", "r", "s"]
    gate.record(four, True, [4.0] * 4, 0.080)  # drafting measured at four requests: 4 tokens each
    assert gate.times()[DraftGate.bucket_of(4)][("plain", "step")] == pytest.approx(0.040)  # a seed
    assert drafts_all(gate, four) is False  # 16 tokens / 80 ms beat 4 / 40 ms on the seed: measure it
    gate.record(four, False, [1] * 4, 0.012)
    assert gate.times()[DraftGate.bucket_of(4)][("plain", "step")] == pytest.approx(0.012)
    assert sum(drafts_all(gate, four) for _ in range(8)) == 0  # 4 tokens / 12 ms win: plain


def test_a_load_first_seen_is_seeded_along_the_forward_time_curve() -> None:
    """Where a forward's time grows slower than its batch (reading the weights, then compute),
    doubling per bucket overstates a drafting step at a new load: on the K=8 twin the seed said
    178 ms at four requests, a drafting step took ~100 ms, and plain steps were held on it."""

    def forward_seconds(batch_tokens: int) -> float:  # 10 ms + 1 ms a token
        return 0.010 + 0.001 * batch_tokens

    def gate_at_four(curve: bool) -> tuple[DraftGate, list[bool]]:
        kw = {"forward_seconds": forward_seconds} if curve else {}
        gate = DraftGate(min_samples=1, smoothing=1.0, request_smoothing=1.0, prior_samples=0, **kw)
        _warm(gate, ["a"], (4, 0.030), 0.012)  # one request: 4 tokens in 30 ms, 1 in 12
        four = ["p", "q", "r", "s"]
        picks = []
        for _ in range(4):
            picks.append(drafts_all(gate, four))
            if picks[-1]:
                gate.record(four, True, [4.0] * 4, 0.045)
            else:
                gate.record(four, False, [1] * 4, 0.020)
        return gate, picks

    gate, picks = gate_at_four(curve=True)
    # drafting at four requests: 30 ms x forward(4 x 5 tokens) / forward(5) = 30 x 30 / 15
    assert seed_scales(forward_seconds, 1, 3, 4.0) == pytest.approx((14 / 11, 2.0))
    # a plain step measures the seeded plain time; then drafting (16 tokens / 60 ms seeded, 45
    # measured) beats 4 tokens / 20 ms by the margin
    assert picks == [False, True, True, True]
    _, doubled = gate_at_four(curve=False)  # 120 ms seeded: 16 tokens / 120 ms lose
    assert doubled == [False, False, False, False]


def test_the_switch_is_priced_over_the_stays_drafting_lasts_at_this_load() -> None:
    """On the K=8 twin at four requests a drafting step (~100 ms, ~16 tokens) beat a plain one
    (~35 ms, 4 tokens), but each request that finished left a step at three requests (its
    successor's prompt filling the step: plain), and re-entering drafting paid a switch of
    ~110 ms (that prompt's put-off context). Priced over an exploration run (3 steps) the switch
    kept the gate on plain steps; drafting stays there lasted ~8-12 steps per switch."""

    def gate_after_a_stay(stay: int, prompt_seconds: float = 0.0) -> bool:
        gate = DraftGate(min_samples=1, smoothing=1.0, request_smoothing=1.0, prior_samples=0)
        four = ["p", "q", "r", "s"]
        _warm(gate, four, (4, 0.100), 0.035)
        for i in range(stay):  # a stay of drafting steps, the first one paying the switch
            assert drafts_all(gate, four) is True
            switch, prompts = (0.110, prompt_seconds) if i == 0 else (0.0, 0.0)
            gate.record(four, True, [4.0] * 4, 0.100, switch_seconds=switch, prompt_seconds=prompts)
        assert drafts_all(gate, ["p", "q", "r"]) is False  # s finished: a plain step at three
        gate.record(["p", "q", "r"], False, [1] * 3, 0.030)
        return drafts_all(gate, ["p", "q", "r", "t"])  # t joined: enter drafting again?

    # 16 tokens / (100 + 110 / 12) ms beat 4 / 35 by the margin; / (100 + 110 / 3) they do not
    assert gate_after_a_stay(12) is True
    assert gate_after_a_stay(3) is False
    # of those 110 ms, 90 wrote prompts' context: a request pays that once, whenever it first
    # drafts, so re-entering is priced on the other 20 (16 / (100 + 20 / 3) beat 4 / 35 too)
    assert gate_after_a_stay(3, prompt_seconds=0.090) is True


def test_steps_are_priced_with_the_loops_time_between_them() -> None:
    # one request: drafting 4 tokens in 5 ms (800 tok/s) loses to plain steps of 1 ms (1000
    # tok/s) as steps alone; but the loop spends 2 ms between any two steps (streaming the
    # outputs), so a plain iteration is 3 ms (333 tok/s) and a drafting one 7 ms (571 tok/s)
    def gate_after(outside_s: float) -> DraftGate:
        gate = DraftGate(min_samples=1, prior_samples=0, max_explore_interval=1024, explore_run=1)
        _warm(gate, ["a"], (4, 0.005), 0.001)
        for drafted in (True, False):
            if outside_s:
                gate.record_outside(1, drafted, outside_s)
        return gate

    alone = gate_after(0.0)
    assert sum(drafts_all(alone, ["a"]) for _ in range(16)) <= 1  # plain, drafting only explored
    looped = gate_after(0.002)
    assert sum(drafts_all(looped, ["a"]) for _ in range(16)) >= 15
    draft_rate, plain_rate = looped.rates()[DraftGate.bucket_of(1)]
    assert (draft_rate, plain_rate) == (pytest.approx(4 / 0.007), pytest.approx(1 / 0.003))
    # the loop's time is kept per step kind; an unmeasured kind borrows the other's
    other = DraftGate(min_samples=1, prior_samples=0)
    _warm(other, ["a"], (4, 0.005), 0.001)
    other.record_outside(1, False, 0.002)
    assert other.rates()[DraftGate.bucket_of(1)] == (pytest.approx(4 / 0.007), pytest.approx(1 / 0.003))
    other.record_outside(1, True, 0.004)
    assert other.rates()[DraftGate.bucket_of(1)][0] == pytest.approx(4 / 0.009)


def test_one_stall_between_steps_does_not_price_the_next_dozens_of_steps() -> None:
    # the loop's time between plain steps is 1 ms; one 200 ms stall (the process descheduled)
    # counts as at most 4x the estimate, so the next plain iteration is not priced at ~11 ms
    gate = DraftGate(min_samples=1, prior_samples=0)
    _warm(gate, ["a"], (4, 0.005), 0.001)
    for _ in range(4):
        gate.record_outside(1, False, 0.001)
    gate.record_outside(1, False, 0.200)
    plain_loop = gate.times()[DraftGate.bucket_of(1)][("plain", "loop")]
    assert plain_loop == pytest.approx(0.001 + 0.2 * (0.004 - 0.001))  # one sample at 4 ms, weight 1/5
    # a lasting change still moves the estimate up within a few dozen steps
    for _ in range(40):
        gate.record_outside(1, False, 0.010)
    assert gate.times()[DraftGate.bucket_of(1)][("plain", "loop")] > 0.008


def _replay(gate: DraftGate, steps: int) -> tuple[list[list[int]], int]:
    """A fixed trace of requests joining and leaving while drafting loses by ~3x; every choice
    is recorded as the engine would (a drafting step: 2 tokens per request in 6 ms; a plain
    step: 1 ms). -> (the choices, how many were made in full)."""
    full = 0
    inner = gate._choose

    def counted(*args: object, **kwargs: object) -> list[int]:
        nonlocal full
        full += 1
        return inner(*args, **kwargs)  # type: ignore[arg-type]

    gate._choose = counted  # type: ignore[method-assign]
    choices = []
    for step in range(steps):
        ids = [f"q{i}" for i in range(step // 97, step // 97 + 1 + (step // 200) % 3)]
        chosen = gate.choose(ids, [0.0] * len(ids))
        choices.append(chosen)
        if chosen:
            picked = [ids[i] for i in chosen]
            gate.record(picked, True, [2.0] * len(picked), 0.006, num_requests=len(ids))
        else:
            gate.record(ids, False, [1] * len(ids), 0.001)
    return choices, full


def test_a_clear_plain_choice_is_held_without_changing_any_choice() -> None:
    held, held_full = _replay(DraftGate(max_hold=8, max_explore_interval=45), 3000)
    fresh, fresh_full = _replay(DraftGate(max_hold=0, max_explore_interval=45), 3000)
    assert held == fresh  # same plain steps, same explorations, same newcomers explored
    assert sum(bool(c) for c in held) >= 10  # and the trace does explore
    assert fresh_full == 3000 and held_full < 3000 / 3  # most choices were held


def test_warm_up_and_explorations_wait_for_a_step_where_every_request_can_draft() -> None:
    """While prompts fill the step's budget (room for fewer draft tokens than requests), a step
    that drafted would draft for a few requests only: a partial step, which measures neither a
    drafting step nor a plain one. The warm-up and whole-step explorations wait for room."""
    ids = [f"r{i}" for i in range(16)]
    gate = DraftGate(
        min_samples=2,
        explore_every=2,
        max_explore_interval=8,
        forced_explore_overhead=0.5,
        prior_samples=0,
        explore_run=1,
    )
    for _ in range(20):  # ramping up: every step carries a prompt chunk
        assert gate.choose(ids, room=5) == []
        gate.record_plain(16, 0.010)
    assert gate.choose(ids, room=16) == list(range(16))  # the first step with room: warm-up
    gate.record(ids, True, [1.2] * 16, 0.060)
    assert gate.choose(ids, room=200) == list(range(16))
    gate.record(ids, True, [1.2] * 16, 0.060)
    assert gate.choose(ids, room=200) == []  # measured: drafting loses (19.2 / 60 ms < 16 / 10 ms)
    # an exploration falls due (max_explore_interval) but waits for room, then runs
    picks = []
    for _ in range(16):
        picks.append(gate.choose(ids, room=3))
        gate.record_plain(16, 0.010)
    assert all(p == [] or len(p) < 16 for p in picks)
    assert gate.choose(ids, room=16) == list(range(16))


def test_a_bucket_that_measured_only_plain_steps_takes_drafting_from_its_measured_neighbour() -> None:
    """A load ramping up fills a bucket with plain samples only (prompts take the budget); once a
    neighbouring bucket is measured, the bucket prices drafting from it (scaled by the load
    ratio) instead of warming up by drafting where drafting clearly loses."""
    gate = DraftGate(min_samples=2, explore_every=4, max_explore_interval=4096, prior_samples=0)
    mid = [f"m{i}" for i in range(40)]  # bucket of 32-63 requests: plain samples while ramping up
    for _ in range(4):
        assert gate.choose(mid, room=0) == []
        gate.record_plain(40, 0.075)
    top = [f"t{i}" for i in range(64)]  # 64 requests: warmed up (drafting loses 2.3 x 64 / 0.587 s)
    for _ in range(2):
        assert gate.choose(top, room=10_000) == list(range(64))
        gate.record(top, True, [2.3] * 64, 0.587)
    for _ in range(2):
        assert gate.choose(top, room=10_000) == []
        gate.record_plain(64, 0.160)
    # ramping down: the mid bucket now has room and decides on rates, no warm-up drafting
    picks = [gate.choose(mid, room=10_000) for _ in range(8)]
    assert all(len(p) < len(mid) for p in picks)


def test_a_held_drafting_choice_is_the_choice_a_full_one_would_make() -> None:
    # while drafting clearly wins, the gate holds it for the next steps of the same requests
    # instead of choosing in full (their lessons wait meanwhile: HeldLessons); with nothing learnt
    # in between, every held choice and every plain-time refresh falls where full choices put it
    def gate(max_hold: int) -> DraftGate:
        g = DraftGate(min_samples=1, smoothing=1.0, request_smoothing=1.0, prior_samples=0, max_hold=max_hold)
        b = g._bucket(2)
        b.draft_seconds.update(0.002, 1.0)
        b.plain_seconds.update(0.001, 1.0)
        g.forecasts.own.update({"a": 6.0, "b": 6.0})  # 12 tokens per 2 ms: 3x plain's 2 per 1 ms
        return g

    held, full = gate(8), gate(0)
    full_choices = []
    inner = held._choose

    def counting(
        ids: list[str],
        regimes: list[float] | None,
        whole: bool,
        remaining: list[int] | None,
        able: list[int] | None,
        catch_up_seconds: float = 0.0,
    ) -> list[int]:
        full_choices.append(held._steps)
        return inner(ids, regimes, whole, remaining, able, catch_up_seconds)

    held._choose = counting  # type: ignore[method-assign]
    ids = ["a", "b"]
    choices = [drafts_all(held, ids) for _ in range(400)]
    assert choices == [drafts_all(full, ids) for _ in range(400)]
    assert 4 <= choices.count(False) <= 8  # plain steps refresh the plain time, every ~67 steps
    assert len(full_choices) < 400 / 5  # most choices were held ones
    # a step of other requests ends the hold: it is chosen in full
    assert held.holds(ids) or held._hold is None
    before = len(full_choices)
    drafts_all(held, ["a"])  # (a plain step: it measures the new load's seeded plain time)
    assert len(full_choices) == before + 1


def test_a_newcomer_is_explored_where_requests_before_it_show_learning_it_pays() -> None:
    # served cold on the K=8 twin at one request (code, temperature 0): a drafting step took
    # ~45 ms against ~19 ms plain, the first requests kept 1-2 tokens a drafting step, and on
    # their prior later requests stayed on plain steps for 27% of the request-steps, though
    # some of them kept 6 a step once explored
    def gate_after(strong: float) -> DraftGate:
        gate = DraftGate(prior_samples=0)  # (the prior's sample count plays no part here)
        for name in ("first", "second"):  # weak requests, drafting 40 steps each
            for _ in range(40):
                gate.record([name], True, [1.5], 0.045, regimes=[0.0], kept=[1.5])
        for _ in range(4):  # one that drafted a few steps
            gate.record(["third"], True, [strong], 0.045, regimes=[0.0], kept=[strong])
        for _ in range(3):
            gate.record(["third"], False, [1], 0.019)
        return gate

    def drafting_steps(gate: DraftGate, remaining: int) -> int:
        drafted = 0
        for _ in range(12):
            if gate.choose(["new"], [0.0], None, [remaining]):
                drafted += 1
                gate.record(["new"], True, [1.7], 0.045, regimes=[0.0], kept=[1.7])
            else:
                gate.record(["new"], False, [1], 0.019)
        return drafted

    # one of the three requests before it drafted at 6 tokens a step (7.5 ms a token against
    # 19 plain): over 120 tokens, learning whether the newcomer is such a one pays its run
    assert drafting_steps(gate_after(6.0), 120) == 3
    # a newcomer with 5 tokens left, or requests that all drafted slower than plain steps
    assert drafting_steps(gate_after(6.0), 5) == 0
    assert drafting_steps(gate_after(2.0), 120) == 0


def test_a_plain_step_time_far_off_after_a_long_gap_starts_over() -> None:
    """A load's plain step time learnt while the machine was busy (3.3 ms) is not what plain
    steps cost later (0.8 ms). While drafting (3 tokens per 4.2 ms) seems to win, plain steps
    are taken only to refresh that time, one every tens to hundreds of steps: the first such
    refresh, far off the estimate after a long gap, restarts it, and the gate turns to plain
    steps at once, where a moving average would keep drafting for thousands of steps."""

    def drafting_steps(gate: DraftGate, steps: int) -> tuple[int, int]:
        drafted_total, first_plain = 0, -1
        for step in range(steps):
            drafted = drafts_all(gate, ["e"])
            drafted_total += drafted
            if not drafted and first_plain < 0:
                first_plain = step
            gate.record(["e"], drafted, [3.0] if drafted else [1], 0.0042 if drafted else 0.0008)
        return drafted_total, first_plain

    gate = DraftGate(request_smoothing=1.0)
    for _ in range(2):  # warm-up: two drafting steps, then two plain ones while the machine was busy
        assert drafts_all(gate, ["e"]) is True
        gate.record(["e"], True, [3.0], 0.0042)
    for _ in range(2):
        assert drafts_all(gate, ["e"]) is False
        gate.record(["e"], False, [1], 0.0033)
    drafted, first_plain = drafting_steps(gate, 600)
    assert 16 <= first_plain <= drafted  # drafting, until the first refresh of the plain time
    assert drafted <= first_plain + 40, (drafted, first_plain)  # then plain: 1 token per 0.8 ms wins
    assert gate.rates()[DraftGate.bucket_of(1)][1] == pytest.approx(1 / 0.0008, rel=0.01)


def test_the_first_requests_of_a_regime_are_learnt_over_their_whole_lives_whatever_their_prior() -> None:
    # served cold on the demo pair (one request, HumanEval, temperature 0): the warm-up and the
    # first request were the same weak prompt, and on its prior alone drafting looked 2.5x slower
    # than plain steps; the requests after it, most of which kept twice its tokens, were never
    # looked at. Each newcomer alone in its step drafts until it leaves while fewer than
    # MIN_REQUEST_MEANS requests of its regime have drafted (a response's first steps are not
    # its mean: a run of three steps learnt the preamble); then their means decide (here: all
    # weak, no more)
    gate = DraftGate(prior_samples=20, smoothing=0.2)
    for _ in range(2):  # the warm-up: two drafting steps of a weak request
        assert gate.choose(["warm"], [0.0], None, [100]) == [0]
        gate.record(["warm"], True, [2.0], 0.006, regimes=[0.0], kept=[2])
    explored = []
    for k in range(6):  # six requests of 100 steps each, one at a time
        drafted = 0
        for step in range(100):
            if gate.choose([f"n{k}"], [0.0], None, [100 - step]):
                drafted += 1
                gate.record([f"n{k}"], True, [2.0], 0.006, regimes=[0.0], kept=[2])
            else:
                gate.record([f"n{k}"], False, [1], 0.001)
        explored.append(drafted)
    # (the first one's first steps measure a plain step and wait for the exploration interval)
    assert explored[0] >= 90 and explored[1:] == [100, 100, 0, 0, 0], explored
    # without what is left to emit (callers that do not say), the prior read generously decides
    assert not any(gate.choose(["late"], [0.0]) for _ in range(8))


def test_a_load_expects_drafting_while_its_forecast_averaged_over_choices_stays_near_plain() -> None:
    """What a request joining a load expects (whether it should reuse cached pages without the
    drafter's K/V, never to draft): drafting while drafting's forecast rate, averaged over the
    gate's full choices at that load, stays at ``reuse_ratio`` of plain steps' or more. One plain
    choice does not turn it (choices flip while the gate learns), explorations do not turn it
    back, and a load never chosen at expects drafting."""
    gate = DraftGate(
        explore_every=4,
        max_explore_interval=4,
        max_explore_overhead=0.5,
        forced_explore_overhead=0.5,
        min_samples=1,
        prior_samples=0,
        explore_run=1,
        max_hold=0,
    )
    assert gate.expects_drafting(8) and gate.expects_drafting(100)  # nothing chosen yet
    _warm(gate, IDS8, (10, 1.0), 1.0)  # drafting: 80 tokens/s, plain: 8 tokens/s
    for _ in range(10):  # drafting (and now and then a plain step, to refresh its time)
        drafted = drafts_all(gate, IDS8)
        gate.record(IDS8, drafted, [10 if drafted else 1] * 8, 1.0)
    assert gate.expects_drafting(8) and gate.expects_drafting(15)  # (one load bucket)
    for _ in range(40):  # the requests turn hard: 1 token per 8 s drafting
        gate.record(IDS8, True, [1] * 8, 8.0)
    expected, chosen = [], []
    for _ in range(120):
        chosen.append(bool(gate.choose(IDS8)))  # (a few requests, or all of them, explore)
        expected.append(gate.expects_drafting(8))
    first_plain = chosen.index(False)
    assert expected[first_plain] is True  # one plain choice does not decide it
    turned = expected.index(False)
    assert turned > first_plain and not any(expected[turned:])  # explorations do not turn it back
    assert chosen[turned:].count(True) >= 2  # (it did explore drafting after that)
    # other loads, never chosen at, take the word of the nearest one that has been
    assert not gate.expects_drafting(1) and not gate.expects_drafting(64)


def test_a_load_seldom_chosen_at_expects_what_the_nearest_chosen_load_expects() -> None:
    """A load not yet chosen ``MIN_RATIO_CHOICES`` times (most often one a wave of requests passes
    through on its way to the load it decodes at) expects what the nearest load chosen at that
    often expects, the larger of two as near; drafting where no load has been chosen at."""
    gate = DraftGate(min_samples=1, prior_samples=0, explore_run=1, max_hold=0, relearn_steps=10**6)
    one, many = ["a"], [f"m{i}" for i in range(64)]
    assert gate.expects_drafting(1) and gate.expects_drafting(64)  # nothing chosen anywhere
    for ids, tokens, seconds in ((one, 10, 1.0), (many, 1, 64.0)):  # measured at both loads
        for _ in range(2):
            gate.record(ids, True, [tokens] * len(ids), seconds)  # one request: 10 tokens/s
            gate.record(ids, False, [1] * len(ids), 1.0)  # against 1; 64 requests: 1 against 64
    for _ in range(MIN_RATIO_CHOICES - 1):
        gate.choose(one)
        gate.choose(many)
    assert all(gate.expects_drafting(n) for n in (1, 4, 8, 32, 64))  # too few choices anywhere
    gate.choose(one)
    assert all(gate.expects_drafting(n) for n in (1, 4, 8, 32, 64))  # (only one load chosen at)
    gate.choose(many)
    assert gate.expects_drafting(1) and not gate.expects_drafting(64)
    assert gate.expects_drafting(3) and gate.expects_drafting(4)  # nearer one request
    assert not gate.expects_drafting(16) and not gate.expects_drafting(32)  # nearer 64
    assert not gate.expects_drafting(8)  # as near to both (1 -> 8 -> 64): the larger load's word


def test_a_load_where_nobody_can_draft_keeps_context_again_after_relearn_steps() -> None:
    """Requests admitted where drafting is not expected never draft, so no choice moves that
    load's forecast ratio while only they run: after ``relearn_steps`` such steps (``skip``),
    requests joining the load keep the drafter's context again (cached prompts are still
    reused as they are), and the first choice one of them takes part in explores those that
    can draft; the count starts over at every full choice. Other loads keep their own count,
    a load never chosen at too (it follows the nearest chosen load's word until then)."""
    gate = DraftGate(min_samples=1, prior_samples=0, explore_run=1, max_hold=0, relearn_steps=50)
    _warm(gate, IDS8, (1, 8.0), 1.0)  # drafting: 1 token per 8 s for each; plain 8 tokens/s
    for _ in range(MIN_RATIO_CHOICES - 1):
        gate.choose(IDS8)
    assert gate.expects_drafting(8)  # too few choices yet to say otherwise (cold first steps)
    gate.choose(IDS8)
    assert not gate.expects_drafting(8) and not gate.keeps_context(8)
    assert not gate.keeps_context(1)  # never chosen at: the nearest chosen load's word
    for _ in range(49):
        gate.skip(8)
        gate.skip(1)
    assert not gate.keeps_context(8) and not gate.keeps_context(1)
    gate.skip(8)
    assert gate.keeps_context(8) and gate.keeps_context(15)  # (one load bucket)
    assert not gate.keeps_context(1)
    gate.skip(1)
    assert gate.keeps_context(1)  # its own count
    assert not gate.expects_drafting(8)  # (the ratio, which picks the cached pages, stands)
    assert gate.choose(IDS8, able=[5, 2]) == [2, 5]  # the requests that can draft, explored
    assert not gate.keeps_context(8)
    for _ in range(50):
        gate.skip(8)
    assert gate.keeps_context(8)
    gate.choose(IDS8)  # every request could draft: a full choice starts the count over
    assert not gate.keeps_context(8)
    with pytest.raises(ValueError):
        DraftGate(relearn_steps=0)


def test_a_load_expects_drafting_again_as_soon_as_its_prior_wins_though_its_average_lags() -> None:
    """Served cold on the demo pair at one request, the first requests put the load's averaged
    ratio under ``reuse_ratio``; when a later request then drafted for 25 steps at 1.5x plain
    steps' rate, the average, which moves only at full choices, still stood under the bar and
    the next requests were admitted unable to draft. A newcomer's forecast on the load's prior
    now counts beside the average, once that prior holds drafting steps of the load's own (a
    prior seeded from a neighbouring load is no evidence)."""
    gate = DraftGate(min_samples=1, prior_samples=0, explore_run=1, max_hold=0)
    _warm(gate, IDS8, (1, 8.0), 1.0)  # drafting: 1 token per 8 s for each; plain 8 tokens/s
    for _ in range(MIN_RATIO_CHOICES):
        gate.choose(IDS8)
    assert not gate.expects_drafting(8)
    b = gate._buckets[DraftGate.bucket_of(8)]
    for _ in range(20):  # held drafting steps of easy requests: no full choice moves the average
        gate.record(IDS8, True, [12] * 8, 1.0)
    assert b.draft_ratio.value < gate.reuse_ratio  # the average still says no
    assert gate.expects_drafting(8)  # the prior: ~10 tokens a request a drafting step, 8x plain time
    # a load whose prior is a neighbour's seed: the same numbers, but no drafting step of its own
    gate.choose([f"s{i}" for i in range(64)])
    seeded = gate._buckets[DraftGate.bucket_of(64)]
    assert seeded.tokens_per_request.count == gate.min_samples
    seeded.draft_ratio = type(b.draft_ratio)(0.1, MIN_RATIO_CHOICES)
    assert not gate.expects_drafting(64)
    seeded.tokens_per_request.update(seeded.tokens_per_request.value, gate.forecasts.prior_smoothing)
    assert gate.expects_drafting(64) is (newcomer_ratio(seeded) >= gate.reuse_ratio) is True


def test_a_cached_prompt_is_prefilled_again_only_for_a_regime_the_gate_drafts_for_at_that_load() -> None:
    """``drafts_at`` (what a cached prompt lacking the drafter's K/V is prefilled again for):
    drafting expected after ``MIN_RATIO_CHOICES`` full choices at the load, and of the full
    choices the request's sampling regime took part in there, at least half drafted. A load
    seldom chosen at, where drafting is expected for want of choices, is most often one a wave
    of requests passes through (served at 16 requests, the wave's first requests joined loads
    of 1-7 and prefilled again ~960 prompt tokens a round that off mode took from the cache);
    and where the forecast stands near plain steps' rate but the gate does not draft, a prompt
    prefilled again never drafts and leaves its pages as they were, for the next round to
    prefill again (session 39's first sweep: up to 11.6x off mode's prompt tokens a round)."""
    greedy = [0.0] * 8

    def step(gate: DraftGate, tokens: int, draft_s: float) -> bool:
        chosen = gate.choose(IDS8, greedy)  # a full choice (the engine gives the regimes)
        assert chosen in ([], list(range(8)))
        gate.record(IDS8, bool(chosen), [tokens if chosen else 1] * 8, draft_s if chosen else 1.0)
        return bool(chosen)

    gate = DraftGate(min_samples=1, prior_samples=0, explore_run=1, max_hold=0)
    assert gate.expects_drafting(8) and not gate.drafts_at(8, 0.0)  # nothing chosen yet
    _warm(gate, IDS8, (10, 1.0), 1.0)  # drafting: 80 tokens/s, plain: 8 tokens/s
    b = gate._buckets[DraftGate.bucket_of(8)]
    while b.draft_ratio.count < MIN_RATIO_CHOICES - 1:
        step(gate, 10, 1.0)
    assert gate.expects_drafting(8) and not gate.drafts_at(8, 0.0)
    step(gate, 10, 1.0)
    assert gate.drafts_at(8, 0.0) and gate.drafts_at(15, 0.0)  # (one load bucket)
    assert not gate.drafts_at(8, 1.0)  # a regime that took part in no choice there
    assert gate.expects_drafting(2) and not gate.drafts_at(2, 0.0)  # another load: not chosen at
    losing = DraftGate(min_samples=1, prior_samples=0, explore_run=1, max_hold=0)
    _warm(losing, IDS8, (1, 8.0), 1.0)  # drafting: 1 token per 8 s for each
    for _ in range(MIN_RATIO_CHOICES):
        losing.choose(IDS8, greedy)
    assert not losing.expects_drafting(8) and not losing.drafts_at(8, 0.0)
    # drafting forecast at 0.9x plain steps' rate: expected (at ``reuse_ratio`` or more), but
    # not worth entering (``enter_margin``): the gate explores it now and then, no more
    near = DraftGate(min_samples=1, prior_samples=0, explore_run=1, max_hold=0, explore_fraction=1.0)
    _warm(near, IDS8, (9, 10.0), 1.0)  # 7.2 tokens/s drafting against 8
    drafted = [step(near, 9, 10.0) for _ in range(4 * MIN_RATIO_CHOICES)]
    assert 0 < sum(drafted) < len(drafted) / 4
    assert near.expects_drafting(8) and not near.drafts_at(8, 0.0)


def test_a_settled_load_keeps_features_only_where_drafting_comes_near_plain() -> None:
    """While the gate learns a load, a request joining it expects drafting at ``reuse_ratio``
    (cold first steps move the average); once the load's average has settled over
    ``SETTLED_CHOICES`` full choices, only at ``near_ratio``: between the two bars the gate,
    which enters drafting at ``enter_margin``, never drafts, and the features those requests
    kept cost ~9% of a plain step at 64-128 requests on the demo pair."""
    gate = DraftGate(min_samples=1, prior_samples=0, explore_run=1, max_hold=0, relearn_steps=10**6)
    for _ in range(3):  # one request: 4 tokens per 5 s drafting against 1 per 1 s plain (0.8)
        gate.record(["a"], True, [4.0], 5.0)
        gate.record(["a"], False, [1], 1.0)
    expected = []
    for _ in range(SETTLED_CHOICES + 4):
        gate.choose(["a"])
        expected.append(gate.expects_drafting(1))
    assert gate.reuse_ratio < 0.8 < gate.near_ratio
    assert all(expected[: SETTLED_CHOICES - 1]), expected  # learning: 0.8 clears the lower bar
    assert not any(expected[SETTLED_CHOICES - 1 :]), expected  # settled: under near_ratio


def test_an_exploration_is_priced_with_the_catch_up_it_would_write() -> None:
    # near break-even (a drafting step's forecast at 0.92x plain steps' rate: odds 1) an
    # exploration of whole drafting steps is due once its loss is 6% of the time since the last;
    # priced without the switch it costs little and comes every few steps, but the requests' put-off
    # context rows must be written first: served at 16 requests on the K=8 twin that catch-up took
    # 0.4-0.6 s against a ~27 ms plain step, and no switch had been learnt at that load
    ids = [f"r{i}" for i in range(8)]
    drafting_s, tokens = 0.0261, [2.4] * 8  # 19.2 tokens in 26.1 ms; plain: 8 in 10 ms
    explored = {}
    for catch_up in (0.0, 0.3):
        gate = DraftGate(min_samples=1, explore_fraction=1.0, prior_samples=0, explore_run=1)
        drafts_all(gate, ids)
        gate.record(ids, True, tokens, drafting_s)
        drafts_all(gate, ids)
        gate.record(ids, False, [1] * 8, 0.010)
        picks = []
        for _ in range(400):
            drafted = bool(gate.choose(ids, [0.0] * 8, catch_up_seconds=catch_up))
            gate.record(ids, drafted, tokens if drafted else [1] * 8, drafting_s if drafted else 0.010)
            picks.append(drafted)
        explored[catch_up] = picks.count(True)
    # 2.1 ms lost a time: every explore_every (4) steps; 302 ms: past the 400 steps
    assert explored[0.0] >= 80 and explored[0.3] == 0, explored


def test_a_stale_plain_time_a_refresh_undercuts_is_pulled_down_at_once() -> None:
    # served on the K=8 twin at four requests, temperature 1: plain steps learnt at ~20 ms while
    # the client started, 11 ms after; drafting (2.5 tokens a request in 39 ms, a 32 ms switch)
    # looked 1.28x plain steps' rate and was held, and each of its plain refreshes, a few hundred
    # steps apart, moved the plain time by a twentieth
    ids = [f"r{i}" for i in range(4)]

    def run(pull: bool) -> tuple[list[bool], float]:
        gate = DraftGate(min_samples=1, prior_samples=0, explore_run=1)
        if not pull:
            gate._pull_stale = lambda b, seconds: None  # type: ignore[method-assign]
        for _ in range(40):  # the busy start: past the median's first samples
            gate.record(ids, False, [1] * 4, 0.020)
        picks, last = [], False
        for _ in range(1000):  # the machine is quiet now: plain steps take 11 ms
            drafted = bool(gate.choose(ids, [1.0] * 4))
            if drafted:
                gate.record(ids, True, [2.5] * 4, 0.039, 0.032 if not last else 0.0)
            else:
                gate.record(ids, False, [1] * 4, 0.011)
            picks.append(drafted)
            last = drafted
        return picks, gate._bucket(4).plain_seconds.value

    pulled, pulled_plain = run(True)
    slow, slow_plain = run(False)
    assert pulled[:10].count(True) >= 8 and slow[:10].count(True) >= 8  # drafting looked faster
    assert pulled.count(True) <= 60 and pulled_plain == pytest.approx(0.011, rel=0.05)
    assert slow[:500].count(True) >= 400  # a twentieth per refresh: drafting held for hundreds
    # a refresh above a stale time moves it by the usual twentieth only
    gate = DraftGate(min_samples=1, smoothing=0.05)
    for _ in range(30):
        gate.record(ids, False, [1] * 4, 0.010)
    gate._steps += 100
    gate.record(ids, False, [1] * 4, 0.015)
    assert gate._bucket(4).plain_seconds.value == pytest.approx(0.010 + 0.05 * 0.005)
    gate._steps += 100
    gate.record(ids, False, [1] * 4, 0.006)
    assert gate._bucket(4).plain_seconds.value == pytest.approx((0.01025 * 0.95 + 0.05 * 0.006 + 0.006) / 2)
    # and while the time is still the median of its first samples, the samples above follow it
    gate = DraftGate(min_samples=1, smoothing=0.05)
    for _ in range(5):
        gate.record(ids, False, [1] * 4, 0.020)
    gate._steps += 100
    gate.record(ids, False, [1] * 4, 0.011)
    assert gate._bucket(4).plain_seconds.value == pytest.approx(0.0155)
    gate.record(ids, False, [1] * 4, 0.011)  # (not stale: a plain step right after)
    assert gate._bucket(4).plain_seconds.value == pytest.approx(0.0155)
