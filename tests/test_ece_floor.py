"""The sampling floor of per-position ECE: what a perfectly calibrated survival measures."""

from __future__ import annotations

import torch

from dspark_server.planner import survival_ece, survival_ece_floor


def survival(n: int, seed: int) -> torch.Tensor:
    """[n, 4] non-increasing prefix survival with values spread over (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cumprod(torch.rand(n, 4, generator=gen, dtype=torch.float64) * 0.6 + 0.4, dim=1)


def outcomes(surv: torch.Tensor, seed: int, shift: float = 0.0) -> torch.Tensor:
    """Accepted counts whose "at least k" is Bernoulli(surv - shift) at every position k."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(surv.shape[0], 1, generator=gen, dtype=torch.float64)
    return (u < (surv - shift).clamp(0.0, 1.0)).sum(dim=1)


def test_a_calibrated_survival_measures_above_the_95th_percentile_about_one_time_in_twenty() -> None:
    surv = survival(3000, seed=0)
    floor = survival_ece_floor(surv, draws=200, seed=1)
    assert floor.draws == 200 and len(floor.mean) == len(floor.p95) == 4
    above = 0
    for trial in range(60):  # 60 fresh samples x 4 positions: ~12 exceed a true 95th percentile
        ece = survival_ece(surv, outcomes(surv, seed=100 + trial))
        above += sum(e > p for e, p in zip(ece, floor.p95, strict=True))
    assert 3 <= above <= 26, above  # Binomial(240, 0.05): P(outside) < 1e-3
    assert all(0.0 < m < p for m, p in zip(floor.mean, floor.p95, strict=True))


def test_the_floor_falls_as_one_over_the_square_root_of_the_rounds() -> None:
    small = survival_ece_floor(survival(2000, seed=2), draws=100)
    large = survival_ece_floor(survival(8000, seed=2), draws=100)
    for s, g in zip(small.mean, large.mean, strict=True):
        assert 1.6 < s / g < 2.5, (s, g)


def test_a_survival_five_points_too_high_measures_far_above_the_floor() -> None:
    surv = survival(5000, seed=3)
    floor = survival_ece_floor(surv, draws=100)
    ece = survival_ece(surv, outcomes(surv, seed=4, shift=0.05))
    assert all(e > 2 * p for e, p in zip(ece, floor.p95, strict=True)), (ece, floor.p95)
