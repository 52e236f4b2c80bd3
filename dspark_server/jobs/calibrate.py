"""`dspark calibrate`: fit one sampling regime's calibration from real full-γ speculative rounds.

The rounds are recorded at the run's ``--temperature`` (fixed ℓ = γ, so the calibration in use
cannot influence them); the fit (``planner.calibration.fit_regime``) is STS + a per-position
survival map. The regime is merged into the file at ``--out`` when that file already holds a
calibration of the same γ (its regime at the same temperature is replaced, the others are kept),
so the regimes of a set are fit by one run each:

    for t in 0 0.3 0.7 1.0; do dspark calibrate --temperature $t --out DRAFT/sts_calibration.json; done

The SGLang-visible part of the file (``temperatures`` ...) is the STS of the set's highest
sampling temperature. A reliability diagram of this run's rounds is written beside the JSON
(``<stem>.t<temperature>.png``).

``dspark calibrate --evaluate FILE`` fits nothing: it records rounds the same way (on prompts the
calibration was not fit on) and reports the per-position ECE of FILE's calibration on them — raw
confidences, STS alone, and the full calibration the planner uses — merged per temperature into
the report JSON at ``--out``, with the reliability diagram beside it:

    for t in 0 0.3 0.7 1.0; do
      dspark calibrate --evaluate DRAFT/sts_calibration.json --prompts held_out.jsonl \
        --temperature $t --out runs/ece_held_out.json
    done
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_server.config import EngineConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.spec.rounds import RoundRecord
from dspark_server.offline import GenerateConfig, generate
from dspark_server.planner import (
    CalibrationSet,
    OnlineCalibration,
    OnlineCalibrationConfig,
    RegimeCalibration,
    fit_regime,
    load_calibration_set,
    plot_calibration_set,
    prefix_targets,
    save_calibration_set,
    survival_ece,
    survival_ece_floor,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrateConfig:
    engine: EngineConfig
    generate: GenerateConfig
    out: str
    evaluate: str | None = None  # a calibration file to measure on the rounds instead of fitting


@dataclass(frozen=True)
class Rounds:
    logits: torch.Tensor  # [N, γ] raw confidence logits
    accepted: torch.Tensor  # [N] drafts accepted
    groups: torch.Tensor  # [N] index of the request (prompt) of each round


class RoundRecorder:
    """Keeps the raw confidence logits, accepted counts and request of full-γ rounds."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self.logits: list[torch.Tensor] = []
        self.accepted: list[int] = []
        self.groups: list[int] = []
        self._request_index: dict[str, int] = {}

    def __call__(self, record: RoundRecord) -> None:
        if record.confidence_logits is None:
            raise ValueError("this drafter has no confidence head: nothing to calibrate")
        for i, ell in enumerate(record.verify_lens):
            if ell == self.gamma:  # rounds cut short by max_tokens say nothing about later positions
                rid = record.requests[i].request_id
                self.logits.append(record.confidence_logits[i].float())
                self.accepted.append(record.accepted[i])
                self.groups.append(self._request_index.setdefault(rid, len(self._request_index)))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(self.logits), torch.tensor(self.accepted)

    def rounds(self) -> Rounds:
        logits, accepted = self.tensors()
        return Rounds(logits, accepted, torch.tensor(self.groups))


def record_rounds(cfg: CalibrateConfig) -> Rounds:
    engine = LLMEngine(replace(cfg.engine, spec=replace(cfg.engine.spec, mode="fixed")))
    assert engine.spec is not None
    recorder = RoundRecorder(engine.spec.gamma)
    engine.spec.round_observers.append(recorder)
    for _ in generate(engine, cfg.generate):
        pass
    if not recorder.accepted:
        raise RuntimeError("no full-γ rounds were recorded; use more prompts or max tokens")
    return recorder.rounds()


