"""The draft gate picks the measured-faster choice per load and keeps exploring the other."""

from __future__ import annotations

from dspark_server.engine.draft_gate import DraftGate


def test_gate_measures_both_then_follows_the_faster_and_explores() -> None:
    gate = DraftGate(explore_every=4, smoothing=1.0)
    assert gate.choose(8) is True  # nothing known: draft
    gate.record(8, True, tokens=80, seconds=1.0)
    assert gate.choose(8) is False  # plain rate unknown: measure it
    gate.record(8, False, tokens=40, seconds=1.0)
    picks = [gate.choose(8) for _ in range(8)]
    assert picks.count(True) == 6 and picks.count(False) == 2  # faster choice, exploring 1 in 4
    gate.record(8, False, tokens=200, seconds=1.0)  # plain becomes faster at this load
    picks = [gate.choose(8) for _ in range(8)]
    assert picks.count(False) == 6
    # another load bucket keeps its own estimates
    assert gate.choose(64) is True
    assert gate.rates()[DraftGate.bucket_of(8)] == (80.0, 200.0)


def test_gate_ignores_unusable_timings() -> None:
    gate = DraftGate()
    gate.record(4, True, tokens=10, seconds=0.0)
    gate.record(4, True, tokens=10, seconds=float("nan"))
    assert gate.rates() == {}
    assert gate.choose(4) is True
