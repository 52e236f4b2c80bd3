"""Oracle replay: how close do the planners get to one that knows every draft's fate?

    dspark bench --suite oracle --prompts humaneval.jsonl,mt-bench.jsonl --limit 40 \\
        --concurrency 1,16,64 [--model DIR --draft DIR --profile SPS.json] --out runs/bench/oracle

1. Record: the engine runs with full-γ verification (``fixed``), and a round observer keeps, for
   every request and round, the calibrated confidences c(r, 1..γ) (the drafter's raw confidence
   logits through the same STS file the server uses) and the number of drafts the target
   accepted. Saved as ``rounds.json`` (``--rounds-file`` replays it without a model).
2. Replay at concurrency C: requests enter C slots in order (continuous batching); each step every
   active request presents its next recorded round. A planner turns the step's confidences into
   verify lengths ℓ_r; the request then emits min(ℓ_r, accepted_r) + 1 tokens and the step costs
   1 / SPS(R + Σℓ) seconds under the SPS table. The oracle knows accepted_r: verifying past it is
   waste, every draft up to it is worth one token, so per step it picks K ≤ Σ accepted_r useful
   drafts, jointly over all steps so that Σ tokens / Σ seconds is maximal (it may also pad a step
   to a larger batch where a non-monotone table makes that faster): no planner can beat it.
   Θ = tokens / seconds over the whole replay; reported as Θ / Θ(oracle).

Every planner consumes the same recorded rounds in the same steps (a request advances one
recorded round per step whatever it emitted), so the comparison isolates the planning decision
from the text the request would have produced next. Issue F's goal: dspark ≥ 0.9 of the oracle.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_server.bench.common import (
    BenchError,
    SuiteConfig,
    concurrency_axis,
    load_prompt_sets,
    machine_info,
    pyplot,
    save_figure,
    write_json,
    write_result,
)
from dspark_server.bench.render import oracle_markdown
from dspark_server.planner import (
    OnlineCalibration,
    OnlineCalibrationConfig,
    PlannerConfig,
    SpsCostTable,
    fit_roofline,
    load_sps_table,
    make_planner,
)

ONLINE = "dspark+online"  # the dspark planner with the server's online recalibration

# ---------------------------------------------------------------------------------------------
# Recording


class RoundLog:
    """Round observer: per request, the calibrated confidences and accepted count of each
    full-γ round (rounds shortened by ``max_tokens`` say nothing about later positions)."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self.prompt_set = ""
        self.requests: dict[tuple[str, str], dict[str, Any]] = {}

    def __call__(self, record: Any) -> None:
        if record.confidence_logits is None or record.confidences is None:
            raise BenchError("this drafter has no confidence head: nothing to plan from")
        raw = record.confidence_logits.float()
        conf = record.confidences  # as the engine planned with them (greedy rows by the greedy STS)
        for i, (req, ell, acc) in enumerate(
            zip(record.requests, record.verify_lens, record.accepted, strict=True)
        ):
            if ell != self.gamma:
                continue
            entry = self.requests.setdefault(
                (self.prompt_set, req.request_id),
                {
                    "prompt_set": self.prompt_set,
                    "request": req.request_id,
                    "confidences": [],
                    "raw_logits": [],
                    "accepted": [],
                },
            )
            entry["confidences"].append([round(x, 6) for x in conf[i].tolist()])
            entry["raw_logits"].append([round(x, 5) for x in raw[i].tolist()])
            entry["accepted"].append(int(acc))


@dataclass(frozen=True)
class OracleConfig:
    suite: SuiteConfig  # suite.engine: --profile, --threshold and --sps-only-cost of the replay
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    rounds_file: str | None = None  # replay this recording instead of recording one


def record_rounds(a: SuiteConfig, concurrency: int) -> tuple[dict[str, Any], Any]:
    """Full-γ rounds of every prompt; returns (recording, the engine) — the engine is reused to
    find the SPS table."""
    from dspark_server.engine.engine import LLMEngine
    from dspark_server.offline import GenerateConfig, generate

    base = a.engine
    if base.num_threads:
        torch.set_num_threads(base.num_threads)
    if base.draft_dir is None:
        raise BenchError("recording rounds needs a drafter (--draft DIR)")
    cfg = replace(base, spec=replace(base.spec, mode="fixed"), max_running=max(concurrency, 1))
    engine = LLMEngine(cfg)
    assert engine.spec is not None
    logger = RoundLog(engine.spec.gamma)
    engine.spec.round_observers.append(logger)
    sets = load_prompt_sets(a.prompt_files, a.limit)
    for ps in sets:
        logger.prompt_set = ps.name
        gen = GenerateConfig(
            prompts=ps.path,
            limit=a.limit,
            max_tokens=a.max_tokens,
            temperature=a.temperature,
            seed=a.seed,
            concurrency=concurrency,
            progress=a.progress,
        )
        for _ in generate(engine, gen):
            pass
    requests = [r for r in logger.requests.values() if r["accepted"]]
    if not requests:
        raise BenchError("no full-γ rounds were recorded; use more prompts or --max-tokens")
    recording = {
        "kind": "rounds",
        "gamma": engine.spec.gamma,
        "model": base.model_dir,
        "draft": base.draft_dir,
        "calibration_temperatures": [float(t) for t in engine.spec.calibration.temperatures],
        "greedy_calibration_temperatures": [float(t) for t in engine.spec.greedy_calibration.temperatures],
        "prompt_sets": {ps.name: ps.path for ps in sets},
        "max_tokens": a.max_tokens,
        "temperature": a.temperature,
        "requests": requests,
    }
    return recording, engine


