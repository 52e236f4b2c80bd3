"""Verify-length planners: DSpark greedy with early stop, baselines, budget variant."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from dspark_server.planner import (
    PlannerConfig,
    SpsCostTable,
    allocate_budget,
    fit_roofline,
    make_planner,
    prefix_survival,
    steps_per_sec,
    summarize_plan,
    verify_token_budget,
)

APPENDIX_A = SpsCostTable((1, 2, 3), (1.0, 0.5, 0.45), 3)


def theta_of(survival: torch.Tensor, lens: list[int] | tuple[int, ...], table: SpsCostTable) -> float:
    """Theta computed the slow, obvious way."""
    tau = sum(1.0 + float(survival[r, :lr].double().sum()) for r, lr in enumerate(lens))
    return tau * table.lookup(sum(1 + lr for lr in lens))


def greedy_reference(survival: torch.Tensor, table: SpsCostTable) -> list[int]:
    """The method doc's loop, written naively (ties: position, then request)."""
    num_requests, gamma = survival.shape
    cands = sorted(
        ((float(survival[r, j]), j, r) for r in range(num_requests) for j in range(gamma)),
        key=lambda c: (-c[0], c[1], c[2]),
    )
    lens = [0] * num_requests
    batch, tau = num_requests, float(num_requests)
    best = tau * table.lookup(batch)
    for value, j, r in cands:
        assert lens[r] == j  # prefix order
        new = (tau + value) * table.lookup(batch + 1)
        if not new > best:
            break
        lens[r], batch, tau, best = j + 1, batch + 1, tau + value, new
    return lens


def random_table(rng: np.random.Generator, max_tokens: int) -> SpsCostTable:
    probes = sorted(
        set(
            rng.choice(
                np.arange(1, max_tokens + 1), size=min(int(rng.integers(1, 5)), max_tokens), replace=False
            )
        )
    )
    sps = np.sort(rng.uniform(0.2, 2.0, size=len(probes)))[::-1]
    return SpsCostTable(tuple(int(p) for p in probes), tuple(float(s) for s in sps), max_tokens)


def test_appendix_a_counterexample_stops_at_first_drop() -> None:
    planner = make_planner(PlannerConfig(mode="dspark", gamma=2), APPENDIX_A)
    for c2 in (1.0, 0.6, 0.1):
        res = planner.plan_detailed(torch.tensor([[0.8, c2]]))
        assert res.verify_lens.tolist() == [0]
        assert res.expected_throughput == pytest.approx(1.0)  # Theta_0 = 1 * SPS(1)
        assert res.batch_tokens == 1 and res.expected_tokens == pytest.approx(1.0)
    survival = prefix_survival(torch.tensor([[0.8, 1.0]]))
    assert theta_of(survival, [1], APPENDIX_A) == pytest.approx(0.9)  # Theta_1 = 1.8 * 0.5
    # A search past the drop would verify both tokens (Theta_2 = 2.6 * 0.45 = 1.17), letting
    # the value of x1 (through c2) decide whether x1 is verified: the lossless violation.
    assert theta_of(survival, [2], APPENDIX_A) == pytest.approx(1.17)


def test_matches_brute_force_when_unimodal_and_stops_at_first_drop_otherwise() -> None:
    rng = np.random.default_rng(1234)
    checked = {"unimodal": 0, "multimodal": 0}
    for _ in range(400):
        num_requests, gamma = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        table = random_table(rng, num_requests * (gamma + 1))
        conf = torch.from_numpy(rng.uniform(0.0, 1.0, size=(num_requests, gamma))).float()
        survival = prefix_survival(conf)
        res = make_planner(PlannerConfig(mode="dspark", gamma=gamma), table).plan_detailed(conf)
        lens = res.verify_lens.tolist()
        assert res.expected_throughput == pytest.approx(theta_of(survival, lens, table))
        assert res.batch_tokens == num_requests + sum(lens)
        assert lens == greedy_reference(survival, table)

        brute = max(
            theta_of(survival, cand, table)
            for cand in itertools.product(range(gamma + 1), repeat=num_requests)
        )
        ranked = sorted(survival.reshape(-1).tolist(), reverse=True)
        path = [
            (num_requests + sum(ranked[:k])) * table.lookup(num_requests + k) for k in range(len(ranked) + 1)
        ]
        assert brute == pytest.approx(max(path))  # the sorted path holds the optimum
        stop = next((k for k in range(1, len(path)) if not path[k] > path[k - 1]), len(path)) - 1
        assert sum(lens) == stop
        if max(path[stop:]) <= path[stop]:
            checked["unimodal"] += 1
            assert res.expected_throughput == pytest.approx(brute)
        else:
            checked["multimodal"] += 1
            assert res.expected_throughput < brute
    assert checked["unimodal"] > 100 and checked["multimodal"] > 10


