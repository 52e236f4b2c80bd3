"""Per-sampling-regime calibration (planner/calibration.py): the fit where temperature scaling
cannot reach, per-row selection by sampling temperature, causality, the file format and its
readability by SGLang 0.5.23's own loader, and the shipped demo calibrations."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from dspark_server.assets import DEMO_DRAFT
from dspark_server.cli import main as dspark_main
from dspark_server.jobs.calibrate import Rounds, held_out_ece, merge_into
from dspark_server.planner import (
    CalibrationSet,
    RegimeCalibration,
    StsCalibration,
    SurvivalMap,
    fit_regime,
    fit_sts,
    load_calibration_set,
    load_sts_calibration,
    plot_calibration_set,
    save_calibration_set,
    save_sts_calibration,
    survival_ece,
)
from dspark_server.planner.calibration import _isotonic

SHIPPED = ("sts_calibration.json", "sts_calibration_greedy.json")
SHIPPED_REGIMES = (0.0, 0.3, 0.7, 1.0)


def biased_rounds(n: int, gamma: int, bias: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounds whose true per-position acceptance is sigmoid(z_k + bias) while the head reports
    z_k: a shift that no temperature (a rescaling around 0) can undo."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, gamma, generator=g, dtype=torch.float64) * 1.2 + 0.5
    survived = torch.rand(n, gamma, generator=g, dtype=torch.float64) < torch.sigmoid(z + bias)
    return z.float(), torch.cumprod(survived.long(), dim=1).sum(dim=1)


def constant_regime(t: float, survival: tuple[float, ...]) -> RegimeCalibration:
    """A regime whose survival is ``survival`` whatever the logits (one knot per position)."""
    gamma = len(survival)
    smap = SurvivalMap(((0.0,),) * gamma, tuple((s,) for s in survival))
    return RegimeCalibration(t, (1.0,) * gamma, smap)


# --- the fit ----------------------------------------------------------------------------


def test_fit_removes_a_bias_that_temperature_scaling_cannot() -> None:
    logits, accepted = biased_rounds(30_000, 4, bias=2.0)
    sts = fit_sts(logits, accepted)
    assert max(sts.ece_after) > 0.04, sts.ece_after  # temperature alone: still far off
    regime = fit_regime(logits, accepted, 0.0)
    assert max(regime.ece_after) < 0.01, regime.ece_after
    assert regime.ece_sts == sts.ece_after and regime.temperatures == sts.temperatures
    assert regime.ece_after == pytest.approx(survival_ece(regime.survival(logits), accepted), abs=1e-6)
    fresh_logits, fresh_accepted = biased_rounds(30_000, 4, bias=2.0, seed=1)  # not fitted on
    assert max(survival_ece(regime.survival(fresh_logits), fresh_accepted)) < 0.015
    assert max(survival_ece(sts.survival(fresh_logits), fresh_accepted)) > 0.04


def test_cross_validated_ece_is_reported_per_position() -> None:
    logits, accepted = biased_rounds(20_000, 3, bias=-1.5)
    groups = torch.arange(20_000) // 50  # 400 "prompts"
    regime = fit_regime(logits, accepted, 0.7, groups)
    assert len(regime.ece_after_cv) == 3 and max(regime.ece_after_cv) < 0.02
    assert fit_regime(logits, accepted, 0.7).ece_after_cv == ()


def test_fit_is_deterministic_and_keeps_ranking() -> None:
    logits, accepted = biased_rounds(8000, 3, bias=1.0, seed=3)
    a, b = fit_regime(logits, accepted, 0.3), fit_regime(logits.clone(), accepted.clone(), 0.3)
    assert a == b
    raw = torch.linspace(-5, 5, 201).unsqueeze(1).repeat(1, 3)
    surv = a.survival(raw)
    assert bool((surv[1:] >= surv[:-1]).all())  # higher raw confidence never lowers survival


def test_survival_is_causal_non_increasing_and_the_confidences_multiply_to_it() -> None:
    logits, accepted = biased_rounds(8000, 5, bias=1.5, seed=4)
    regime = fit_regime(logits, accepted, 0.0)
    raw = torch.randn(64, 5, generator=torch.Generator().manual_seed(0)) * 2
    surv = regime.survival(raw)
    assert bool((surv[:, 1:] <= surv[:, :-1]).all()) and bool((surv > 0).all())
    conf = regime.apply(raw)
    assert bool((conf >= 0).all() and (conf <= 1).all())
    assert torch.allclose(torch.cumprod(conf, dim=1), surv, atol=1e-6)
    for j in range(5):  # a_k may depend on raw_1..raw_k only (x_k must not decide its own ℓ)
        moved = raw.clone()
        moved[:, j] += torch.linspace(-4, 4, 64)
        assert torch.equal(regime.survival(moved)[:, :j], surv[:, :j])


def test_survival_formula_by_hand() -> None:
    # g: a'_1 = 0.9, a'_2 = 0.95 whatever the score; h_1 = identity on [0, 1], h_2 = 0.5 constant.
    g = SurvivalMap(((0.0,), (0.0,)), ((0.9,), (0.95,)))
    h = SurvivalMap(((0.0, 1.0), (0.0,)), ((1e-4, 1.0), (0.5,)))
    regime = RegimeCalibration(1.0, (1.0, 1.0), g, h)
    # a_1 = min(1, h_1(min(0.9, 1))) ~ 0.9; a_2 = min(a_1, h_2(min(0.95, a_1))) = 0.5
    assert torch.allclose(regime.survival(torch.zeros(1, 2)), torch.tensor([[0.9, 0.5]]), atol=1e-3)
    assert torch.allclose(
        RegimeCalibration(1.0, (1.0, 1.0), g).survival(torch.zeros(1, 2)), torch.tensor([[0.9, 0.9]])
    )
    # Between knots the maps interpolate linearly in the STS score log(sigmoid(raw / T)), flat outside.
    lin = SurvivalMap(((-2.0, -1.0),), ((0.2, 0.6),))
    one = RegimeCalibration(0.0, (2.0,), lin)
    raw = torch.tensor([[-100.0], [0.0], [100.0]])  # scores ~-50, log(0.5) = -0.69, ~0
    assert torch.allclose(one.survival(raw), torch.tensor([[0.2], [0.6], [0.6]]), atol=1e-6)
    mid = 2.0 * torch.logit(torch.tensor(math.exp(-1.5)))  # score exactly -1.5
    assert one.survival(mid.reshape(1, 1)).item() == pytest.approx(0.4, abs=1e-5)


def test_isotonic_pools_adjacent_violators_by_weight() -> None:
    assert _isotonic([0.1, 0.5, 0.3, 0.9], [1, 1, 1, 1]) == pytest.approx([0.1, 0.4, 0.4, 0.9])
    assert _isotonic([0.1, 0.5, 0.3, 0.9], [1, 3, 1, 1]) == pytest.approx([0.1, 0.45, 0.45, 0.9])
    assert _isotonic([0.9, 0.5, 0.1], [1, 1, 1]) == pytest.approx([0.5, 0.5, 0.5])


# --- selection by sampling temperature ---------------------------------------------------


def test_rows_select_their_regime_by_temperature() -> None:
    greedy = constant_regime(0.0, (0.9, 0.8))
    low = constant_regime(0.3, (0.6, 0.3))
    high = constant_regime(1.0, (0.4, 0.1))
    cal = CalibrationSet((high, greedy, low))  # any order: sorted by key
    assert cal.sampling_temperatures == (0.0, 0.3, 1.0)
    temps = torch.tensor([0.0, 0.3, 1.0, 0.65, 0.1, 2.0])
    surv = cal.survival(torch.zeros(6, 2), temps)
    want = torch.tensor(
        [
            [0.9, 0.8],  # greedy: its own regime
            [0.6, 0.3],
            [0.4, 0.1],
            [0.5, 0.2],  # halfway between 0.3 and 1.0
            [0.6, 0.3],  # below the lowest sampled regime: that one, never the greedy one
            [0.4, 0.1],  # above the highest: the highest
        ]
    )
    assert torch.allclose(surv, want, atol=1e-6)
    assert torch.allclose(torch.cumprod(cal.apply(torch.zeros(6, 2), temps), dim=1), want, atol=1e-6)
    w = cal.weights(temps)
    assert torch.allclose(w.sum(dim=1), torch.ones(6, dtype=torch.float64))
    no_greedy = CalibrationSet((low, high))  # greedy rows then take the lowest sampled regime
    assert torch.allclose(no_greedy.survival(torch.zeros(1, 2), torch.zeros(1)), torch.tensor([[0.6, 0.3]]))
    only_greedy = CalibrationSet((greedy,))
    assert torch.allclose(
        only_greedy.survival(torch.zeros(2, 2), torch.tensor([0.0, 0.8])), torch.tensor([[0.9, 0.8]] * 2)
    )


def test_greedy_override_truncation_and_plain_sts_regimes() -> None:
    sampled = CalibrationSet.from_sts(StsCalibration((2.0, 0.5, 1.0)), 1.0)
    raw = torch.tensor([[1.0, -1.0, 2.0], [0.5, 0.5, 0.5]])
    plain = torch.sigmoid(raw / torch.tensor([2.0, 0.5, 1.0]))
    assert torch.allclose(sampled.apply(raw, torch.tensor([0.0, 1.0])), plain, atol=1e-6)
    greedy = CalibrationSet.from_sts(StsCalibration((0.25, 0.25, 0.25)), 0.0)
    both = sampled.with_greedy(greedy)
    got = both.apply(raw, torch.tensor([0.0, 0.7]))
    assert torch.allclose(got[0], torch.sigmoid(raw[0] / 0.25), atol=1e-6)
    assert torch.allclose(got[1], plain[1], atol=1e-6)
    assert sampled.with_greedy(None) is sampled
    # A greedy file keyed otherwise (e.g. a plain STS file read with the default key) still lands on 0.
    assert both == sampled.with_greedy(CalibrationSet.from_sts(StsCalibration((0.25,) * 3), 1.0))
    short = both.truncated(2)
    assert short.gamma == 2
    assert torch.allclose(short.apply(raw[:, :2], torch.tensor([0.0, 0.7])), got[:, :2], atol=1e-6)
    with pytest.raises(ValueError, match="gamma is 4"):
        both.truncated(4)
    with pytest.raises(ValueError, match="repeat"):
        CalibrationSet((constant_regime(0.3, (0.5,)), constant_regime(0.3, (0.4,))))
    with pytest.raises(ValueError, match="gamma"):
        CalibrationSet((constant_regime(0.3, (0.5,)), constant_regime(1.0, (0.5, 0.4))))


# --- files ------------------------------------------------------------------------------


def _fitted_set() -> CalibrationSet:
    regimes = []
    for i, t in enumerate((0.0, 0.3, 1.0)):
        logits, accepted = biased_rounds(3000, 3, bias=1.0 - i, seed=10 + i)
        regimes.append(fit_regime(logits, accepted, t, torch.arange(3000) // 30))
    return CalibrationSet(tuple(regimes))


def test_file_round_trip_and_the_sglang_part(tmp_path: Path) -> None:
    cal = _fitted_set()
    path = tmp_path / "sts.json"
    save_calibration_set(cal, path, dataset="prompts.jsonl")
    assert load_calibration_set(path) == cal
    data = json.loads(path.read_text())
    assert data["dspark_calibration"]["sglang_regime"] == 1.0
    # The SGLang keys hold the highest regime's STS, and our plain STS reader takes them as such.
    sts = load_sts_calibration(path)
    assert sts == cal.regime(1.0).sts("prompts.jsonl")  # type: ignore[union-attr]
    save_calibration_set(cal, path, sglang_regime=0.0)
    assert load_sts_calibration(path).temperatures == cal.regime(0.0).temperatures  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="no regime"):
        save_calibration_set(cal, path, sglang_regime=0.5)
    # A plain STS file is one regime without maps (key: default_regime).
    save_sts_calibration(StsCalibration((1.5, 2.0)), path)
    assert load_calibration_set(path) == CalibrationSet.from_sts(StsCalibration((1.5, 2.0)), 1.0)
    assert load_calibration_set(path, default_regime=0.0).sampling_temperatures == (0.0,)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d["dspark_calibration"].update(version=2), "version"),
        (lambda d: d["dspark_calibration"].update(regimes={}), "regimes"),
        (lambda d: d.update(temperatures=[1.0]), "positions"),
        (lambda d: d["dspark_calibration"]["regimes"][0]["survival_map"]["score"][0].reverse(), "increase"),
        (lambda d: d["dspark_calibration"]["regimes"][0]["survival_map"]["survival"][0].reverse(), "rise"),
        (lambda d: d["dspark_calibration"]["regimes"][0].pop("sampling_temperature"), "missing"),
        (lambda d: d["dspark_calibration"]["regimes"][0].update(sampling_temperature=-1), ">= 0"),
        (lambda d: d["dspark_calibration"]["regimes"][0].update(survival_map=None), "needs a survival_map"),
    ],
)
def test_invalid_extensions_are_refused(tmp_path: Path, edit, match: str) -> None:  # noqa: ANN001
    path = tmp_path / "sts.json"
    save_calibration_set(_fitted_set(), path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        load_calibration_set(path)


def _sglang_sts_module() -> types.ModuleType:
    """SGLang 0.5.23's dspark_sts.py, loaded from its file (the package __init__ needs CUDA)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SGLang is not installed: pip install --no-deps sglang==0.5.23 msgspec")
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / "srt" / "speculative" / "dspark_components" / "dspark_sts.py"
    mspec = importlib.util.spec_from_file_location("_sglang_ref_dspark_sts_regimes", path)
    assert mspec is not None and mspec.loader is not None
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mspec.name] = module  # msgspec resolves annotations through sys.modules
    mspec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sglang_sts() -> types.ModuleType:
    return _sglang_sts_module()