# ---------------------------------------------------------------------------------------------
# Replay


@dataclass
class _Acc:
    tokens: float = 0.0
    seconds: float = 0.0
    verified: float = 0.0
    rounds: int = 0
    steps: int = 0

    def add(self, tokens: float, verified: float, rounds: int, sps: float) -> None:
        self.tokens += tokens
        self.verified += verified
        self.rounds += rounds
        self.steps += 1
        self.seconds += 1.0 / sps

    def summary(self) -> dict[str, float]:
        return {
            "throughput": self.tokens / self.seconds if self.seconds else 0.0,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "steps": self.steps,
            "mean_verify_len": self.verified / self.rounds if self.rounds else 0.0,
            "tokens_per_round": self.tokens / self.rounds if self.rounds else 0.0,
        }


def oracle_options(accepted: np.ndarray, table: SpsCostTable, gamma: int) -> np.ndarray:
    """Seconds of one step for each K = 0..Σaccepted useful drafts verified: 1 / SPS*(R + K), where
    SPS*(B) is the best SPS at any batch size from B up to R(1 + γ) (the oracle may pad, so that
    a measured table that is not monotone cannot let a wasteful plan beat it)."""
    r = accepted.size
    total = int(accepted.sum())
    cap = r * (1 + gamma)
    sps = table.lookup_range(r, cap - r + 1)  # B = r .. cap
    best = np.maximum.accumulate(sps[::-1])[::-1]
    return 1.0 / best[: total + 1]


def oracle_budget(accepted: np.ndarray, table: SpsCostTable, gamma: int | None = None) -> int:
    """The one-step optimum: K in 0..Σaccepted maximising (R + K) · SPS*(R + K), smallest on ties."""
    r = accepted.size
    seconds = oracle_options(accepted, table, gamma if gamma is not None else int(accepted.max(initial=0)))
    return int(np.argmax((r + np.arange(seconds.size)) / seconds))


def _solve_oracle(steps: list[tuple[int, np.ndarray]]) -> tuple[float, float, float]:
    """Maximise Σ tokens / Σ seconds over one K per step (Dinkelbach's method: the ratio of sums,
    not the sum of per-step ratios, is what a replay reports). Returns (tokens, seconds, Σ K)."""
    lam = 0.0
    chosen = [0] * len(steps)
    for _ in range(100):
        chosen = [int(np.argmax(r + np.arange(sec.size) - lam * sec)) for r, sec in steps]
        tokens = sum(r + k for (r, _), k in zip(steps, chosen, strict=True))
        seconds = sum(sec[k] for (_, sec), k in zip(steps, chosen, strict=True))
        new = tokens / seconds
        if new <= lam * (1 + 1e-12):
            break
        lam = new
    tokens = sum(r + k for (r, _), k in zip(steps, chosen, strict=True))
    seconds = sum(sec[k] for (_, sec), k in zip(steps, chosen, strict=True))
    return float(tokens), float(seconds), float(sum(chosen))


def replay(
    requests: Sequence[dict[str, Any]],
    table: SpsCostTable,
    concurrency: int,
    gamma: int,
    threshold: float = 0.5,
    planners: Sequence[str] = ("off", "fixed", "threshold", "dspark", ONLINE),
) -> dict[str, dict[str, float]]:
    """Θ per planner (and the oracle) over the recorded rounds batched ``concurrency`` at a time.
    ``ONLINE`` is the dspark planner on the recorded confidences corrected online (as ``dspark
    serve`` plans): each step by the maps fit on the positions earlier steps verified."""
    made = {
        name: make_planner(
            PlannerConfig(mode="dspark" if name == ONLINE else name, gamma=gamma, threshold=threshold), table
        )
        for name in planners
    }
    online = OnlineCalibration(gamma, (0.0,), OnlineCalibrationConfig(min_refit_interval_s=0.0))
    acc = {name: _Acc() for name in planners}
    rounds = [
        (np.asarray(r["confidences"], dtype=np.float32), np.asarray(r["accepted"], dtype=np.int64))
        for r in requests
    ]
    oracle_steps: list[tuple[int, np.ndarray]] = []
    waiting = deque(range(len(rounds)))
    active: list[list[int]] = []  # [request index, next round]
    while waiting or active:
        while len(active) < concurrency and waiting:
            active.append([waiting.popleft(), 0])
        conf = np.stack([rounds[i][0][k] for i, k in active])
        true = np.array([rounds[i][1][k] for i, k in active])
        n = len(active)
        for name, planner in made.items():
            if name == ONLINE:  # one regime: every recorded round has the run's temperature
                survival, regime = np.cumprod(conf.astype(np.float64), axis=1), np.zeros(n)
                lens = planner.plan_survival(online.correct(survival, regime)).verify_lens.numpy()
                online.record(survival, regime, true, lens)
            else:
                lens = planner.plan(torch.from_numpy(conf)).numpy()
            acc[name].add(
                float((np.minimum(true, lens) + 1).sum()),
                float(lens.sum()),
                n,
                table.lookup(n + int(lens.sum())),
            )
        oracle_steps.append((n, oracle_options(true, table, gamma)))
        for slot in active:
            slot[1] += 1
        active = [s for s in active if s[1] < len(rounds[s[0]][1])]
    out = {name: a.summary() for name, a in acc.items()}
    tokens, seconds, verified = _solve_oracle(oracle_steps)
    n_rounds = sum(r for r, _ in oracle_steps)
    out["oracle"] = {
        "throughput": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
        "steps": len(oracle_steps),
        "mean_verify_len": verified / n_rounds,
        "tokens_per_round": tokens / n_rounds,
    }
    best = out["oracle"]["throughput"]
    for v in out.values():
        v["ratio_to_oracle"] = v["throughput"] / best if best else float("nan")
    return out


