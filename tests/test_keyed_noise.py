"""Keyed draws of seeded requests (engine/noise.py): exact samples, a pure function of
(seed, position), and the same draw in the C++ kernel and the NumPy form."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from chi_square import chi_square_gof

from dspark_server.engine import noise
from dspark_server.engine.noise import NoiseKey, keyed_argmax, keyed_argmax_rows, row_key
from dspark_server.engine.request import SamplingParams
from dspark_server.engine.sampling import SamplingTensors, sample, sample_from_logits, shape_probs
from dspark_server.models.kernel_library import load_library

PROBS = [0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01, 0.0]


def _keys(seeds: range, position: int) -> np.ndarray:
    return np.array([row_key(NoiseKey(s, position)) for s in seeds], dtype=np.uint64)


def _numpy_draws(weights: torch.Tensor, keys: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(noise, "load_library", lambda: None)
        return keyed_argmax_rows(weights, keys)


def test_draws_over_many_seeds_follow_the_distribution() -> None:
    n = 40_000
    w = torch.tensor(PROBS).expand(n, -1).contiguous()
    draws = keyed_argmax_rows(w, _keys(range(n), 3)).tolist()
    result = chi_square_gof(draws, dict(enumerate(PROBS)))
    assert result.p_value > 1e-4, result
    assert 8 not in draws  # a zero weight is never drawn


def test_positions_draw_independent_noise() -> None:
    """Tokens at two positions of the same seeds are independent: their joint distribution is the
    product of the marginals (one noise vector shared by all positions would put it on the diagonal)."""
    n = 40_000
    p = [0.4, 0.3, 0.2, 0.1]
    w = torch.tensor(p).expand(n, -1).contiguous()
    first = keyed_argmax_rows(w, _keys(range(n), 0)).tolist()
    second = keyed_argmax_rows(w, _keys(range(n), 1)).tolist()
    joint = {(a, b): p[a] * p[b] for a in range(4) for b in range(4)}
    result = chi_square_gof(list(zip(first, second, strict=True)), joint)
    assert result.p_value > 1e-4, result


def test_a_key_always_gives_the_same_token_whatever_the_scale_of_its_weights() -> None:
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(5, 600, generator=g) * 3, dim=-1)
    key = NoiseKey(seed=-12345, position=17)
    first = keyed_argmax(p, key)
    assert torch.equal(first, keyed_argmax(p.clone(), key))
    assert torch.equal(first, keyed_argmax(p * 7.5, key))  # unnormalised weights draw alike
    # row k is position 17 + k: the same as drawing that row alone at its own position
    assert [int(keyed_argmax(p[k : k + 1], key.shifted(k))[0]) for k in range(5)] == first.tolist()
    assert len(Counter(int(keyed_argmax(p[:1], NoiseKey(s, 17))[0]) for s in range(50))) > 5


def test_kernel_and_numpy_forms_draw_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    if load_library() is None:
        pytest.skip("the C++ kernel library could not be built")
    g = torch.Generator().manual_seed(2)
    rows = []
    for t in (0.2, 1.0, 4.0):  # peaked to flat rows: few to most elements reach the exact score
        p = torch.softmax(torch.randn(100, 3000, generator=g) * 3 / t, dim=-1)
        p[:, ::7] = 0.0
        rows.append(p)
    w = torch.cat(rows)
    keys = _keys(range(w.shape[0]), 9)
    got = keyed_argmax_rows(w, keys)
    assert torch.equal(got, _numpy_draws(w, keys, monkeypatch))
    assert bool((got % 7 != 0).all())
    assert len(set(got.tolist())) > 100


def test_seeded_rows_sample_alike_through_the_temperature_kernel_and_the_general_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain step's seeded rows draw the same token whether the one-call temperature sampler or
    sample(shape_probs(...)) takes them, next to unseeded rows in the same batch."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 500, generator=g) * 2
    temps = [1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 2.0, 0.9]
    sampling = SamplingTensors.from_params([SamplingParams(temperature=t) for t in temps])
    keys = [NoiseKey(s, 4) if s % 2 else None for s in range(8)]
    seeded = [r for r, k in enumerate(keys) if k is not None]

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + r) for r in range(8)]

    fast = sample_from_logits(logits, sampling, gens(), keys)
    general = sample(shape_probs(logits, sampling), gens(), keys)
    assert fast[seeded].tolist() == general[seeded].tolist()
    for r in seeded:
        key = keys[r]
        assert key is not None
        alone = SamplingTensors.from_params([SamplingParams(temperature=temps[r])])
        assert int(fast[r]) == int(keyed_argmax(shape_probs(logits[r : r + 1], alone), key)[0])