def test_sglang_loader_reads_the_extended_file(tmp_path: Path, sglang_sts: types.ModuleType) -> None:
    cal = _fitted_set()
    path = tmp_path / "sts.json"
    save_calibration_set(cal, path, dataset="prompts.jsonl")
    theirs = sglang_sts.load_sts_calibration_from_path(str(path))
    ours = cal.regime(1.0).sts("prompts.jsonl")  # type: ignore[union-attr]
    assert theirs.temperatures == list(ours.temperatures)
    assert (theirs.dataset, theirs.num_samples) == ("prompts.jsonl", ours.num_samples)
    assert theirs.ece_before == list(ours.ece_before) and theirs.ece_after == list(ours.ece_after)
    # What SGLang re-encodes is exactly the plain STS part (the extension is ignored, not kept).
    plain = {k: v for k, v in json.loads(path.read_text()).items() if k != "dspark_calibration"}
    assert json.loads(theirs.to_json()) == plain


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_calibrations_load_in_sglang_and_ours(name: str, sglang_sts: types.ModuleType) -> None:
    path = DEMO_DRAFT / name
    theirs = sglang_sts.load_sts_calibration_from_path(str(path))
    cal = load_calibration_set(path)
    key = json.loads(path.read_text())["dspark_calibration"]["sglang_regime"]
    assert theirs.temperatures == list(cal.regime(key).temperatures)  # type: ignore[union-attr]
    assert len(theirs.temperatures) == cal.gamma == 7