# ---------------------------------------------------------------------------------------------
# Command


def resolve_table(profile: str | None, engine: Any | None) -> tuple[SpsCostTable, str]:
    if profile:
        return load_sps_table(profile), profile
    if engine is None:
        raise BenchError("replaying a --rounds-file needs --profile SPS.json")
    from dspark_server.engine.spec.setup import resolve_sps_table

    cfg = replace(engine.cfg, spec=replace(engine.cfg.spec, mode="dspark"))
    return resolve_sps_table(cfg, engine.runner), "profiles/ or the start-up cache (as `dspark serve`)"


def run_oracle(cfg: OracleConfig) -> dict[str, Any]:
    a, spec = cfg.suite, cfg.suite.engine.spec
    out_dir = Path(a.out)
    engine = None
    if cfg.rounds_file:
        recording = json.loads(Path(cfg.rounds_file).read_text())
    else:
        recording, engine = record_rounds(a, a.record_concurrency)
        write_json(out_dir / "rounds.json", recording)
    table, table_source = resolve_table(spec.profile_path, engine)
    lookup = "step (largest probe <= B)"
    if spec.price_step_overhead:  # plan and score on the curve dspark serve plans with
        table, lookup = fit_roofline(table), "roofline fitted to the probes (as dspark serve plans)"
    levels = list(cfg.concurrency)
    replays: list[dict[str, Any]] = []
    for c in levels:
        replays.append(
            {
                "concurrency": c,
                "planners": replay(recording["requests"], table, c, recording["gamma"], spec.threshold),
            }
        )
        if a.progress:
            ps = replays[-1]["planners"]
            ratios = ", ".join(f"{k} {v['ratio_to_oracle']:.3f}" for k, v in ps.items())
            print(f"concurrency {c:>3}: {ratios}", file=sys.stderr)
    n_rounds = sum(len(r["accepted"]) for r in recording["requests"])
    result = {
        "kind": "oracle",
        "machine": machine_info(),
        "config": {
            "command": a.command,
            "prompt_sets": recording["prompt_sets"],
            "model": recording.get("model"),
            "draft": recording.get("draft"),
            "sps_table": table_source,
            "sps_lookup": lookup,
            "threshold": spec.threshold,
            "concurrency": levels,
            "rounds_file": cfg.rounds_file or str(out_dir / "rounds.json"),
        },
        "recorded": {
            "requests": len(recording["requests"]),
            "rounds": n_rounds,
            "gamma": recording["gamma"],
            "mean_accepted": sum(sum(r["accepted"]) for r in recording["requests"]) / n_rounds,
        },
        "sps_table": table.to_dict(),
        "planners": list(replays[0]["planners"]),
        "replays": replays,
    }
    write_result(result, out_dir, "oracle", oracle_markdown, _plot, a.plots)
    return result


def _plot(result: dict[str, Any], path: Path) -> None:
    from dspark_server.bench.render import MODE_COLORS

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.8))
    xs = [r["concurrency"] for r in result["replays"]]
    for name in result["planners"]:
        axes[0].plot(
            xs,
            [r["planners"][name]["ratio_to_oracle"] for r in result["replays"]],
            marker="o",
            label=name,
            color=MODE_COLORS.get(name),
        )
        axes[1].plot(
            xs,
            [r["planners"][name]["mean_verify_len"] for r in result["replays"]],
            marker="o",
            label=name,
            color=MODE_COLORS.get(name),
        )
    axes[0].axhline(0.9, color="k", linestyle=":", linewidth=1)
    axes[0].set_ylabel("Θ / Θ(oracle)")
    axes[1].set_ylabel("mean verified drafts per request per step")
    for ax in axes:
        concurrency_axis(ax, 8)
    save_figure(fig, path)
