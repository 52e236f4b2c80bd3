"""A step's cost outside its model work: measured while the engine steps back to back, passed to
the draft gate with every step's time."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine import step_clock
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams
from dspark_server.engine.step_clock import StepClock
from dspark_server.testing.tiny import build_tiny_drafter, write_flat_sps_profile


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_the_loop_between_steps_is_measured_but_idle_waits_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTime()
    monkeypatch.setattr(step_clock, "time", fake)
    clock = StepClock(smoothing=0.5, cap_s=0.05)
    clock.start()
    clock.worked(0.010)
    clock.end(more_work=True)
    fake.now = 0.012  # the next step starts 2 ms after the first one's model work
    clock.start()
    assert clock.outside_s == pytest.approx(0.002) and clock.samples == 1
    clock.worked(0.010)
    clock.end(more_work=True)
    fake.now = 0.026  # 4 ms this time: the average moves halfway (smoothing 0.5)
    clock.start()
    assert clock.outside_s == pytest.approx(0.003)
    clock.end(more_work=False)  # nothing left: the loop waits for requests
    fake.now = 5.0
    clock.start()  # after an idle wait: no sample
    clock.end(more_work=True)
    fake.now = 5.2  # a pause longer than the cap: no sample either
    clock.start()
    assert clock.samples == 2 and clock.outside_s == pytest.approx(0.003)


def test_the_gate_prices_plain_steps_with_what_they_cost_outside_the_forward(
    tiny_model: Path, tmp_path: Path
) -> None:
    draft = build_tiny_drafter(tiny_model, tmp_path / "draft", gamma=4, seed=2)
    spec = SpeculativeConfig(
        mode="dspark", profile_path=str(write_flat_sps_profile(tmp_path / "sps.json")), draft_gate=True
    )
    engine = LLMEngine(
        EngineConfig(model_dir=str(tiny_model), draft_dir=str(draft), num_threads=1, spec=spec)
    )
    gate = engine.spec.gate if engine.spec is not None else None
    assert gate is not None
    engine.clock.outside_s = 0.25  # as if each step spent 250 ms besides its model work
    engine.clock.cap_s = 0.0  # and keeps that estimate (no new samples)
    engine.add_request("a", [3, 5, 7, 9], SamplingParams(temperature=0.0, max_tokens=12), lambda o: None)
    while engine.has_work():
        engine.step()
    bucket = gate._buckets[gate.bucket_of(1)]
    assert bucket.plain_seconds.count > 0 and bucket.draft_seconds.count > 0
    assert 0.25 < bucket.plain_seconds.value < 0.3  # the tiny model's forward takes milliseconds
    assert 0.25 < bucket.draft_seconds.value < 0.3
