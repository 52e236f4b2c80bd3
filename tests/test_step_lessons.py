"""What a finished step's time teaches the draft gate: the decodes' share of a forward that also
prefilled a prompt chunk, and a plain step time bounded by a larger load's."""

from __future__ import annotations

import pytest

from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.engine.spec.step_lessons import decode_share


def _curve(batch_tokens: int) -> float:
    """A forward bound by reading the weights up to ~100 tokens: 20 ms plus 0.1 ms a token."""
    return 0.020 + 0.0001 * batch_tokens


def test_decodes_beside_a_slow_prompt_chunk_are_charged_what_they_cost_alone() -> None:
    # 12 decodes and a 200-token chunk whose attention over a long prompt made the forward 80 ms,
    # where the curve says 41.2 ms for 212 tokens and 21.2 ms for the 12 decodes alone
    step_s, forward_s = decode_share(0.080, 212, 200, 0.085, _curve)
    assert forward_s == pytest.approx(_curve(12))
    assert step_s == pytest.approx(0.085 - (0.080 - _curve(12)))


def test_a_forward_at_or_below_the_curve_is_shared_as_the_curve_shares_it() -> None:
    share = _curve(12) / _curve(212)
    for forward in (_curve(212), 0.5 * _curve(212)):
        step_s, forward_s = decode_share(forward, 212, 200, forward + 0.002, _curve)
        assert forward_s == pytest.approx(forward * share)
        assert step_s == pytest.approx(forward_s + 0.002)


def test_without_a_curve_or_a_chunk_the_decodes_take_their_share_of_tokens() -> None:
    expected = (0.085 - 0.080 * 200 / 212, 0.080 * 12 / 212)
    assert decode_share(0.080, 212, 200, 0.085) == pytest.approx(expected)
    assert decode_share(0.030, 12, 0, 0.031, _curve) == (0.031, 0.030)
    # a chunk that is the whole batch leaves the decodes nothing (and never a negative time)
    assert decode_share(0.080, 200, 200, 0.085, _curve) == pytest.approx((0.005, 0.0))


def test_a_plain_step_time_above_a_larger_loads_is_read_as_the_larger_loads() -> None:
    """A load the traffic only passes through keeps a plain step time learnt on few steps; above
    what a plain step of more requests costs, it must not make drafting look like a win."""
    gate = DraftGate(min_samples=2, prior_samples=0, max_explore_interval=4096)
    wide = [f"w{i}" for i in range(16)]
    for _ in range(2):
        gate.record(wide, True, [2.0] * 16, 0.080)
    for _ in range(2):
        gate.record_plain(16, 0.026)
    ids = [f"r{i}" for i in range(12)]
    for _ in range(2):
        gate.record(ids, True, [2.5] * 12, 0.070)
    for _ in range(2):
        gate.record_plain(12, 0.034)  # stale: a plain step of 16 requests takes 26 ms
    assert gate.plain_iteration(12) == pytest.approx(0.026)
    assert gate.plain_iteration(16) == pytest.approx(0.026)
    # 30 tokens in 70 ms against 12 in 26 ms: plain wins (it would not against 12 in 34 ms)
    assert gate.choose(ids) == []


def test_a_smaller_loads_plain_time_or_a_seed_does_not_bound_a_larger_loads() -> None:
    gate = DraftGate(min_samples=2, prior_samples=0)
    for _ in range(2):
        gate.record([f"s{i}" for i in range(2)], True, [2.0, 2.0], 0.040)
        gate.record_plain(2, 0.010)
    for _ in range(2):
        gate.record([f"t{i}" for i in range(40)], True, [2.0] * 40, 0.200)
        gate.record_plain(40, 0.060)
    # 16-31 requests: drafting measured, the plain time a seed from 32-63 (halved: 30 ms)
    gate.record([f"m{i}" for i in range(20)], True, [2.5] * 20, 0.090)
    assert gate.plain_iteration(20) == pytest.approx(0.030)
    ids = [f"r{i}" for i in range(12)]
    gate.record(ids, True, [2.5] * 12, 0.070)
    gate.record_plain(12, 0.034)
    assert gate.plain_iteration(12) == pytest.approx(0.034)
