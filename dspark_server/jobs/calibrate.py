"""`dspark calibrate`: fit STS temperatures from real full-γ speculative rounds."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dspark_server.config import EngineConfig
from dspark_server.engine.engine import LLMEngine
from dspark_server.engine.spec.rounds import RoundRecord
from dspark_server.offline import GenerateConfig, generate
from dspark_server.planner import StsCalibration, fit_sts, plot_reliability_diagram, save_sts_calibration


@dataclass(frozen=True)
class CalibrateConfig:
    engine: EngineConfig
    generate: GenerateConfig
    out: str


class RoundRecorder:
    """Keeps the raw confidence logits and accepted counts of full-γ rounds."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self.logits: list[torch.Tensor] = []
        self.accepted: list[int] = []

    def __call__(self, record: RoundRecord) -> None:
        if record.confidence_logits is None:
            raise ValueError("this drafter has no confidence head: nothing to calibrate")
        for i, ell in enumerate(record.verify_lens):
            if ell == self.gamma:  # rounds cut short by max_tokens say nothing about later positions
                self.logits.append(record.confidence_logits[i].float())
                self.accepted.append(record.accepted[i])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(self.logits), torch.tensor(self.accepted)


def run_calibration(cfg: CalibrateConfig) -> StsCalibration:
    engine_cfg = replace(cfg.engine, spec=replace(cfg.engine.spec, mode="fixed"))
    engine = LLMEngine(engine_cfg)
    assert engine.spec is not None
    recorder = RoundRecorder(engine.spec.gamma)
    engine.spec.round_observers.append(recorder)
    for _ in generate(engine, cfg.generate):
        pass
    if not recorder.accepted:
        raise RuntimeError("no full-γ rounds were recorded; use more prompts or max tokens")
    logits, accepted = recorder.tensors()
    calibration = fit_sts(logits, accepted, dataset=Path(cfg.generate.prompts).name)
    out = Path(cfg.out)
    save_sts_calibration(calibration, out)
    plot_reliability_diagram(logits, accepted, calibration, out.with_suffix(".png"))
    print(
        f"{len(accepted)} rounds; ECE before {[round(x, 4) for x in calibration.ece_before]} "
        f"after {[round(x, 4) for x in calibration.ece_after]}",
        file=sys.stderr,
    )
    return calibration
