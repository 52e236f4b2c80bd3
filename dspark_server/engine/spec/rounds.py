"""One step's speculative rounds, as calibration and evaluation observers see them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_server.engine.request import Request


@dataclass(frozen=True)
class RoundRecord:
    requests: list[Request]
    confidence_logits: torch.Tensor | None  # [R, γ] raw, before STS
    confidences: torch.Tensor | None  # [R, γ] calibrated, as the planner saw them
    verify_lens: list[int]
    accepted: list[int]
