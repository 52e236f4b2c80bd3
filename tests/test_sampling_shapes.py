"""The distributions sampling draws from: temperature-only batches take a short path, which must
give what the general path (temperature, top-k, top-p, greedy rows) gives for the same rows."""

from __future__ import annotations

import pytest
import torch
from chi_square import chi_square_gof

from dspark_server.engine.request import SamplingParams
from dspark_server.engine.sampling import SamplingCache, SamplingTensors, sample_from_logits, shape_probs


def test_temperature_only_rows_are_shaped_as_in_a_mixed_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    temps = [0.6, 1.0, 1.7]
    alone = SamplingTensors.from_params([SamplingParams(temperature=t) for t in temps])
    assert not (alone.any_greedy or alone.any_top_k or alone.any_top_p)
    mixed_params = [SamplingParams(temperature=t) for t in temps]
    mixed_params += [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=3, top_p=0.9)]
    mixed = SamplingTensors.from_params(mixed_params)
    assert mixed.any_greedy and mixed.any_top_k and mixed.any_top_p and not mixed.all_greedy
    short = shape_probs(logits[:3], alone)
    general = shape_probs(logits, mixed)
    torch.testing.assert_close(short, general[:3], rtol=0, atol=0)
    torch.testing.assert_close(short, torch.softmax(logits[:3] / torch.tensor(temps)[:, None], dim=-1))
    assert general[3].max() == 1.0 and int(general[3].argmax()) == int(logits[3].argmax())
    assert int((general[4] > 0).sum()) <= 3


def test_sampling_at_a_low_temperature_follows_the_sharpened_distribution() -> None:
    torch.manual_seed(1)
    logits = torch.randn(12) * 2
    rows = 6000
    params = [SamplingParams(temperature=0.5)] * rows
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    draws = sample_from_logits(logits.expand(rows, -1), SamplingTensors.from_params(params), gens)
    exact = torch.softmax(logits.double() / 0.5, dim=-1)
    result = chi_square_gof(draws.tolist(), {i: float(p) for i, p in enumerate(exact)})
    assert result.p_value > 1e-3, str(result)
    at_one = torch.softmax(logits.double(), dim=-1)
    wrong = chi_square_gof(draws.tolist(), {i: float(p) for i, p in enumerate(at_one)})
    assert wrong.p_value < 1e-6  # the test can tell temperature 0.5 from 1


def test_the_temperature_kernel_draws_what_the_tensor_path_draws() -> None:
    """Rows shaped by temperature alone are sampled by one kernel call (sample_rows.cpp): with the
    same generators it picks the token the tensor path (shape_probs, then the inverse CDF) picks,
    row by row, over a real vocabulary's width and temperatures from 0.3 to 1.5."""
    from dspark_server.engine import sampling
    from dspark_server.models.kernel_library import load_library

    if load_library() is None:
        pytest.skip("the C++ kernel library could not be built")
    torch.manual_seed(2)
    rows, vocab = 600, 6144
    logits = torch.randn(rows, vocab) * 3
    params = [SamplingParams(temperature=0.3 + 1.2 * i / rows) for i in range(rows)]
    s = SamplingTensors.from_params(params)
    kernel = sample_from_logits(logits, s, [torch.Generator().manual_seed(i) for i in range(rows)])
    tensors = sampling.sample(shape_probs(logits, s), [torch.Generator().manual_seed(i) for i in range(rows)])
    assert int((kernel != tensors).sum()) <= 1  # a uniform within float rounding of a boundary
    assert len(set(kernel.tolist())) > 100


def test_the_sampling_cache_reuses_tensors_only_for_the_same_parameter_objects() -> None:
    cache = SamplingCache()
    a, b = SamplingParams(temperature=0.5, top_p=0.9), SamplingParams(temperature=1.0, top_k=5)
    first = cache.get([a, b])
    assert cache.get([a, b]) is first  # the same requests, step after step
    equal_not_same = SamplingParams(temperature=0.5, top_p=0.9)
    for rows in ([b, a], [a], [a, b, a], [equal_not_same, b]):
        got = cache.get(rows)
        want = SamplingTensors.from_params(rows)
        assert got is not first
        assert got.temperature.tolist() == want.temperature.tolist()
        assert got.top_k.tolist() == want.top_k.tolist() and got.top_p.tolist() == want.top_p.tolist()
        assert (got.any_top_k, got.any_top_p, got.all_greedy) == (
            want.any_top_k,
            want.any_top_p,
            want.all_greedy,
        )