def random_case(rng: np.random.Generator) -> tuple[int, SpsCostTable, torch.Tensor]:
    """(gamma, a decreasing SPS table over the reachable batch sizes, confidences [R, gamma])."""
    num_requests, gamma = int(rng.integers(1, 40)), int(rng.integers(1, 9))
    max_tokens = num_requests * (gamma + 1)
    probes = sorted({1, *rng.integers(1, max_tokens + 1, size=6).tolist()})
    sps = np.sort(rng.uniform(1.0, 50.0, size=len(probes)))[::-1]
    table = SpsCostTable(tuple(probes), tuple(sps.tolist()), max_tokens)
    return gamma, table, torch.from_numpy(rng.beta(5, 1, size=(num_requests, gamma))).float()


def test_vectorised_greedy_equals_naive_loop_on_larger_batches() -> None:
    rng = np.random.default_rng(7)
    for _ in range(60):
        gamma, table, conf = random_case(rng)
        lens = make_planner(PlannerConfig(mode="dspark", gamma=gamma), table).plan(conf)
        assert lens.tolist() == greedy_reference(prefix_survival(conf), table)


def test_ties_are_admitted_in_prefix_then_request_order() -> None:
    table = SpsCostTable((1, 6), (1.0, 0.5), 9)  # B <= 5 flat, B >= 6 half speed
    planner = make_planner(PlannerConfig(mode="dspark", gamma=3), table)
    lens = planner.plan(torch.ones(3, 3))
    assert lens.tolist() == [1, 1, 0]  # (r0,j1), (r1,j1) admitted; (r2,j1) would hit B=6
    flat = SpsCostTable((1,), (1.0,), 64)
    conf = torch.tensor([[1.0, 1.0, 0.0], [0.5, 1.0, 1.0]])
    res = make_planner(PlannerConfig(mode="dspark", gamma=3), flat).plan_detailed(conf)
    # equal survivals 0.5, 0.5 (r1 j1..j3); zero-survival candidates add nothing on a flat table
    assert res.verify_lens.tolist() == [2, 3]
    assert res.expected_tokens == pytest.approx(2 + 2.0 + 1.5)


def test_lengths_are_prefixes_and_in_range() -> None:
    rng = np.random.default_rng(3)
    table = SpsCostTable((1, 64, 256, 1024), (100.0, 90.0, 40.0, 10.0), 4096)
    for mode in ("off", "fixed", "threshold", "dspark", "dspark_budget"):
        planner = make_planner(PlannerConfig(mode=mode, gamma=15, threshold=0.4), table)
        conf = torch.from_numpy(rng.uniform(0.3, 1.0, size=(256, 15))).float()
        lens = planner.plan(conf, budget_confidences=conf.flip(0))
        assert lens.dtype == torch.int64 and lens.shape == (256,)
        assert int(lens.min()) >= 0 and int(lens.max()) <= 15


def test_baseline_semantics() -> None:
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.5, 1.0, 1.0], [1.0, 1.0, 1.0], [0.2, 0.9, 0.9]])
    off = make_planner(PlannerConfig(mode="off", gamma=3)).plan_detailed(conf)
    assert off.verify_lens.tolist() == [0, 0, 0, 0]
    assert off.batch_tokens == 4 and off.expected_tokens == 4.0 and math.isnan(off.expected_throughput)
    fixed = make_planner(PlannerConfig(mode="fixed", gamma=3)).plan(conf)
    assert fixed.tolist() == [3, 3, 3, 3]
    # survival: [.9 .81 .729], [.5 .5 .5], [1 1 1], [.2 .18 .162]
    thr = make_planner(PlannerConfig(mode="threshold", gamma=3, threshold=0.8)).plan(conf)
    assert thr.tolist() == [2, 0, 3, 0]
    thr = make_planner(PlannerConfig(mode="threshold", gamma=3, threshold=0.5)).plan(conf)
    assert thr.tolist() == [3, 3, 3, 0]  # a == threshold counts
    assert (
        make_planner(PlannerConfig(mode="threshold", gamma=3, threshold=0.0)).plan(conf).tolist() == [3] * 4
    )


