"""Online recalibration (planner/online_calibration.py): a fresh server plans on the file as it
is; traffic whose acceptance the file mis-states is corrected per regime and position from the
rounds the server verifies, unbiased by the planner's choice of which positions to verify; and
the engine wires it in dspark mode only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_server.assets import DEMO_DRAFT, DEMO_TARGET
from dspark_server.config import EngineConfig, SpeculativeConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.request import SamplingParams
from dspark_server.engine.spec.rounds import RoundRecord
from dspark_server.planner import OnlineCalibration, OnlineCalibrationConfig, survival_ece

GAMMA = 4
PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "target__amd-epyc__2t.json"
NOW = OnlineCalibrationConfig(min_refit_interval_s=0.0)  # refits by count only: deterministic


def traffic(n: int, bias: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rounds whose file survival is a_k = prod sigmoid(z_j) while each position is really
    accepted with probability sigmoid(z_k + bias): a file fit on other prompts."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.0, 1.2, size=(n, GAMMA))
    file_survival = np.cumprod(1 / (1 + np.exp(-z)), axis=1)
    survived = rng.random((n, GAMMA)) < 1 / (1 + np.exp(-(z + bias)))
    return file_survival, np.cumprod(survived, axis=1).sum(axis=1)


def feed(
    online: OnlineCalibration, a: np.ndarray, acc: np.ndarray, temp: float, lens: np.ndarray | None = None
):
    lens = np.full(acc.shape, GAMMA) if lens is None else lens
    for s in range(0, a.shape[0], 16):
        online.record(
            a[s : s + 16], np.full(min(16, a.shape[0] - s), temp), acc[s : s + 16], lens[s : s + 16]
        )


def ece(survival: np.ndarray, acc: np.ndarray) -> tuple[float, ...]:
    return survival_ece(torch.from_numpy(survival), torch.from_numpy(acc))


def test_a_fresh_or_barely_fed_instance_plans_on_the_file_exactly() -> None:
    online = OnlineCalibration(GAMMA, (0.0, 1.0), NOW)
    a, acc = traffic(200, bias=2.0, seed=0)
    temps = np.ones(200)
    assert np.array_equal(online.correct(a, temps), a)
    feed(online, a, acc, 1.0)  # 200 < min_samples
    assert not online.active() and np.array_equal(online.correct(a, temps), a)


def test_a_file_wrong_for_this_traffic_is_corrected_per_regime() -> None:
    """Two regimes' traffic interleaved, one accepting far less than the file says, one far more;
    every step planned on the maps fit before it (as the server does): after the first window,
    the survival planned on is calibrated within 2% per position, the file's is off by > 5%."""
    online = OnlineCalibration(GAMMA, (0.0, 1.0), NOW)
    streams = {1.0: traffic(12_000, bias=-1.0, seed=1), 0.0: traffic(12_000, bias=1.5, seed=2)}
    planned = {t: np.empty_like(a) for t, (a, _) in streams.items()}
    for s in range(0, 12_000, 16):
        for t, (a, acc) in streams.items():
            temps = np.full(a[s : s + 16].shape[0], t)
            planned[t][s : s + 16] = online.correct(a[s : s + 16], temps)
            online.record(a[s : s + 16], temps, acc[s : s + 16], np.full(temps.shape, GAMMA))
    assert online.refits > 0 and {t for t, _ in online.maps()} == {0.0, 1.0}
    for t, (a, acc) in streams.items():
        assert min(ece(a[2048:], acc[2048:])) > 0.05
        assert max(ece(planned[t][2048:], acc[2048:])) < 0.02, (t, ece(planned[t][2048:], acc[2048:]))
        assert np.all(np.diff(planned[t], axis=1) <= 0)  # still a survival: non-increasing in k
        # the other regime's maps would be wrong for these rows
        other = online.correct(a[2048:], np.full(a.shape[0] - 2048, 1.0 - t))
        assert max(ece(other, acc[2048:])) > 0.1