def test_shipped_calibration_meets_two_percent_per_position_in_every_regime() -> None:
    cal = load_calibration_set(DEMO_DRAFT / "sts_calibration.json")
    assert cal.sampling_temperatures == SHIPPED_REGIMES
    for regime in cal.regimes:
        assert regime.survival_map is not None and regime.capped_map is not None
        assert regime.num_samples > 10_000
        assert max(regime.ece_after) <= 0.02, (regime.sampling_temperature, regime.ece_after)
        assert max(regime.ece_after) < max(regime.ece_sts)
    greedy = load_calibration_set(DEMO_DRAFT / "sts_calibration_greedy.json")
    assert greedy.regimes == (cal.regime(0.0),)  # the same fit, the greedy rounds are deterministic
    for regime in cal.regimes:
        png = DEMO_DRAFT / f"sts_calibration.t{regime.sampling_temperature:g}.png"
        assert png.is_file() and png.stat().st_size > 10_000


# --- held-out evaluation (`dspark calibrate --evaluate`) ---------------------------------


def as_rounds(logits: torch.Tensor, accepted: torch.Tensor) -> Rounds:
    return Rounds(logits, accepted, torch.arange(logits.shape[0]) // 50)


def test_held_out_ece_measures_the_calibration_on_rounds_it_was_not_fit_on() -> None:
    cal = CalibrationSet((fit_regime(*biased_rounds(30_000, 4, bias=2.0, seed=0), 0.7),))
    same = held_out_ece(cal, as_rounds(*biased_rounds(30_000, 4, bias=2.0, seed=1)), 0.7)
    assert same.regime == 0.7 and same.rounds == 30_000 and same.prompts == 600
    assert max(same.calibrated) < 0.015, same.calibrated
    # 30,000 rounds: a calibrated survival measures a few tenths of a per cent by chance alone
    assert all(0.0005 < f < p < 0.01 for f, p in zip(same.floor, same.floor_p95, strict=True)), same.floor
    assert min(same.raw) > 0.05 and max(same.raw) > 0.1, same.raw  # the bias the fit removed
    for p, r in zip(same.predicted, same.realised, strict=True):
        assert abs(p - r) < 0.015
    # rounds of another acceptance (a prompt set the calibration never saw) show up as ECE
    shifted = held_out_ece(cal, as_rounds(*biased_rounds(30_000, 4, bias=0.0, seed=2)), 0.7)
    assert min(shifted.calibrated) > 0.05, shifted.calibrated
    assert all(p > r + 0.05 for p, r in zip(shifted.predicted, shifted.realised, strict=True))


def test_held_out_ece_reads_the_regime_the_planner_reads() -> None:
    hot = fit_regime(*biased_rounds(20_000, 3, bias=2.0, seed=0), 1.0)
    cold = fit_regime(*biased_rounds(20_000, 3, bias=-1.0, seed=0), 0.0)
    cal = CalibrationSet((cold, hot))
    rounds = as_rounds(*biased_rounds(20_000, 3, bias=2.0, seed=3))
    right = held_out_ece(cal, rounds, 0.9)
    assert right.regime == 1.0 and max(right.calibrated) < 0.02
    wrong = held_out_ece(cal, rounds, 0.0)
    assert wrong.regime == 0.0 and min(wrong.calibrated) > 0.1


def test_calibrate_evaluate_writes_a_report_per_temperature(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    lines = ["Write a function that adds two numbers.", "Tell me about the sea."]
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in lines))
    shipped = str(DEMO_DRAFT / "sts_calibration.json")
    out = tmp_path / "ece.json"
    for t in ("0", "0.7"):
        common = ["--prompts", str(prompts), "--max-tokens", "40", "--seed", "1", "--quiet"]
        dspark_main(["calibrate", "--evaluate", shipped, *common, "--temperature", t, "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["evaluations"]
    assert [(r["calibration"], r["sampling_temperature"]) for r in rows] == [(shipped, 0.0), (shipped, 0.7)]
    for row in rows:
        assert row["regime"] == row["sampling_temperature"] and row["prompts"] == 2
        assert row["rounds"] >= 4
        for key in ("raw", "sts", "calibrated", "realised", "predicted", "floor", "floor_p95"):
            assert len(row[key]) == 7 and all(0.0 <= v <= 1.0 for v in row[key])
        assert all(m <= p for m, p in zip(row["floor"], row["floor_p95"], strict=True))
        assert (tmp_path / f"ece.t{row['sampling_temperature']:g}.png").stat().st_size > 10_000
    assert load_calibration_set(DEMO_DRAFT / "sts_calibration.json").sampling_temperatures == SHIPPED_REGIMES


# --- the calibration job's merge --------------------------------------------------------


def test_job_merges_regimes_into_the_output_file(tmp_path: Path) -> None:
    out = tmp_path / "cal.json"
    first = constant_regime(0.0, (0.9, 0.8))
    assert merge_into(out, first) == CalibrationSet((first,))  # no file yet
    save_calibration_set(CalibrationSet((first,)), out)
    second = constant_regime(0.7, (0.5, 0.2))
    merged = merge_into(out, second)
    assert merged.sampling_temperatures == (0.0, 0.7)
    save_calibration_set(merged, out)
    again = constant_regime(0.7, (0.4, 0.1))
    assert merge_into(out, again).regime(0.7) == again  # same key: replaced
    other_gamma = constant_regime(1.0, (0.5, 0.4, 0.3))
    assert merge_into(out, other_gamma) == CalibrationSet((other_gamma,))  # another γ: a new file
    out.write_text("not json")
    assert merge_into(out, first) == CalibrationSet((first,))


def test_reliability_plot(tmp_path: Path) -> None:
    logits, accepted = biased_rounds(2000, 3, bias=1.0)
    cal = CalibrationSet((fit_regime(logits, accepted, 0.0),))
    png = plot_calibration_set({0.0: (logits, accepted)}, cal, tmp_path / "rel.png")
    assert png.stat().st_size > 5_000
