"""The statistics the distribution tests rely on: chi-square tail, pooling, exact enumeration."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from chi_square import chi_square_gof, chi_square_sf
from exact_sampling import ExactTarget, reference_probs

from dspark_server.engine.request import SamplingParams
from dspark_server.testing.tiny import build_tiny_model


@pytest.mark.parametrize(
    ("statistic", "df", "p"),
    # scipy.stats.chi2.sf at these points (textbook critical values and a far tail)
    [(3.841458820694124, 1, 0.05), (18.307038053275146, 10, 0.05), (124.34211340400407, 100, 0.05)],
)
def test_survival_function_matches_known_values(statistic: float, df: int, p: float) -> None:
    assert chi_square_sf(statistic, df) == pytest.approx(p, rel=1e-6)


def test_survival_function_far_tail_and_edges() -> None:
    assert 0 < chi_square_sf(500.0, 100) < 1e-50
    assert chi_square_sf(0.0, 5) == 1.0
    assert chi_square_sf(7.0, 0) == 1.0


def test_sampling_from_the_exact_distribution_gives_uniform_p_values() -> None:
    rng = random.Random(0)
    probs = {i: w for i, w in enumerate([0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.006, 0.004])}
    outcomes, weights = list(probs), list(probs.values())
    p_values = [chi_square_gof(rng.choices(outcomes, weights, k=400), probs).p_value for _ in range(300)]
    assert sum(p < 0.05 for p in p_values) / len(p_values) == pytest.approx(0.05, abs=0.04)
    assert sum(p < 0.5 for p in p_values) / len(p_values) == pytest.approx(0.5, abs=0.1)


def test_pooling_and_impossible_outcomes() -> None:
    probs = {"a": 0.5, "b": 0.49, "c": 0.006, "d": 0.004}
    result = chi_square_gof(["a"] * 50 + ["b"] * 49 + ["c"], probs)
    assert result.cells == 2 and result.df == 1  # c and d pooled, then with b (still < 5 expected)
    assert result.p_value > 0.5
    bad = chi_square_gof(["a"] * 50 + ["z"], probs)
    assert bad.p_value == 0.0 and bad.impossible == ("z",) and "impossible" in str(bad)
    skewed = chi_square_gof(["a"] * 80 + ["b"] * 20, probs)
    assert skewed.p_value < 1e-8


def test_reference_shaping_keeps_what_top_k_and_top_p_keep() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]], dtype=torch.float64))
    top_k = reference_probs(logits, SamplingParams(top_k=2))
    assert torch.allclose(top_k, torch.tensor([[2 / 3, 1 / 3, 0, 0, 0]], dtype=torch.float64))
    top_p = reference_probs(logits, SamplingParams(top_p=0.8))  # 0.5 + 0.25 < 0.8: three kept
    assert torch.allclose(top_p, torch.tensor([[0.5, 0.25, 0.15, 0, 0]], dtype=torch.float64) / 0.9)
    greedy = reference_probs(logits, SamplingParams(temperature=0))
    assert greedy.tolist() == [[1.0, 0, 0, 0, 0]]
    hot = reference_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2.0, -1))


def test_exact_distribution_sums_to_one_and_ends_at_stops(tmp_path: Path) -> None:
    target = ExactTarget.load(build_tiny_model(tmp_path / "t", with_eos=False, vocab_size=6, seed=2))
    free = target.distribution([1, 2], SamplingParams(), 3)
    assert len(free) == 6**3 and sum(free.values()) == pytest.approx(1.0, abs=1e-12)
    stopped = target.distribution([1, 2], SamplingParams(stop_token_ids=(4,)), 3)
    assert sum(stopped.values()) == pytest.approx(1.0, abs=1e-12)
    assert all(o[-1] == 4 or len(o) == 3 for o in stopped) and (4,) in stopped
    assert all(4 not in o[:-1] for o in stopped)
    assert stopped[(4,)] == pytest.approx(sum(p for o, p in free.items() if o[0] == 4))
