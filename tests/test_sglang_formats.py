"""Our SPS / STS files and budget arithmetic against SGLang 0.5.23's own code.

Needs: ``pip install --no-deps sglang==0.5.23 msgspec`` (see /tmp/planner-notes.md). The
package's ``__init__`` pulls a CUDA stack, so SGLang's modules are loaded straight from
their files: ``dspark_sps.py`` and ``dspark_sts.py`` import only msgspec/torch, and the few
pure functions we compare against in ``dspark_planner.py``, ``dspark_schedule.py`` and
``benchmark/dspark_sts_fit.py`` are compiled from SGLang's source text on their own (their
modules import triton and the scheduler runtime).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any, Optional, Union

import msgspec
import numpy as np
import pytest
import torch

from dspark_server.planner import (
    PlannerConfig,
    SpsCostTable,
    StsCalibration,
    allocate_budget,
    expected_calibration_error,
    fit_sts,
    load_sps_table,
    load_sts_calibration,
    make_planner,
    prefix_survival,
    prefix_targets,
    save_sps_table,
    save_sts_calibration,
    verify_token_budget,
)


def _sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")  # locates the package without running __init__
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SGLang is not installed: pip install --no-deps sglang==0.5.23 msgspec")
    return Path(next(iter(spec.submodule_search_locations)))


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # msgspec resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _load_defs(name: str, path: Path, wanted: set[str], env: dict[str, Any]) -> types.ModuleType:
    """Compile only the top-level defs named ``wanted`` from ``path`` into a fresh module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    body = [
        node
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in wanted
    ]
    missing = wanted - {node.name for node in body}
    assert not missing, f"{path} no longer defines {missing}"
    module = types.ModuleType(name)
    module.__dict__.update(env)
    sys.modules[name] = module
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def sg() -> types.SimpleNamespace:
    root = _sglang_root()
    comp = root / "srt" / "speculative" / "dspark_components"
    sps = _load_file("_sglang_ref_dspark_sps", comp / "dspark_sps.py")
    sts = _load_file("_sglang_ref_dspark_sts", comp / "dspark_sts.py")
    env = {"torch": torch, "msgspec": msgspec, "Optional": Optional, "Union": Union, **vars(sps)}
    planner = _load_defs(
        "_sglang_ref_dspark_planner",
        comp / "dspark_planner.py",
        {
            "DSparkScheduleConfig",
            "VerifyBudgetDecision",
            "compute_verify_token_budget",
            "_lookup_sps_tensor",
            "_additive_step_time_tensor",
        },
        env,
    )
    schedule = _load_defs(
        "_sglang_ref_dspark_schedule",
        root / "kernels" / "ops" / "speculative" / "dspark" / "dspark_schedule.py",
        {
            "compute_sort_survival",
            "schedule_verify_lens_topk",
            "schedule_verify_lens_topk_from_survival",
            "_value_independent_descending_order",
        },
        {"torch": torch},
    )
    fit = _load_defs(
        "_sglang_ref_dspark_sts_fit",
        root / "benchmark" / "dspark_sts_fit.py",
        {"default_temperature_grid", "expected_calibration_error", "fit_sts_temperatures"},
        {"torch": torch, "math": __import__("math"), "_EPS_PROB": 1e-8},
    )
    return types.SimpleNamespace(sps=sps, sts=sts, planner=planner, schedule=schedule, fit=fit)


# --- SPS table files --------------------------------------------------------------------


def test_our_sps_file_loads_in_sglang(tmp_path: Path, sg: types.SimpleNamespace) -> None:
    ours = SpsCostTable((1, 8, 64, 512), (120.0, 110.5, 60.25, 9.0), 1024)
    path = tmp_path / "sps.json"
    save_sps_table(ours, path, metadata={"device": "H200", "gamma": 7, "probes_seconds": [0.1]})
    theirs = sg.sps.load_sps_table_from_path(str(path))
    assert type(theirs).__name__ == "SpsCostTable"
    assert theirs.sample_batch_tokens == [1, 8, 64, 512]
    assert theirs.sample_steps_per_sec == [120.0, 110.5, 60.25, 9.0]
    assert theirs.max_batch_tokens == 1024
    # Up to max_batch_tokens both read the table alike; past it SGLang holds the last value while
    # ours grows step time with B (tokens beyond the profile are never free).
    for b in [-1, 0, 1, 2, 7, 8, 63, 64, 511, 512, 1024]:
        assert ours.lookup(b) == theirs.lookup(b), b
    bs = torch.arange(0, 1025)
    assert torch.equal(
        ours.lookup_tensor(bs), sg.planner._lookup_sps_tensor(sps_table=theirs, batch_tokens=bs)
    )
    assert theirs.lookup(5000) == 9.0 and ours.lookup(5000) == 9.0 * 1024 / 5000