def test_plan_statistics_match_summary() -> None:
    table = SpsCostTable((1, 8, 16), (10.0, 6.0, 3.0), 32)
    conf = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.95, 0.9, 0.2, 0.9], [0.4, 0.9, 0.9, 0.9]])
    for mode in ("fixed", "threshold", "dspark", "dspark_budget"):
        res = make_planner(PlannerConfig(mode=mode, gamma=4), table).plan_detailed(
            conf, budget_confidences=conf
        )
        b, tau, theta = summarize_plan(prefix_survival(conf), res.verify_lens, table)
        assert (res.batch_tokens, res.expected_tokens, res.expected_throughput) == pytest.approx(
            (b, tau, theta)
        )
        assert theta == pytest.approx(theta_of(prefix_survival(conf), res.verify_lens.tolist(), table))


def test_dirty_inputs_are_sanitised_and_not_mutated() -> None:
    conf = torch.tensor([[math.nan, 0.9], [1.5, -0.0], [-0.3, 0.7]])
    before = conf.clone()
    survival = prefix_survival(conf)
    assert torch.equal(survival, torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]))
    table = SpsCostTable((1,), (1.0,), 16)
    for mode in ("threshold", "dspark", "dspark_budget"):
        lens = make_planner(PlannerConfig(mode=mode, gamma=2), table).plan(conf, budget_confidences=conf)
        assert lens.tolist()[1] == 1 and lens.tolist()[0] == 0
    assert torch.equal(conf.isnan(), before.isnan())
    assert torch.equal(torch.nan_to_num(conf), torch.nan_to_num(before))


def test_empty_batch_and_errors() -> None:
    table = SpsCostTable((1,), (1.0,), 16)
    for mode in ("off", "fixed", "threshold", "dspark", "dspark_budget"):
        empty = torch.zeros(0, 3)
        res = make_planner(PlannerConfig(mode=mode, gamma=3), table).plan_detailed(
            empty, budget_confidences=empty
        )
        assert res.verify_lens.shape == (0,) and res.batch_tokens == 0
    planner = make_planner(PlannerConfig(mode="dspark", gamma=3), table)
    with pytest.raises(ValueError, match="positions"):
        planner.plan(torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"\[R, gamma\]"):
        planner.plan(torch.ones(4))
    with pytest.raises(ValueError, match="SPS cost table"):
        make_planner(PlannerConfig(mode="dspark", gamma=3)).plan(torch.ones(2, 3))
    with pytest.raises(ValueError, match="mode"):
        PlannerConfig(mode="eagle")
    with pytest.raises(ValueError, match="gamma"):
        PlannerConfig(gamma=0)
    with pytest.raises(ValueError, match="threshold"):
        PlannerConfig(mode="threshold", threshold=1.5)


def test_budget_is_argmax_without_early_stop() -> None:
    survival = prefix_survival(torch.tensor([[0.8, 1.0]]))
    k, theta = verify_token_budget(survival, APPENDIX_A)
    assert (k, theta) == (2, pytest.approx(1.17))  # looks past the drop at k = 1
    table = SpsCostTable((1,), (1.0,), 8)
    k, _ = verify_token_budget(prefix_survival(torch.tensor([[0.5, 1e-9, 1.0]])), table)
    assert k == 1  # candidates below survival_eps are not counted; Theta ties go to small k