def merge_into(out: Path, regime: RegimeCalibration) -> CalibrationSet:
    """``regime`` added to the calibration at ``out`` (same γ), else a set of its own."""
    if out.is_file():
        try:
            existing = load_calibration_set(out)
        except ValueError as e:
            log.warning("replacing unreadable calibration %s (%s)", out, e)
        else:
            if existing.gamma == regime.gamma:
                return existing.with_regime(regime)
            log.warning("replacing %s: it covers %d positions, not %d", out, existing.gamma, regime.gamma)
    return CalibrationSet((regime,))


def plot_beside(out: Path, temperature: float, rounds: Rounds, cal: CalibrationSet) -> Path:
    """The reliability diagram of ``rounds`` under ``cal``, written beside ``out``."""
    png = out.with_name(f"{out.stem}.t{temperature:g}.png")
    return plot_calibration_set({temperature: (rounds.logits, rounds.accepted)}, cal, png)


def _pct(values: tuple[float, ...]) -> str:
    return " ".join(f"{100 * v:.2f}" for v in values)


def run_calibration(cfg: CalibrateConfig) -> CalibrationSet:
    temperature = float(cfg.generate.temperature)
    rounds = record_rounds(cfg)
    regime = fit_regime(rounds.logits, rounds.accepted, temperature, rounds.groups)
    out = Path(cfg.out)
    cal = merge_into(out, regime)
    save_calibration_set(cal, out, dataset=Path(cfg.generate.prompts).name)
    png = plot_beside(out, temperature, rounds, cal)
    print(
        f"temperature {temperature:g}: {len(rounds.accepted)} rounds of "
        f"{int(rounds.groups.max()) + 1} prompts; per-position ECE in %\n"
        f"  raw            {_pct(regime.ece_before)}\n"
        f"  STS            {_pct(regime.ece_sts)}\n"
        f"  STS + map      {_pct(regime.ece_after)}\n"
        f"  STS + map (cv) {_pct(regime.ece_after_cv)}\n"
        f"regimes in {out}: {list(cal.sampling_temperatures)}; plot {png}",
        file=sys.stderr,
    )
    return cal


@dataclass(frozen=True)
class HeldOutEce:
    """Per-position ECE (fractions) of one calibration on rounds it was not fit on."""

    sampling_temperature: float  # the rounds'
    regime: float  # the key of the file's regime nearest it (what the planner reads for them)
    rounds: int
    prompts: int
    raw: tuple[float, ...]  # the drafter's confidences as they are (cumulative product)
    sts: tuple[float, ...]  # stage 1 of that regime
    calibrated: tuple[float, ...]  # the whole calibration, as the planner applies it
    online: tuple[float, ...]  # the calibration corrected online, replayed in the rounds' order
    # what a perfectly calibrated survival measures on this many rounds (planner/ece_floor.py),
    # for the online-corrected survival's spread of values: the mean and 95th percentile
    floor: tuple[float, ...]
    floor_p95: tuple[float, ...]
    realised: tuple[float, ...]  # P(accepted >= k) on the rounds
    predicted: tuple[float, ...]  # mean calibrated survival at k


def held_out_ece(cal: CalibrationSet, rounds: Rounds, sampling_temperature: float) -> HeldOutEce:
    """``cal`` measured on ``rounds`` (full-γ rounds recorded at ``sampling_temperature``)."""
    logits, accepted = rounds.logits.double(), rounds.accepted
    if logits.shape[1] != cal.gamma:
        raise ValueError(f"the rounds cover {logits.shape[1]} positions, the calibration {cal.gamma}")
    regime = cal.nearest(sampling_temperature)
    temps = torch.full((logits.shape[0],), float(sampling_temperature))
    calibrated = cal.survival(logits, temps).double()
    online = torch.from_numpy(online_replay(calibrated.numpy(), rounds, temps))
    floor = survival_ece_floor(online)
    realised = prefix_targets(accepted, cal.gamma).mean(dim=0)
    return HeldOutEce(
        sampling_temperature=float(sampling_temperature),
        regime=regime.sampling_temperature,
        rounds=int(logits.shape[0]),
        prompts=int(rounds.groups.max()) + 1 if rounds.groups.numel() else 0,
        raw=survival_ece(torch.cumprod(torch.sigmoid(logits), dim=-1), accepted),
        sts=survival_ece(regime.sts().survival(logits), accepted),
        calibrated=survival_ece(calibrated, accepted),
        online=survival_ece(online, accepted),
        floor=floor.mean,
        floor_p95=floor.p95,
        realised=tuple(realised.tolist()),
        predicted=tuple(calibrated.mean(dim=0).tolist()),
    )


