"""Assembling the speculative decoder: drafter, context pool, planner, cost table, calibration."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from dspark_server.config import EngineConfig
from dspark_server.engine.model_runner import ModelRunner
from dspark_server.engine.profiler import (
    cache_dir,
    machine_description,
    profile_context,
    profile_key,
    profile_sps,
)
from dspark_server.engine.spec.decoder import SpeculativeDecoder
from dspark_server.engine.spec.draft_gate import DraftGate
from dspark_server.engine.spec.lookup import PromptLookup
from dspark_server.engine.spec.step_overhead import StepOverhead
from dspark_server.models.drafter_checkpoint import load_drafter
from dspark_server.models.kernel_library import load_library
from dspark_server.planner import (
    CalibrationDriftTracker,
    CalibrationSet,
    LiveSpsTable,
    OnlineCalibrationConfig,
    PlannerConfig,
    SpsCostTable,
    load_calibration_set,
    load_sps_table,
    make_planner,
    save_sps_table,
)

log = logging.getLogger(__name__)

CALIBRATION_FILE = "sts_calibration.json"
GREEDY_CALIBRATION_FILE = "sts_calibration_greedy.json"
STARTUP_PROFILE_BUDGET_S = 25.0
DRAFT_WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def build_speculative(cfg: EngineConfig, runner: ModelRunner) -> SpeculativeDecoder:
    assert cfg.draft_dir is not None
    spec = cfg.spec
    drafter = load_drafter(cfg.draft_dir, runner.target, runner.dtype)
    lib = load_library() if cfg.layer_kernels else None
    draft_dtype = cfg.resolved_draft_weight_dtype()
    if draft_dtype not in DRAFT_WEIGHT_DTYPES:
        raise ValueError(f"draft_weight_dtype must be auto, float32, bfloat16 or int8, got {draft_dtype!r}")
    drafter.use_kernels(lib, fused=cfg.fused_forward, weight_dtype=DRAFT_WEIGHT_DTYPES[draft_dtype])
    served = str(drafter.serving_weight_dtype).removeprefix("torch.")
    log.info("drafter weights served as %s (--draft-weight-dtype %s)", served, cfg.draft_weight_dtype)
    gamma = spec.gamma or drafter.gamma
    # the context cache in the target's KV dtype (a bfloat16 one where the fused calls read it)
    pool = drafter.new_kv_pool(runner.allocator.num_slots, runner.pool.k.dtype, impl=cfg.attention_impl)
    if not drafter.serves_pool(pool):
        pool = drafter.new_kv_pool(runner.allocator.num_slots, runner.dtype, impl=cfg.attention_impl)
    table = resolve_sps_table(cfg, runner) if spec.mode == "dspark" else None
    planner = make_planner(PlannerConfig(mode=spec.mode, gamma=gamma, threshold=spec.threshold), table)
    live = LiveSpsTable(table, enabled=spec.live_sps_refresh) if table is not None else None
    if spec.mode in ("dspark", "threshold") and drafter.confidence_head is None:
        raise ValueError(f"--spec-mode {spec.mode} needs a drafter with a confidence head")
    # Only the load-aware mode may skip drafting; fixed and threshold stay pure baselines.
    seconds = None if live is None else forward_seconds(live)
    gate = DraftGate(forward_seconds=seconds) if spec.mode == "dspark" and spec.draft_gate else None
    overhead = StepOverhead() if spec.mode == "dspark" and spec.price_step_overhead else None
    return SpeculativeDecoder(
        drafter,
        pool,
        planner,
        resolve_calibration(cfg, drafter.gamma),
        live,
        CalibrationDriftTracker(gamma),
        gamma,
        gate,
        overhead,
        resolve_greedy_calibration(cfg),
        PromptLookup(gamma) if spec.prompt_lookup else None,
        OnlineCalibrationConfig() if spec.mode == "dspark" and spec.online_calibration else None,
    )


def _calibration_file(
    explicit: str | None, draft_dir: str | None, name: str, default_regime: float
) -> CalibrationSet | None:
    """The explicit file (which must exist), else ``name`` next to the drafter, else None. A plain
    STS file (no per-regime extension) becomes one regime keyed ``default_regime``."""
    path = Path(explicit) if explicit else Path(draft_dir or "") / name
    if path.is_file():
        return load_calibration_set(path, default_regime)
    if explicit:
        raise FileNotFoundError(f"calibration file {explicit} does not exist")
    return None


def resolve_calibration(cfg: EngineConfig, block: int) -> CalibrationSet:
    found = _calibration_file(cfg.spec.calibration_path, cfg.draft_dir, CALIBRATION_FILE, 1.0)
    if found is None:
        log.warning("no STS calibration next to the drafter (%s): using raw confidences", cfg.draft_dir)
        return CalibrationSet.identity(block)
    return found


def forward_seconds(live: LiveSpsTable) -> Callable[[int], float]:
    """The target forward's time at B batch tokens, from the live SPS table."""

    def seconds(batch_tokens: int) -> float:
        return 1.0 / live.current_table().lookup(batch_tokens)

    return seconds


def resolve_greedy_calibration(cfg: EngineConfig) -> CalibrationSet | None:
    """--greedy-calibration, else the drafter's sts_calibration_greedy.json, else None (greedy
    requests then use the greedy regime of the sampling calibration, else its lowest regime)."""
    return _calibration_file(cfg.spec.greedy_calibration_path, cfg.draft_dir, GREEDY_CALIBRATION_FILE, 0.0)


def resolve_sps_table(cfg: EngineConfig, runner: ModelRunner) -> SpsCostTable:
    """--profile, else a profile measured now (bounded in time) on this engine as it is built: a
    table from an earlier run or another build (a different attention path, a busy machine)
    could be off by several times, more than the live refresh may correct. The table is also
    written to the cache directory, for inspection."""
    if cfg.spec.profile_path:
        return load_sps_table(cfg.spec.profile_path)
    key = profile_key(cfg.model_dir, cfg.serving_dtype())
    log.info("profiling verification steps for the SPS table (<= %.0f s)", STARTUP_PROFILE_BUDGET_S)
    table = profile_sps(
        runner,
        cfg.max_batch_tokens,
        block=(cfg.spec.gamma or 7) + 1,
        context=profile_context(cfg.max_model_len),
        repeats=3,
        time_budget_s=STARTUP_PROFILE_BUDGET_S,
    )
    out = cache_dir() / f"{key}.json"
    save_sps_table(
        table,
        out,
        metadata={
            "profile_key": key,
            "model_dir": cfg.model_dir,
            "dtype": cfg.dtype,
            "machine": machine_description(),
        },
    )
    return table