def test_budget_planner_uses_stale_confidences_for_budget_and_current_for_allocation() -> None:
    table = SpsCostTable((1, 4, 5), (1.0, 1.0, 0.1), 16)  # B <= 4 free, B >= 5 ruinous
    planner = make_planner(PlannerConfig(mode="dspark_budget", gamma=2), table)
    current = torch.tensor([[0.2, 0.2], [0.9, 0.9]])
    stale = torch.tensor([[0.9, 0.9], [0.9, 0.9]])
    res = planner.plan_detailed(current, budget_confidences=stale)
    assert res.budget == 2
    assert res.verify_lens.tolist() == [0, 2]  # top-2 of the current survivals
    res = planner.plan_detailed(current, budget_confidences=torch.zeros(2, 2))
    assert res.budget == 0 and res.verify_lens.tolist() == [0, 0]  # the budget follows the stale rows
    with pytest.raises(ValueError, match="budget_confidences"):
        planner.plan(current)  # the current confidences alone would not be lossless
    with pytest.raises(ValueError, match="rows"):
        planner.plan(current, budget_confidences=stale[:1])


def test_allocate_budget_order_and_eps() -> None:
    survival = prefix_survival(torch.tensor([[1.0, 1.0], [1.0, 1e-9], [0.5, 1.0]]))
    assert allocate_budget(survival, 0).tolist() == [0, 0, 0]
    assert allocate_budget(survival, 2).tolist() == [1, 1, 0]  # ties: position, then request
    assert allocate_budget(survival, 3).tolist() == [2, 1, 0]
    assert allocate_budget(survival, 100).tolist() == [2, 1, 2]  # the 1e-9 candidate never counts


def test_step_overhead_prices_a_step_as_overhead_plus_verification() -> None:
    # a steep curve: 5 ms per token (10 ms for 2 tokens, 20 ms for 4, 30 ms for 6)
    table = SpsCostTable((1, 2, 3, 4, 5, 6), (200.0, 100.0, 200 / 3, 50.0, 40.0, 100 / 3), 6)
    conf = torch.tensor([[0.6, 0.3], [0.6, 0.3]])  # survival 0.6, 0.18 per request
    planner = make_planner(PlannerConfig(mode="dspark", gamma=2), fit_roofline(table))
    # SPS alone: one 0.6 draft costs 5 ms on a 10 ms step: (2.6 / 15 ms) < (2 / 10 ms): nothing
    assert planner.plan(conf).tolist() == [0, 0]
    # a 40 ms draft pass already spent: the same 5 ms buys 0.6 tokens on a 50 ms step
    planner.set_step_overhead(0.040)
    res = planner.plan_detailed(conf)
    assert res.verify_lens.tolist() == [1, 1]  # a 0.18 draft would not pay its 5 ms
    assert res.expected_throughput == pytest.approx(3.2 / 0.060)
    assert steps_per_sec(table, 2, 3, 0.040).tolist() == pytest.approx([1 / 0.05, 1 / 0.055, 1 / 0.06])
    with pytest.raises(ValueError):
        planner.set_step_overhead(-1.0)


def test_roofline_fit_recovers_flat_then_linear_step_times() -> None:
    # 10 ms flat up to 32 tokens, then +0.5 ms per token; probes scattered by +-10 % noise
    rng = np.random.default_rng(0)
    probes = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    true = [0.010 + 0.0005 * max(0, b - 32) for b in probes]
    noisy = [t * (1 + 0.1 * (rng.random() * 2 - 1)) for t in true]
    fit = fit_roofline(SpsCostTable(probes, tuple(1 / t for t in noisy), 256))
    assert fit.sample_batch_tokens == tuple(range(1, 257))
    seconds = np.array([1 / fit.lookup(b) for b in range(1, 257)])
    assert np.all(np.diff(seconds) >= 0)  # never faster with more tokens
    expected = 0.010 + 0.0005 * np.maximum(0, np.arange(1, 257) - 32)
    assert np.max(np.abs(seconds / expected - 1)) < 0.12
    # a flat (memory-bound) curve stays flat
    flat = fit_roofline(SpsCostTable((1, 64, 512), (100.0, 100.0, 100.0), 512))
    assert fit_roofline(flat).lookup(512) == pytest.approx(100.0) and flat.lookup(1) == pytest.approx(100.0)


