"""STS calibration (ECE, sequential fit, file format) and the live drift tracker."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dspark_server.planner import (
    CalibrationDriftTracker,
    StsCalibration,
    default_temperature_grid,
    expected_calibration_error,
    fit_sts,
    load_sts_calibration,
    plot_reliability_diagram,
    prefix_targets,
    reliability_bins,
    save_sts_calibration,
)


def synthetic_rounds(n: int, gamma: int, scale: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounds whose true per-position survival is sigmoid(z_k); the head reports scale * z."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, gamma, generator=g, dtype=torch.float64) * 1.5 + 1.0
    survived = torch.rand(n, gamma, generator=g, dtype=torch.float64) < torch.sigmoid(z)
    accepted = torch.cumprod(survived.long(), dim=1).sum(dim=1)
    return z * scale, accepted


def test_ece_hand_computed() -> None:
    probs = torch.tensor([0.25, 0.25, 0.75, 0.75])
    targets = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # bin of 0.25: |0.25 - 0.5| * 1/2 ; bin of 0.75: |0.75 - 1.0| * 1/2
    assert expected_calibration_error(probs, targets, num_bins=15) == pytest.approx(0.25)
    assert expected_calibration_error(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])) == pytest.approx(
        1e-8
    )
    assert math.isnan(expected_calibration_error(torch.zeros(0), torch.zeros(0)))
    with pytest.raises(ValueError, match="differ"):
        expected_calibration_error(torch.zeros(3), torch.zeros(2))


def test_reliability_bins() -> None:
    pred, real, count = reliability_bins(torch.tensor([0.05, 0.05, 0.95]), torch.tensor([0.0, 1.0, 1.0]), 10)
    assert count.tolist() == [2, 0, 0, 0, 0, 0, 0, 0, 0, 1]
    assert pred[0] == pytest.approx(0.05) and real[0] == pytest.approx(0.5) and real[9] == 1.0
    assert math.isnan(float(pred[4]))


def test_prefix_targets() -> None:
    t = prefix_targets(torch.tensor([0, 2, 3]), 3)
    assert t.tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_default_grid_matches_sglang_fitter() -> None:
    grid = default_temperature_grid()
    assert grid.numel() == 41
    assert float(grid[0]) == pytest.approx(0.1) and float(grid[-1]) == pytest.approx(10.0)
    assert float(grid[20]) == pytest.approx(1.0)


def test_fit_recovers_known_temperature_and_lowers_ece() -> None:
    logits, accepted = synthetic_rounds(40_000, 3, scale=3.0)
    cal = fit_sts(logits, accepted, dataset="synthetic")
    assert cal.gamma == 3 and cal.num_samples == 40_000 and cal.dataset == "synthetic"
    for k in range(2):
        assert 2.5 <= cal.temperatures[k] <= 3.6, cal.temperatures
    for before, after in zip(cal.ece_before, cal.ece_after, strict=True):
        assert after < before / 3
    assert max(cal.ece_after) < 0.02
    targets = prefix_targets(accepted, 3)
    survival = cal.survival(logits)
    for k in range(3):
        ece = expected_calibration_error(survival[:, k], targets[:, k])
        assert ece == pytest.approx(cal.ece_after[k], abs=1e-5)


def test_fit_keeps_identity_on_calibrated_scores() -> None:
    logits, accepted = synthetic_rounds(40_000, 2, scale=1.0, seed=1)
    cal = fit_sts(logits, accepted)
    assert all(0.85 <= t <= 1.2 for t in cal.temperatures), cal.temperatures


def test_fit_is_sequential() -> None:
    # Position 2 is perfectly calibrated only given T1: with position 1 over-confident x3,
    # fitting position 2 must use the fitted T1, so T2 comes out ~1.
    logits, accepted = synthetic_rounds(40_000, 2, scale=1.0, seed=2)
    logits[:, 0] *= 3.0
    cal = fit_sts(logits, accepted)
    assert 2.5 <= cal.temperatures[0] <= 3.6 and 0.8 <= cal.temperatures[1] <= 1.25, cal.temperatures


def test_temperatures_preserve_ranking() -> None:
    cal = StsCalibration((3.0, 0.5, 1.0))
    raw = torch.linspace(-6, 6, 101).unsqueeze(1).repeat(1, 3)
    conf = cal.apply(raw)
    for k in range(3):
        assert torch.equal(torch.argsort(conf[:, k], stable=True), torch.argsort(raw[:, k], stable=True))
        assert bool((conf[1:, k] > conf[:-1, k]).all())
    assert conf[60, 0] < torch.sigmoid(raw[60, 0]) < conf[60, 1]  # T>1 softens, T<1 sharpens
    assert torch.allclose(cal.survival(raw), torch.cumprod(conf, dim=1))
    with pytest.raises(ValueError, match="positions"):
        cal.apply(torch.zeros(2, 4))


def test_fit_custom_grid_and_errors() -> None:
    logits, accepted = synthetic_rounds(2000, 2, scale=3.0)
    cal = fit_sts(logits, accepted, grid=[1.0, 2.0])
    assert set(cal.temperatures) <= {1.0, 2.0}
    assert cal.temperatures[0] == 2.0
    with pytest.raises(ValueError, match="0..2"):
        fit_sts(logits, accepted + 5)
    with pytest.raises(ValueError, match="entries"):
        fit_sts(logits, accepted[:-1])
    with pytest.raises(ValueError, match="grid"):
        fit_sts(logits, accepted, grid=[1.0, 0.0])
    with pytest.raises(ValueError, match="non-empty"):
        fit_sts(torch.zeros(0, 2), torch.zeros(0))


def test_save_load_roundtrip(tmp_path: Path) -> None:
    cal = StsCalibration(
        (1.5, 2.0), dataset="d/*.pt", num_samples=7, ece_before=(0.1, 0.2), ece_after=(0.01, 0.02)
    )
    path = tmp_path / "sts.json"
    save_sts_calibration(cal, path)
    data = json.loads(path.read_text())
    assert set(data) == {"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}
    assert load_sts_calibration(path) == cal
    path.write_text('{"temperatures": [1.25]}')  # SGLang omits default-valued keys
    assert load_sts_calibration(path) == StsCalibration((1.25,))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("nope", "invalid JSON"),
        ("[]", "JSON object"),
        ('{"dataset": "x"}', "missing key 'temperatures'"),
        ('{"temperatures": []}', "at least one"),
        ('{"temperatures": [1.0, 0.0]}', "> 0"),
        ('{"temperatures": [1.0, -1]}', "> 0"),
        ('{"temperatures": 1.0}', "must be a list"),
        ('{"temperatures": ["a"]}', "> 0"),
        ('{"temperatures": [1.0], "num_samples": -1}', "num_samples"),
        ('{"temperatures": [1.0], "num_samples": 2.5}', "num_samples"),
        ('{"temperatures": [1.0], "dataset": 3}', "dataset"),
        ('{"temperatures": [1.0, 2.0], "ece_after": [0.1]}', "ece_after"),
    ],
)
def test_malformed_calibration_files(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        load_sts_calibration(path)
    assert str(path) in str(info.value)


def test_reliability_diagram_png(tmp_path: Path) -> None:
    logits, accepted = synthetic_rounds(3000, 5, scale=3.0)
    cal = fit_sts(logits, accepted)
    out = plot_reliability_diagram(logits, accepted, cal, tmp_path / "rel.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


# --- drift tracker ----------------------------------------------------------------------


def test_drift_tracker_means_over_observed_positions() -> None:
    tracker = CalibrationDriftTracker(gamma=3, window=100)
    pred = torch.tensor([[0.9, 0.8, 0.7], [0.6, 0.5, 0.4], [0.9, 0.9, 0.9]])
    accepted = torch.tensor([3, 1, 0])
    tracker.record(pred, accepted, verify_lens=torch.tensor([3, 2, 0]))
    s = tracker.summary()
    assert [p.position for p in s] == [1, 2, 3]
    assert [p.count for p in s] == [2, 2, 1]  # request 3 verified nothing: no observations
    assert s[0].mean_predicted == pytest.approx(0.75) and s[0].mean_realised == pytest.approx(1.0)
    assert s[1].mean_predicted == pytest.approx(0.65) and s[1].mean_realised == pytest.approx(0.5)
    assert s[2].mean_predicted == pytest.approx(0.7) and s[2].mean_realised == pytest.approx(1.0)
    assert s[1].gap == pytest.approx(0.15)


def test_drift_tracker_window_slides_and_resets() -> None:
    tracker = CalibrationDriftTracker(gamma=1, window=4)
    assert tracker.summary()[0].count == 0 and math.isnan(tracker.summary()[0].mean_predicted)
    tracker.record(torch.full((3, 1), 0.1), torch.zeros(3))
    tracker.record(torch.full((3, 1), 0.9), torch.ones(3))  # oldest two 0.1 samples drop out
    s = tracker.summary()[0]
    assert s.count == 4
    assert s.mean_predicted == pytest.approx((0.1 + 3 * 0.9) / 4)
    assert s.mean_realised == pytest.approx(0.75)
    tracker.record(torch.full((10, 1), 0.5), torch.zeros(10))  # more than a window at once
    s = tracker.summary()[0]
    assert (s.count, s.mean_predicted, s.mean_realised) == (4, pytest.approx(0.5), 0.0)
    tracker.reset()
    assert tracker.summary()[0].count == 0
    with pytest.raises(ValueError):
        tracker.record(torch.zeros(2, 2), torch.zeros(2))
    with pytest.raises(ValueError):
        tracker.record(torch.zeros(2, 1), torch.zeros(3))


def test_drift_tracker_sees_miscalibration() -> None:
    logits, accepted = synthetic_rounds(20_000, 3, scale=3.0)
    raw = StsCalibration.identity(3)
    fitted = fit_sts(logits, accepted)
    before, after = CalibrationDriftTracker(3, window=50_000), CalibrationDriftTracker(3, window=50_000)
    before.record(raw.survival(logits), accepted)
    after.record(fitted.survival(logits), accepted)
    for b, a in zip(before.summary(), after.summary(), strict=True):
        assert abs(b.gap) > 0.05 and abs(a.gap) < 0.02  # over-confident raw, fixed by STS