def online_replay(
    survival: np.ndarray, rounds: Rounds, temperatures: torch.Tensor, rows_per_step: int = 16
) -> np.ndarray:
    """The survival the server's online recalibration would have planned each round on: the
    rounds in their recorded order, ``rows_per_step`` to a step, each step corrected by the maps
    fit on the steps before it, then recorded with every position verified (full-γ rounds)."""
    online = OnlineCalibration(
        survival.shape[1], (float(temperatures[0]),), OnlineCalibrationConfig(min_refit_interval_s=0.0)
    )
    temps = temperatures.numpy()
    accepted = rounds.accepted.numpy()
    lens = np.full(accepted.shape, survival.shape[1])
    out = np.empty_like(survival)
    for s in range(0, survival.shape[0], rows_per_step):
        e = min(survival.shape[0], s + rows_per_step)
        out[s:e] = online.correct(survival[s:e], temps[s:e])
        online.record(survival[s:e], temps[s:e], accepted[s:e], lens[s:e])
    return out


def merge_report(out: Path, calibration: str, result: HeldOutEce) -> dict[str, Any]:
    """The report at ``out`` with ``result`` in it (replacing the same calibration's entry at the
    same temperature; a report that cannot be read is started afresh)."""
    report: dict[str, Any] = {"evaluations": []}
    if out.is_file():
        try:
            report = json.loads(out.read_text())
            if not isinstance(report.get("evaluations"), list):
                raise ValueError("no evaluations list")
        except (ValueError, json.JSONDecodeError) as e:
            log.warning("replacing unreadable report %s (%s)", out, e)
            report = {"evaluations": []}
    entry = {"calibration": calibration, **asdict(result)}
    kept = [
        e
        for e in report["evaluations"]
        if (e.get("calibration"), e.get("sampling_temperature")) != (calibration, result.sampling_temperature)
    ]
    key = lambda e: (str(e.get("calibration")), float(e.get("sampling_temperature", 0.0)))  # noqa: E731
    report["evaluations"] = sorted([*kept, entry], key=key)
    return report


def run_evaluation(cfg: CalibrateConfig) -> HeldOutEce:
    """Record rounds at the run's temperature and measure ``cfg.evaluate`` on them."""
    assert cfg.evaluate is not None
    cal = load_calibration_set(cfg.evaluate)  # read first: a bad file fails before the run
    temperature = float(cfg.generate.temperature)
    rounds = record_rounds(cfg)
    if rounds.logits.shape[1] < cal.gamma:
        cal = cal.truncated(rounds.logits.shape[1])
    result = held_out_ece(cal, rounds, temperature)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = merge_report(out, cfg.evaluate, result)
    out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    png = plot_beside(out, temperature, rounds, cal)
    print(
        f"{cfg.evaluate} at temperature {temperature:g} (its regime {result.regime:g}): "
        f"{result.rounds} held-out rounds of {result.prompts} prompts; per-position ECE in %\n"
        f"  raw         {_pct(result.raw)}\n"
        f"  STS         {_pct(result.sts)}\n"
        f"  calibrated  {_pct(result.calibrated)}\n"
        f"  + online    {_pct(result.online)}\n"
        f"  calibrated survival on these rounds (sampling floor): {_pct(result.floor)}, "
        f"95th percentile {_pct(result.floor_p95)}\n"
        f"report {out}; plot {png}",
        file=sys.stderr,
    )
    return result