def test_roofline_fit_keeps_a_gentle_rise_before_the_steep_one() -> None:
    # a model bigger than the caches on a CPU: 13 ms for one token, +0.45 ms per token while the
    # weights' reads dominate, +1.4 ms per token past 8; probes scattered by +-3 % noise
    rng = np.random.default_rng(1)
    probes = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80)

    def true(b: np.ndarray | int) -> np.ndarray:
        return 0.013 + 0.00045 * np.maximum(0, np.asarray(b) - 1) + 0.00095 * np.maximum(0, np.asarray(b) - 8)

    noisy = [float(true(b)) * (1 + 0.03 * (rng.random() * 2 - 1)) for b in probes]
    fit = fit_roofline(SpsCostTable(probes, tuple(1 / t for t in noisy), 80))
    seconds = np.array([1 / fit.lookup(b) for b in range(1, 81)])
    assert np.max(np.abs(seconds / true(np.arange(1, 81)) - 1)) < 0.05
    # a verification of 8 tokens is priced by the gentle rise, not by the compute-bound slope
    assert 0.0003 < (seconds[7] - seconds[3]) / 4 < 0.0006


def test_planning_from_survival_equals_the_naive_loop_and_the_confidence_path() -> None:
    # the engine plans from its calibration's survival directly (no round trip through
    # confidences); every mode must plan exactly as from the confidences that survival implies
    rng = np.random.default_rng(11)
    for _ in range(60):
        gamma, table, conf = random_case(rng)
        max_tokens = table.max_batch_tokens
        survival = prefix_survival(conf)  # float32, as the confidence path computes it
        for mode in ("dspark", "fixed", "threshold", "off"):
            planner = make_planner(PlannerConfig(mode=mode, gamma=gamma), table)
            cap = int(rng.integers(0, max_tokens)) if mode != "off" else None
            direct = planner.plan_survival(survival.double().numpy(), max_draft_tokens=cap)
            via = planner.plan_detailed(conf, max_draft_tokens=cap)
            assert direct.verify_lens.tolist() == via.verify_lens.tolist(), mode
            assert (direct.batch_tokens, direct.expected_tokens) == (
                via.batch_tokens,
                pytest.approx(via.expected_tokens),
            )
        lens = make_planner(PlannerConfig(mode="dspark", gamma=gamma), table).plan_survival(survival.numpy())
        assert lens.verify_lens.tolist() == greedy_reference(survival, table)
    # dirty survival is sanitised like dirty confidences: NaN -> 0, clamped, non-increasing
    planner = make_planner(PlannerConfig(mode="threshold", gamma=3, threshold=0.5))
    dirty = np.array([[float("nan"), 0.9, 0.8], [1.5, 0.2, 0.7]])
    assert planner.plan_survival(dirty).verify_lens.tolist() == [0, 1]
    with pytest.raises(ValueError, match="positions"):
        planner.plan_survival(np.ones((2, 4)))


def test_one_request_plans_as_the_naive_loop_with_overhead_budget_and_prefill() -> None:
    # one request takes a plain-float path (the c = 1 hot path); it must plan exactly as the
    # method's loop does, with the step overhead, the budget cap and the prefill tokens priced
    rng = np.random.default_rng(5)
    for _ in range(400):
        gamma, table, conf = random_case(rng)
        conf = conf[:1]
        survival = prefix_survival(conf)[0].double().tolist()
        overhead = float(rng.choice([0.0, rng.uniform(0.0, 0.1)]))
        extra = int(rng.integers(0, 4))
        cap = None if rng.random() < 0.5 else int(rng.integers(0, gamma + 1))
        planner = make_planner(PlannerConfig(mode="dspark", gamma=gamma), table)
        planner.set_step_overhead(overhead)
        res = planner.plan_survival(np.array([survival]), max_draft_tokens=cap, extra_batch_tokens=extra)
        rates = steps_per_sec(table, 1 + extra, gamma + 1, overhead).tolist()
        tau, best, ell = 1.0, rates[0], 0
        for j, value in enumerate(survival):
            if (cap is not None and ell >= cap) or not (tau + value) * rates[j + 1] > best:
                break
            tau, best, ell = tau + value, (tau + value) * rates[j + 1], j + 1
        assert res.verify_lens.tolist() == [ell]
        assert (res.batch_tokens, res.expected_tokens, res.expected_throughput) == (
            1 + ell,
            pytest.approx(tau),
            pytest.approx(best),
        )
