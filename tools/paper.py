"""The paper's figures, one command each (PNG + JSON + a markdown table in the output folder).

    # per-position acceptance, DSpark drafter vs a parallel-only drafter (`dspark train draft --head none`)
    python -m tools.paper --suite acceptance --drafts DSPARK_DIR,PARALLEL_DIR --labels dspark,parallel-only \\
        --prompts humaneval.jsonl,mt-bench.jsonl --out runs/bench/paper/acceptance
    # γ = 7 vs 15 (the second drafter trained with `dspark train draft --gamma 15`)
    python -m tools.paper --suite acceptance --drafts G7_DIR,G15_DIR --labels "γ=7,γ=15" ... --out .../gamma
    # fixed-threshold sweep: acceptance rate and tokens per step vs threshold, per domain
    python -m tools.paper --suite threshold-sweep --prompts humaneval.jsonl,mt-bench.jsonl,gsm8k.jsonl ...
    # ECE per position before / after STS (from the calibration JSON `dspark calibrate` wrote)
    python -m tools.paper --suite ece --calibration FILE.json
    # TPS and verification budget vs concurrency (from a serving sweep's results.json, or runs one)
    python -m tools.paper --suite concurrency --results runs/bench/serving/results.json
    # all of the above that the inputs allow
    python -m tools.paper --suite paper --prompts ... [--parallel-draft DIR] [--gamma-drafts G7,G15] \\
        [--results FILE]

Acceptance is measured as in `dspark eval acceptance`: full-γ verification, greedy, conditional
acceptance per position p_k = P(draft k accepted | 1..k−1 accepted) and τ (bonus included).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dspark_server.bench.common import (
    BenchError,
    SuiteConfig,
    load_prompt_sets,
    machine_info,
    split_list,
    write_json,
    write_result,
)
from dspark_server.bench.serving_config import ServingConfig
from dspark_server.config import EngineConfig, SpecMode
from tools.paper_plots import plot_acceptance, plot_concurrency, plot_ece, plot_thresholds
from tools.report import acceptance_markdown, ece_markdown, threshold_markdown

DEFAULT_THRESHOLDS = [round(0.05 * i, 2) for i in range(20)] + [0.97, 0.99]


@dataclass(frozen=True)
class PaperConfig:
    suite: SuiteConfig  # suite.engine: the target, the main drafter, --calibration for the ECE figure
    drafts: tuple[str, ...] = ()  # acceptance: drafters to compare (default: the main drafter)
    labels: tuple[str, ...] = ()
    thresholds: tuple[float, ...] = ()  # threshold sweep (default: DEFAULT_THRESHOLDS)
    parallel_draft: str | None = None  # paper: the parallel-only drafter
    gamma_drafts: tuple[str, ...] = ()  # paper: G7_DIR, G15_DIR
    results: tuple[str, ...] = ()  # concurrency: a serving sweep's results.json
    serving: ServingConfig | None = None  # concurrency without results: the sweep to run


def _engine(cfg: PaperConfig, draft: str | None, mode: SpecMode, running: int) -> Any:
    import torch

    from dspark_server.engine.engine import LLMEngine

    base = cfg.suite.engine
    if base.num_threads:
        torch.set_num_threads(base.num_threads)
    draft = draft or base.draft_dir
    if draft is None:
        raise BenchError("this figure needs a drafter (--draft DIR or --drafts DIRS)")
    spec = replace(base.spec, mode=mode)
    return LLMEngine(replace(base, draft_dir=draft, spec=spec, max_running=max(running, 1)))


def _generate_all(engine: Any, a: SuiteConfig, path: str) -> None:
    from dspark_server.offline import GenerateConfig, generate

    gen = GenerateConfig(
        prompts=path,
        limit=a.limit,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        seed=a.seed,
        concurrency=a.record_concurrency,
        progress=a.progress,
    )
    for _ in generate(engine, gen):
        pass


# ---------------------------------------------------------------------------------------------
# Per-position acceptance of several drafters


def run_acceptance(
    cfg: PaperConfig,
    out: str,
    drafts: Sequence[str] = (),
    labels: Sequence[str] = (),
    title: str = "Per-position acceptance",
) -> dict[str, Any]:
    from dspark_server.jobs.acceptance import AcceptanceRecorder

    a = cfg.suite
    drafts = list(drafts or cfg.drafts or [a.engine.draft_dir or _default_draft()])
    labels = list(labels or cfg.labels or [Path(d).name for d in drafts])
    if len(labels) != len(drafts):
        raise BenchError(f"--labels has {len(labels)} entries for {len(drafts)} --drafts")
    sets = load_prompt_sets(a.prompt_files, a.limit)
    results: dict[str, list[dict[str, Any]]] = {ps.name: [] for ps in sets}
    for draft, label in zip(drafts, labels, strict=True):
        engine = _engine(cfg, draft, "fixed", a.record_concurrency)
        for ps in sets:
            recorder = AcceptanceRecorder(engine.spec.gamma)
            engine.spec.round_observers[:] = [recorder]
            _generate_all(engine, a, ps.path)
            results[ps.name].append({"label": label, "draft": draft, **recorder.summary()})
        del engine
    result = {
        "kind": "acceptance",
        "title": title,
        "machine": machine_info(),
        "config": {
            "command": a.command,
            "drafts": drafts,
            "labels": labels,
            "prompt_sets": {ps.name: ps.path for ps in sets},
            "limit": a.limit,
            "max_tokens": a.max_tokens,
            "temperature": a.temperature,
        },
        "results": results,
    }
    write_result(result, Path(out), "acceptance", acceptance_markdown, plot_acceptance, a.plots)
    return result


# ---------------------------------------------------------------------------------------------
# Fixed-threshold sweep


def threshold_rows(requests: list[dict[str, Any]], thresholds: list[float]) -> list[dict[str, float]]:
    """Per threshold t: ℓ = #{j : a(j) ≥ t} on each recorded full-γ round (a = prefix survival of
    the calibrated confidences, the threshold planner's rule), then acceptance rate (accepted /
    verified drafts), tokens per step (min(ℓ, accepted) + 1 per request) and mean ℓ."""
    import numpy as np

    conf = np.concatenate([np.asarray(r["confidences"], dtype=np.float64) for r in requests])
    true = np.concatenate([np.asarray(r["accepted"], dtype=np.int64) for r in requests])
    surv = np.cumprod(np.clip(conf, 0.0, 1.0), axis=1)
    rows = []
    for t in thresholds:
        lens = (surv >= t).sum(axis=1)
        accepted = np.minimum(lens, true)
        verified = int(lens.sum())
        rate = float(accepted.sum() / verified) if verified else math.nan
        rows.append(
            {
                "threshold": t,
                "acceptance_rate": rate,
                "tokens_per_step": float((accepted + 1).mean()),
                "mean_verify_len": float(lens.mean()),
                "rounds": int(lens.size),
            }
        )
    return rows


def run_threshold(cfg: PaperConfig, out: str, draft: str | None = None) -> dict[str, Any]:
    from dspark_server.bench.oracle import RoundLog

    a = cfg.suite
    thresholds = list(cfg.thresholds) or DEFAULT_THRESHOLDS
    sets = load_prompt_sets(a.prompt_files, a.limit)
    engine = _engine(cfg, draft, "fixed", a.record_concurrency)
    logger = RoundLog(engine.spec.gamma)
    engine.spec.round_observers[:] = [logger]
    domains = {}
    for ps in sets:
        logger.prompt_set = ps.name
        _generate_all(engine, a, ps.path)
        reqs = [r for r in logger.requests.values() if r["prompt_set"] == ps.name and r["accepted"]]
        if not reqs:
            raise BenchError(f"no full-γ rounds recorded on {ps.name}")
        domains[ps.name] = threshold_rows(reqs, thresholds)
    result = {
        "kind": "threshold_sweep",
        "machine": machine_info(),
        "config": {
            "command": a.command,
            "draft": engine.cfg.draft_dir,
            "gamma": engine.spec.gamma,
            "prompt_sets": {ps.name: ps.path for ps in sets},
            "limit": a.limit,
            "max_tokens": a.max_tokens,
            "thresholds": thresholds,
        },
        "domains": domains,
    }
    write_result(result, Path(out), "threshold_sweep", threshold_markdown, plot_thresholds, a.plots)
    return result


# ---------------------------------------------------------------------------------------------
# ECE before / after STS


def _default_draft() -> str:
    from dspark_server.assets import default_draft

    d = default_draft()
    if d is None:
        raise BenchError("no drafter: pass --draft DIR (the bundled demo drafter is not built yet)")
    return d


def find_calibration(engine: EngineConfig) -> Path:
    from dspark_server.assets import DEMO_CALIBRATION
    from dspark_server.engine.spec.setup import CALIBRATION_FILE

    calibration = engine.spec.calibration_path
    candidates = [Path(calibration)] if calibration else []
    if engine.draft_dir:
        candidates.append(Path(engine.draft_dir) / CALIBRATION_FILE)
    from dspark_server.assets import DEMO_DRAFT

    candidates += [DEMO_DRAFT / CALIBRATION_FILE, DEMO_CALIBRATION]
    for c in candidates:
        if c.is_file():
            return c
    raise BenchError(
        "no calibration JSON: pass --calibration FILE (written by `dspark calibrate`); "
        f"looked in {', '.join(map(str, candidates))}"
    )


def run_ece(cfg: PaperConfig, out: str) -> dict[str, Any]:
    from dspark_server.planner import load_sts_calibration

    path = find_calibration(cfg.suite.engine)
    load_sts_calibration(path)  # validates
    raw = json.loads(path.read_text())
    if not raw.get("ece_before") or not raw.get("ece_after"):
        raise BenchError(f"{path} has no ece_before / ece_after (not written by `dspark calibrate`?)")
    result = {
        "kind": "ece",
        "machine": machine_info(),
        "calibration": str(path),
        "config": {"command": cfg.suite.command},
        "dataset": raw.get("dataset"),
        "num_samples": raw.get("num_samples"),
        "temperatures": raw["temperatures"],
        "ece_before": raw["ece_before"],
        "ece_after": raw["ece_after"],
        "max_ece_after": max(raw["ece_after"]),
        "goal_max_ece_after": 0.02,
    }
    write_result(result, Path(out), "ece", ece_markdown, plot_ece, cfg.suite.plots)
    return result


# ---------------------------------------------------------------------------------------------
# TPS and verification budget vs concurrency


def run_concurrency(cfg: PaperConfig, out: str) -> dict[str, Any]:
    from dspark_server.bench.serving import run_serving

    out_dir = Path(out)
    if cfg.results:
        serving = json.loads(Path(cfg.results[0]).read_text())
        source = cfg.results[0]
    elif cfg.serving is None:
        raise BenchError("pass --results SERVING/results.json or --prompts (runs a serving sweep)")
    else:
        serving = run_serving(replace(cfg.serving, out=str(out_dir / "serving")))
        source = str(out_dir / "serving" / "results.json")
    keys = (
        "output_tokens_per_s",
        "mean_verify_budget_per_step",
        "mean_verified_drafts_per_request_step",
        "mean_acceptance_length",
        "speedup_vs_off",
        "speedup_vs_fixed",
    )
    series = [
        {
            "prompt_set": r["prompt_set"],
            "mode": r["mode"],
            "concurrency": r["concurrency"],
            **{k: r.get(k) for k in keys},
        }
        for r in serving["runs"]
    ]
    result = {
        "kind": "concurrency",
        "machine": serving["machine"],
        "source": source,
        "config": {"command": serving["config"].get("command")},
        "series": series,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "concurrency.json", result)
    from dspark_server.bench.render import serving_markdown

    (out_dir / "concurrency.md").write_text(
        serving_markdown(serving, title="TPS and verification budget vs concurrency")
    )
    if cfg.suite.plots:
        plot_concurrency(serving, out_dir / "concurrency.png")
    print(f"wrote {out_dir / 'concurrency.png'}", file=sys.stderr)
    return result


# ---------------------------------------------------------------------------------------------
# Everything


def run_paper(cfg: PaperConfig, out: str) -> dict[str, Any]:
    """Each figure whose inputs exist, in its own folder; the rest listed with the reason."""
    from dspark_server.assets import DEMO_DIR

    out_dir = Path(out)
    prompt_files = cfg.suite.prompt_files
    done: dict[str, str] = {}
    skipped: dict[str, str] = {}
    main_draft = cfg.suite.engine.draft_dir
    if main_draft is None:
        try:
            main_draft = _default_draft()
        except BenchError as exc:
            skipped["drafter figures"] = str(exc)

    def attempt(name: str, fn: Any) -> None:
        print(f"== {name}", file=sys.stderr)
        try:
            fn()
            done[name] = str(out_dir / name)
        except BenchError as exc:
            skipped[name] = str(exc)
            print(f"   skipped: {exc}", file=sys.stderr)

    parallel = cfg.parallel_draft or (
        str(DEMO_DIR / "draft_none") if (DEMO_DIR / "draft_none" / "config.json").is_file() else None
    )
    if main_draft and prompt_files:
        if parallel:
            attempt(
                "acceptance",
                lambda: run_acceptance(
                    cfg,
                    str(out_dir / "acceptance"),
                    [main_draft, parallel],
                    ["dspark", "parallel-only"],
                    "Per-position acceptance: DSpark vs parallel-only drafter",
                ),
            )
        else:
            skipped["acceptance"] = (
                "no parallel-only drafter: pass --parallel-draft DIR (train one with "
                "`dspark train draft --head none --out DIR`)"
            )
        gamma_drafts = cfg.gamma_drafts
        if len(gamma_drafts) == 2:
            attempt(
                "gamma",
                lambda: run_acceptance(
                    cfg, str(out_dir / "gamma"), gamma_drafts, ["γ=7", "γ=15"], "γ = 7 vs γ = 15"
                ),
            )
        else:
            skipped["gamma"] = (
                "pass --gamma-drafts G7_DIR,G15_DIR (train the second with "
                "`dspark train draft --gamma 15 --out G15_DIR`)"
            )
        attempt(
            "threshold_sweep",
            lambda: run_threshold(cfg, str(out_dir / "threshold_sweep"), main_draft),
        )
    elif not prompt_files:
        skipped["acceptance, gamma, threshold_sweep"] = "no --prompts given"
    attempt("ece", lambda: run_ece(cfg, str(out_dir / "ece")))
    if cfg.results or (prompt_files and main_draft):
        attempt("concurrency", lambda: run_concurrency(cfg, str(out_dir / "concurrency")))
    else:
        skipped["concurrency"] = "pass --results SERVING/results.json or --prompts (runs a serving sweep)"
    index = {
        "kind": "paper_index",
        "machine": machine_info(),
        "command": cfg.suite.command,
        "figures": done,
        "skipped": skipped,
    }
    write_json(out_dir / "index.json", index)
    for k, v in skipped.items():
        print(f"skipped {k}: {v}", file=sys.stderr)
    return index


PAPER_SUITES = ("paper", "acceptance", "threshold-sweep", "ece", "concurrency")


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.paper --suite SUITE ...`` (every `dspark bench` flag applies too)."""
    from dspark_server.bench.main import bench_parser, serving_config, suite_config

    p = bench_parser("python -m tools.paper", PAPER_SUITES)
    p.description = __doc__.split("\n\n")[0]
    g = p.add_argument_group("paper figures")
    g.add_argument("--drafts", default=None, help="acceptance: comma-separated drafter directories")
    g.add_argument("--labels", default=None, help="acceptance: comma-separated labels for --drafts")
    g.add_argument("--parallel-draft", default=None, help="paper: parallel-only drafter to compare with")
    g.add_argument("--gamma-drafts", default=None, help="paper: two drafters 'G7_DIR,G15_DIR'")
    g.add_argument("--thresholds", default=None, help="threshold-sweep: comma-separated cut-offs")
    g.add_argument("--results", action="append", default=None, help="concurrency: serving results.json")
    a = p.parse_args(argv)
    a.argv = ["python", "-m", "tools.paper", *(sys.argv[1:] if argv is None else argv)]
    name = {"threshold-sweep": "threshold_sweep"}.get(a.suite, a.suite)
    try:
        cfg = PaperConfig(
            suite=suite_config(a, f"paper/{name}", prompts=bool(a.prompts)),
            drafts=tuple(split_list(a.drafts)),
            labels=tuple(split_list(a.labels)),
            thresholds=tuple(float(x) for x in split_list(a.thresholds)),
            parallel_draft=a.parallel_draft,
            gamma_drafts=tuple(split_list(a.gamma_drafts)),
            results=tuple(f for item in (a.results or []) for f in split_list(item)),
            serving=serving_config(a) if a.prompts else None,
        )
        run = {
            "paper": run_paper,
            "acceptance": run_acceptance,
            "threshold-sweep": run_threshold,
            "ece": run_ece,
            "concurrency": run_concurrency,
        }[a.suite]
        run(cfg, cfg.suite.out)
    except BenchError as exc:
        print(f"tools.paper: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