def test_sglang_sps_files_load_in_ours(tmp_path: Path, sg: types.SimpleNamespace) -> None:
    theirs = sg.sps.profile_sps_table(probes=[(64, 50.0), (1, 100.0), (8, 99.0)], max_batch_tokens=128)
    path = tmp_path / "sglang.json"
    path.write_text(theirs.to_json())
    ours = load_sps_table(path)
    assert ours.sample_batch_tokens == (1, 8, 64) and ours.max_batch_tokens == 128
    assert list(ours.sample_steps_per_sec) == theirs.sample_steps_per_sec
    placeholder = sg.sps.build_uninitialized_sps_table(max_batch_tokens=256)
    path.write_text(placeholder.to_json())
    assert load_sps_table(path) == SpsCostTable((1,), (1.0,), 256)


def test_both_loaders_reject_non_increasing_probes(tmp_path: Path, sg: types.SimpleNamespace) -> None:
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            {"sample_batch_tokens": [1, 4, 4], "sample_steps_per_sec": [3, 2, 1], "max_batch_tokens": 4}
        )
    )
    with pytest.raises(ValueError, match="strictly increasing"):
        sg.sps.load_sps_table_from_path(str(path))
    with pytest.raises(ValueError, match="strictly increasing"):
        load_sps_table(path)


# --- STS calibration files --------------------------------------------------------------


def test_our_sts_file_loads_in_sglang(tmp_path: Path, sg: types.SimpleNamespace) -> None:
    cal = StsCalibration((1.5, 2.25, 0.75), "shards/*.pt", 1234, (0.05, 0.06, 0.07), (0.01, 0.015, 0.02))
    path = tmp_path / "sts.json"
    save_sts_calibration(cal, path)
    theirs = sg.sts.load_sts_calibration_from_path(str(path))
    assert theirs.temperatures == [1.5, 2.25, 0.75]
    assert (theirs.dataset, theirs.num_samples) == ("shards/*.pt", 1234)
    assert theirs.ece_before == [0.05, 0.06, 0.07] and theirs.ece_after == [0.01, 0.015, 0.02]
    raw = torch.randn(5, 3)
    head_apply = torch.sigmoid(raw.float() / torch.tensor(theirs.temperatures))  # SGLang's apply_sts
    assert torch.allclose(cal.apply(raw), head_apply)


def test_sglang_sts_files_load_in_ours(tmp_path: Path, sg: types.SimpleNamespace) -> None:
    path = tmp_path / "sts.json"
    path.write_text(sg.sts.DSparkStsCalibration(temperatures=[2.0, 3.0]).to_json())  # defaults omitted
    assert load_sts_calibration(path) == StsCalibration((2.0, 3.0))
    full = sg.sts.DSparkStsCalibration(
        temperatures=[2.0], dataset="x", num_samples=3, ece_before=[0.2], ece_after=[0.1]
    )
    path.write_text(full.to_json())
    assert load_sts_calibration(path) == StsCalibration((2.0,), "x", 3, (0.2,), (0.1,))


def test_ece_and_fit_match_sglang_fitter(sg: types.SimpleNamespace) -> None:
    g = torch.Generator().manual_seed(5)
    n, gamma = 6000, 4
    z = torch.randn(n, gamma, generator=g, dtype=torch.float64) + 1.0
    accepted = torch.cumprod(
        (torch.rand(n, gamma, generator=g, dtype=torch.float64) < torch.sigmoid(z)).long(), 1
    ).sum(1)
    logits = (z * 2.5).float()
    mask = prefix_targets(accepted, gamma)
    probs = torch.sigmoid(logits[:, 0].double())
    for bins in (10, 15):
        want = sg.fit.expected_calibration_error(probs=probs, targets=mask[:, 0], num_bins=bins)
        assert expected_calibration_error(probs, mask[:, 0], bins) == pytest.approx(want, abs=1e-12)
    want = sg.fit.fit_sts_temperatures(
        logits=logits, prefix_mask=mask, grid=sg.fit.default_temperature_grid()
    )
    ours = fit_sts(logits, accepted)
    assert list(ours.temperatures) == pytest.approx(want["temperatures"], rel=1e-12)
    assert list(ours.ece_before) == pytest.approx(want["ece_before"], abs=1e-12)
    assert list(ours.ece_after) == pytest.approx(want["ece_after"], abs=1e-12)


