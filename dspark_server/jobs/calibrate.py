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
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dspark_server.config import EngineConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.spec.rounds import RoundRecord
from dspark_server.offline import GenerateConfig, generate
from dspark_server.planner import (
    CalibrationSet,
    RegimeCalibration,
    fit_regime,
    load_calibration_set,
    plot_calibration_set,
    save_calibration_set,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrateConfig:
    engine: EngineConfig
    generate: GenerateConfig
    out: str


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


def _pct(values: tuple[float, ...]) -> str:
    return " ".join(f"{100 * v:.2f}" for v in values)


def run_calibration(cfg: CalibrateConfig) -> CalibrationSet:
    temperature = float(cfg.generate.temperature)
    rounds = record_rounds(cfg)
    regime = fit_regime(rounds.logits, rounds.accepted, temperature, rounds.groups)
    out = Path(cfg.out)
    cal = merge_into(out, regime)
    save_calibration_set(cal, out, dataset=Path(cfg.generate.prompts).name)
    png = out.with_name(f"{out.stem}.t{temperature:g}.png")
    plot_calibration_set({temperature: (rounds.logits, rounds.accepted)}, cal, png)
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
