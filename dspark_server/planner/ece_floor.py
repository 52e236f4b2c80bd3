"""What a perfectly calibrated survival would measure: the sampling floor of per-position ECE.

ECE over equal-width bins is biased upwards on a finite sample: even where every predicted
a(r, k) is exactly P(accepted >= k), each bin's realised frequency scatters around its mean
prediction by ~sqrt(p(1 - p) / n_bin), and the ECE adds up the absolute values. On ~10^4
rounds that floor is about 1% per position, so an ECE of 2% there is not twice a perfect one.

``survival_ece_floor`` draws outcomes from the survival itself (one uniform u per round:
accepted >= k exactly where u < a(r, k), so every position's outcome is Bernoulli(a(r, k)) and
the rounds keep their prefix structure) and measures the ECE of the same survival on them,
``draws`` times: the mean and the 95th percentile per position. A measured ECE above that
percentile is miscalibration the sample can tell apart from chance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .calibration import survival_ece
from .sts import DEFAULT_NUM_BINS


@dataclass(frozen=True)
class EceFloor:
    """Per position 1..γ (fractions): the mean and 95th percentile of a calibrated survival's ECE."""

    mean: tuple[float, ...]
    p95: tuple[float, ...]
    draws: int


def survival_ece_floor(
    survival: torch.Tensor, draws: int = 100, seed: int = 0, num_bins: int = DEFAULT_NUM_BINS
) -> EceFloor:
    """The ECE per position that ``survival`` [N, γ] (non-increasing in k) measures on
    outcomes drawn from itself, over ``draws`` draws."""
    if survival.dim() != 2 or draws < 1:
        raise ValueError("survival must be [N, gamma] and draws >= 1")
    surv = survival.to(torch.float64).clamp(0.0, 1.0)
    gen = torch.Generator().manual_seed(seed)
    ece = np.empty((draws, surv.shape[1]))
    for d in range(draws):
        u = torch.rand(surv.shape[0], 1, generator=gen, dtype=torch.float64)
        accepted = (u < surv).sum(dim=1)  # accepted >= k exactly where u < a(r, k)
        ece[d] = survival_ece(surv, accepted, num_bins)  # the measure the report applies
    return EceFloor(tuple(ece.mean(axis=0).tolist()), tuple(np.percentile(ece, 95, axis=0).tolist()), draws)