# --- production budget ------------------------------------------------------------------


def _cases() -> list[tuple[torch.Tensor, SpsCostTable]]:
    rng = np.random.default_rng(11)
    cases = []
    for i in range(60):
        num_requests, gamma = int(rng.integers(1, 64)), int(rng.integers(1, 9))
        max_tokens = num_requests * (gamma + 1)
        probes = sorted({int(x) for x in rng.integers(1, max_tokens + 1, size=int(rng.integers(1, 8)))})
        sps = np.sort(rng.uniform(5.0, 100.0, size=len(probes)))[::-1]
        conf = rng.beta(4, 1, size=(num_requests, gamma))
        if i % 3 == 0:
            conf = np.round(conf * 4) / 4  # many exact ties
        if i % 5 == 0:
            conf[:, -1] = 1e-7  # below survival_eps
        table = SpsCostTable(tuple(probes), tuple(float(s) for s in sps), max_tokens)
        cases.append((torch.from_numpy(conf).float(), table))
    return cases


def _sglang_table(sg: types.SimpleNamespace, table: SpsCostTable) -> Any:
    return sg.sps.SpsCostTable(
        sample_batch_tokens=list(table.sample_batch_tokens),
        sample_steps_per_sec=list(table.sample_steps_per_sec),
        max_batch_tokens=table.max_batch_tokens,
    )


def test_budget_matches_compute_verify_token_budget(sg: types.SimpleNamespace) -> None:
    for conf, table in _cases():
        cfg = sg.planner.DSparkScheduleConfig(gamma=conf.shape[1])
        survival = sg.schedule.compute_sort_survival(conf)
        assert torch.equal(prefix_survival(conf), survival)
        want = sg.planner.compute_verify_token_budget(
            history_survival_probs=survival, sps_table=_sglang_table(sg, table), cfg=cfg
        )
        k, theta = verify_token_budget(survival, table)
        assert k == want.budget
        assert theta == pytest.approx(want.predicted_theta, rel=1e-12)


def test_allocation_matches_sglang_topk(sg: types.SimpleNamespace) -> None:
    for conf, _ in _cases():
        cfg = sg.planner.DSparkScheduleConfig(gamma=conf.shape[1])
        for budget in (0, 1, 3, conf.numel() // 2, conf.numel(), conf.numel() + 5):
            verify_lens = sg.schedule.schedule_verify_lens_topk(confidence=conf, budget=budget, cfg=cfg)
            ours = allocate_budget(prefix_survival(conf), budget)
            assert torch.equal(ours, verify_lens.long() - 1), budget  # SGLang counts the anchor


def test_budget_planner_end_to_end_matches_sglang(sg: types.SimpleNamespace) -> None:
    rng = np.random.default_rng(2)
    for conf, table in _cases():
        stale = torch.from_numpy(rng.uniform(0.5, 1.0, size=tuple(conf.shape))).float()
        stale[0] = 1.0  # a request without history, as SGLang fills it
        cfg = sg.planner.DSparkScheduleConfig(gamma=conf.shape[1])
        budget = sg.planner.compute_verify_token_budget(
            history_survival_probs=sg.schedule.compute_sort_survival(stale),
            sps_table=_sglang_table(sg, table),
            cfg=cfg,
        ).budget
        want = sg.schedule.schedule_verify_lens_topk(confidence=conf, budget=budget, cfg=cfg).long() - 1
        planner = make_planner(PlannerConfig(mode="dspark_budget", gamma=conf.shape[1]), table)
        res = planner.plan_detailed(conf, budget_confidences=stale)
        assert res.budget == budget
        assert torch.equal(res.verify_lens, want)
