"""The draft gate picks the measured-faster choice per load and keeps exploring the other, more
rarely the more an exploring step costs."""

from __future__ import annotations

import pytest

from dspark_server.engine.spec.draft_gate import DraftGate


def test_gate_measures_both_then_follows_the_faster_and_explores() -> None:
    gate = DraftGate(explore_every=4, smoothing=1.0, max_explore_overhead=0.5, min_samples=1)
    assert gate.choose(8) is True  # nothing known: draft
    gate.record(8, True, tokens=80, seconds=1.0)
    assert gate.choose(8) is False  # plain rate unknown: measure it
    gate.record(8, False, tokens=60, seconds=1.0)
    picks = [gate.choose(8) for _ in range(8)]
    # close rates: exploring is cheap, so every explore_every-th step goes to the slower choice
    assert picks.count(True) == 6 and picks.count(False) == 2
    gate.record(8, False, tokens=100, seconds=1.0)  # plain becomes faster at this load
    picks = [gate.choose(8) for _ in range(8)]
    assert picks.count(False) == 6
    # another load bucket keeps its own estimates
    assert gate.choose(64) is True
    assert gate.rates()[DraftGate.bucket_of(8)] == (80.0, 100.0)


def test_costly_exploration_is_rare() -> None:
    # a draft step takes 6x a plain step and emits 1.2x its tokens: each exploring step loses
    # 6 * (1 - 0.2) = 4.8 plain-step times, so a 2% budget allows one every 240 steps
    gate = DraftGate(explore_every=4, smoothing=1.0, max_explore_overhead=0.02, min_samples=1)
    gate.choose(64)
    gate.record(64, True, tokens=77, seconds=0.060)
    gate.choose(64)
    gate.record(64, False, tokens=64, seconds=0.010)
    picks = [gate.choose(64) for _ in range(480)]
    assert picks.count(True) == 2 and picks[239] and picks[479]
    spent = picks.count(True) * 0.060 + picks.count(False) * 0.010
    tokens = picks.count(True) * 77 + picks.count(False) * 64
    assert spent / (tokens / 6400) - 1 <= 0.02 + 1e-9  # time lost vs all-plain for the same tokens


def test_gate_ignores_unusable_timings() -> None:
    gate = DraftGate()
    gate.record(4, True, tokens=10, seconds=0.0)
    gate.record(4, True, tokens=10, seconds=float("nan"))
    assert gate.rates() == {}
    assert gate.choose(4) is True


def test_warm_up_measures_both_choices_before_one_slow_step_can_decide() -> None:
    gate = DraftGate(min_samples=3)
    draft_steps = iter([(1, 0.030), (5, 0.015), (5, 0.015)])  # a cold first draft step, then normal
    picks = []
    for _ in range(6):
        drafted = gate.choose(1)
        picks.append(drafted)
        tokens, seconds = next(draft_steps) if drafted else (1, 0.007)
        gate.record(1, drafted, tokens, seconds)
    assert picks == [True, False, True, False, True, False]  # alternating until 3 of each
    draft_rate, plain_rate = gate.rates()[DraftGate.bucket_of(1)]
    assert draft_rate == pytest.approx(11 / 0.060) and plain_rate == pytest.approx(1 / 0.007)  # plain means
    assert gate.choose(1) is True
