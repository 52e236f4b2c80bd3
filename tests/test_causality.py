"""The paper's appendix A: planning must not look past the first non-improvement.

γ = 2, SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45, c1 = 0.8 and c2 depending on the drafted x1.
Θ0 = 1.0 > Θ1 = 1.8 · 0.5 = 0.9, so DSpark stops at ℓ = 0. A planner that searches on would verify
both drafts exactly when x1 is the token that makes c2 high — the value of x1 decides whether x1
is verified, and the emitted distribution is no longer the target's.
"""

from __future__ import annotations

import itertools

import torch

from dspark_server.engine.spec.verify import verify
from dspark_server.planner import PlannerConfig, SpsCostTable, make_planner

TABLE = SpsCostTable((1, 2, 3), (1.0, 0.5, 0.45), 3)
VOCAB, FAVOURED = 4, 0
P = torch.tensor([[0.25, 0.25, 0.25, 0.25]] * 3, dtype=torch.float64)  # target at each position
Q = torch.tensor([[0.70, 0.10, 0.10, 0.10]] * 2, dtype=torch.float64)  # drafter favours token 0


def confidences_for(x1: int) -> torch.Tensor:
    return torch.tensor([[0.8, 0.95 if x1 == FAVOURED else 0.1]])


class NoStopPlanner:
    """Test-only: the best prefix-length vector by exhaustive search (no early stop)."""

    def plan(self, confidences: torch.Tensor) -> torch.Tensor:
        surv = torch.cumprod(confidences.double(), dim=1)
        r, gamma = surv.shape
        best, best_lens = -1.0, None
        for lens in itertools.product(range(gamma + 1), repeat=r):
            b = r + sum(lens)
            tau = r + sum(float(surv[i, :ell].sum()) for i, ell in enumerate(lens))
            theta = tau * TABLE.lookup(b)
            if theta > best:
                best, best_lens = theta, lens
        return torch.tensor(best_lens)


def first_token_distribution(planner: object, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(n):
        drafts = torch.stack([torch.multinomial(Q[k], 1, generator=gen)[0] for k in range(2)])
        ell = int(planner.plan(confidences_for(int(drafts[0])))[0])  # type: ignore[attr-defined]
        out = verify(drafts[None], Q[None], [P[: ell + 1]], [ell], [gen])
        counts[int(drafts[0]) if out.accepted[0] > 0 else out.next_tokens[0]] += 1
    return counts / n


def test_appendix_a_numbers() -> None:
    planner = make_planner(PlannerConfig(mode="dspark", gamma=2), TABLE)
    for x1 in range(VOCAB):
        result = planner.plan_detailed(confidences_for(x1))
        assert int(result.verify_lens[0]) == 0
    assert 1.0 * TABLE.lookup(1) == 1.0 and abs((1 + 0.8) * TABLE.lookup(2) - 0.9) < 1e-12
    # The searching planner verifies both drafts only when x1 is the favoured token.
    assert NoStopPlanner().plan(confidences_for(FAVOURED)).tolist() == [2]
    assert NoStopPlanner().plan(confidences_for(1)).tolist() == [0]


def test_early_stop_is_unbiased_and_searching_on_is_biased() -> None:
    n = 8000
    target = P[0]
    real = first_token_distribution(make_planner(PlannerConfig(mode="dspark", gamma=2), TABLE), n, seed=1)
    biased = first_token_distribution(NoStopPlanner(), n, seed=2)
    stderr = (0.25 * 0.75 / n) ** 0.5
    assert abs(float(real[FAVOURED] - target[FAVOURED])) < 4 * stderr
    # Analytically P(first = 0) = min(q0, p0) + (1 - q0) p0 = 0.325 instead of 0.25.
    assert abs(float(biased[FAVOURED]) - 0.325) < 4 * stderr
    assert float(biased[FAVOURED] - target[FAVOURED]) > 10 * stderr
