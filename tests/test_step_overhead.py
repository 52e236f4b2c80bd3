"""The step overhead the dspark planner adds to 1/SPS(B): the draft pass of this step plus a
per-load moving average of what a step spends after its forward."""

from __future__ import annotations

import pytest

from dspark_server.engine.spec.step_overhead import StepOverhead


def test_post_forward_time_is_averaged_per_load_bucket() -> None:
    ov = StepOverhead(smoothing=0.5)
    assert ov.overhead(8, draft_s=0.010) == pytest.approx(0.010)  # nothing measured yet
    ov.record(8, step_s=0.050, forward_s=0.030, draft_s=0.010)  # 10 ms after the forward
    ov.record(9, step_s=0.040, forward_s=0.030, draft_s=0.0)  # same bucket (8..15): 10 ms
    ov.record(12, step_s=0.070, forward_s=0.030, draft_s=0.010)  # 30 ms
    assert ov.post_seconds(15) == pytest.approx(0.020)  # 10, 10, then halfway to 30
    assert ov.overhead(8, draft_s=0.005) == pytest.approx(0.025)
    assert ov.post_seconds(16) == 0.0  # another bucket keeps its own average
    ov.record(16, step_s=0.010, forward_s=0.030, draft_s=0.0)  # inconsistent timing: ignored
    assert ov.post_seconds(16) == 0.0
    # the engine loop's time between a drafting step and the next is paid by the step too
    ov.record_outside(12, 0.004)
    ov.record_outside(12, 0.008)
    assert ov.post_seconds(15) == pytest.approx(0.020 + 0.006)
    assert ov.overhead(8, draft_s=0.005) == pytest.approx(0.031)
    ov.record_outside(16, float("nan"))
    assert ov.post_seconds(16) == 0.0
    # one stall counts as at most 4x the estimate (0.006 -> 0.024 at weight 0.5)
    ov.record_outside(12, 1.0)
    assert ov.post_seconds(15) == pytest.approx(0.020 + 0.015)