def test_the_planners_choice_of_positions_does_not_bias_the_correction() -> None:
    """Only verified positions are observed, and the planner verifies the likely ones: the map at
    a given a_k is still the realised rate at that a_k."""
    online = OnlineCalibration(GAMMA, (1.0,), NOW)
    a, acc = traffic(6000, bias=-1.0, seed=5)
    lens = (a > 0.45).sum(axis=1)  # a threshold planner's choice: depends on a_k only
    feed(online, a, acc, 1.0, lens)
    test_a, test_acc = traffic(20_000, bias=-1.0, seed=6)
    after = online.correct(test_a, np.ones(20_000))
    seen = test_a > 0.45  # the region the planner verifies, hence observed
    targets = test_acc[:, None] > np.arange(GAMMA)[None, :]
    for k in range(2):
        rows = seen[:, k]
        assert abs(after[rows, k].mean() - targets[rows, k].mean()) < 0.02
        assert abs(test_a[rows, k].mean() - targets[rows, k].mean()) > 0.08  # the file's error


def test_positions_never_verified_keep_the_file() -> None:
    online = OnlineCalibration(GAMMA, (1.0,), NOW)
    a, acc = traffic(3000, bias=-1.0, seed=7)
    feed(online, a, acc, 1.0, np.ones(3000, dtype=int))  # only position 1 verified
    assert sorted(online.maps()) == [(1.0, 1)]
    out = online.correct(a, np.ones(3000))
    assert not np.array_equal(out[:, 0], a[:, 0])
    assert np.array_equal(out[:, 1:], np.minimum(a[:, 1:], out[:, :1]))  # only capped by position 1


def test_record_rejects_mismatched_shapes() -> None:
    online = OnlineCalibration(GAMMA, (1.0,), NOW)
    with pytest.raises(ValueError):
        online.record(np.ones((3, GAMMA + 1)), np.ones(3), np.zeros(3), np.ones(3))
    with pytest.raises(ValueError):
        online.record(np.ones((3, GAMMA)), np.ones(3), np.zeros(2), np.ones(3))


def demo_engine(mode: str, online: bool) -> LLMEngine:
    spec = SpeculativeConfig(
        mode=mode,  # type: ignore[arg-type]
        profile_path=str(PROFILE),
        draft_gate=False,
        prompt_lookup=False,
        online_calibration=online,
    )
    return LLMEngine(EngineConfig(model_dir=str(DEMO_TARGET), draft_dir=str(DEMO_DRAFT), spec=spec))


@pytest.mark.parametrize(("mode", "flag"), [("dspark", False), ("fixed", True), ("threshold", True)])
def test_only_dspark_mode_corrects_online(mode: str, flag: bool) -> None:
    engine = demo_engine(mode, flag)
    assert engine.spec is not None and engine.spec.online is None


def test_the_engine_plans_on_the_corrected_survival() -> None:
    engine = demo_engine("dspark", True)
    spec = engine.spec
    assert spec is not None and spec.online is not None
    spec.online = OnlineCalibration(spec.gamma, spec.calibrations.sampling_temperatures, NOW)
    records: list[RoundRecord] = []
    spec.round_observers.append(records.append)
    prompts = [[5 + (7 * i + j) % 400 for j in range(12 + i % 5)] for i in range(24)]
    for i, ids in enumerate(prompts):
        engine.add_request(
            f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True), lambda o: None
        )
    while engine.has_work():
        engine.step()
    assert spec.online.active() and {t for t, _ in spec.online.maps()} == {0.0}
    last = records[-1]
    assert last.confidence_logits is not None and last.confidences is not None
    file_conf = spec.calibrate(last.confidence_logits, torch.zeros(len(last.requests)))
    assert not torch.allclose(last.confidences, file_conf, atol=1e-4)  # planned on the correction
    fresh = demo_engine("dspark", True).spec
    assert fresh is not None and fresh.online is not None and not fresh.online.active()
