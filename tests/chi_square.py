"""Pearson's chi-square goodness-of-fit test of observed outcomes against exact probabilities.

Cells whose expected count is below ``min_expected`` are pooled into one cell (merged with the
least likely remaining cells until it too reaches ``min_expected``), the usual condition for the
chi-square approximation. An outcome with probability 0 that occurs anyway is not a matter of
degree: the result records it and its p-value is 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

import torch


def chi_square_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper incomplete gamma."""
    if df <= 0:
        return 1.0
    a = torch.tensor(df / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(statistic / 2.0, dtype=torch.float64)))


@dataclass(frozen=True)
class ChiSquareResult:
    statistic: float
    df: int
    p_value: float
    samples: int
    cells: int  # after pooling
    impossible: tuple[Hashable, ...]  # observed outcomes of probability 0

    def __str__(self) -> str:
        text = f"p={self.p_value:.3g} (chi2={self.statistic:.1f}, df={self.df}, n={self.samples})"
        if self.impossible:
            text += f", impossible outcomes observed: {list(self.impossible)[:5]}"
        return text


def chi_square_gof(
    observed: Iterable[Hashable], probs: Mapping[Hashable, float], min_expected: float = 5.0
) -> ChiSquareResult:
    counts = Counter(observed)
    n = sum(counts.values())
    impossible = tuple(o for o in counts if probs.get(o, 0.0) <= 0.0)
    total = sum(probs.values())
    assert abs(total - 1.0) < 1e-9, f"exact probabilities sum to {total}"
    cells = sorted(((n * p, counts.get(o, 0)) for o, p in probs.items() if p > 0), reverse=True)
    kept = [c for c in cells if c[0] >= min_expected]
    pooled = [c for c in cells if c[0] < min_expected]
    rest_e, rest_o = sum(e for e, _ in pooled), sum(o for _, o in pooled)
    while pooled and rest_e < min_expected and kept:
        e, o = kept.pop()
        rest_e, rest_o = rest_e + e, rest_o + o
    if pooled:
        kept.append((rest_e, rest_o))
    statistic = sum((o - e) ** 2 / e for e, o in kept if e > 0)
    df = len(kept) - 1
    p_value = 0.0 if impossible else chi_square_sf(statistic, df)
    return ChiSquareResult(statistic, df, p_value, n, len(kept), impossible)
