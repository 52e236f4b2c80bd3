"""The paper's figures, one command each (PNG + JSON + a markdown table in the output folder).

    # per-position acceptance, DSpark drafter vs a parallel-only drafter (`dspark train draft --head none`)
    dspark bench --suite acceptance --drafts DSPARK_DIR,PARALLEL_DIR --labels dspark,parallel-only \\
        --prompts humaneval.jsonl,mt-bench.jsonl --out runs/bench/paper/acceptance
    # γ = 7 vs 15 (the second drafter trained with `dspark train draft --gamma 15`)
    dspark bench --suite acceptance --drafts G7_DIR,G15_DIR --labels "γ=7,γ=15" ... --out .../gamma
    # fixed-threshold sweep: acceptance rate and tokens per step vs threshold, per domain
    dspark bench --suite threshold-sweep --prompts humaneval.jsonl,mt-bench.jsonl,gsm8k.jsonl ...
    # ECE per position before / after STS (from the calibration JSON `dspark calibrate` wrote)
    dspark bench --suite ece --calibration FILE.json
    # TPS and verification budget vs concurrency (from a serving sweep's results.json, or runs one)
    dspark bench --suite concurrency --results runs/bench/serving/results.json
    # all of the above that the inputs allow
    dspark bench --suite paper --prompts ... [--parallel-draft DIR] [--gamma-drafts G7,G15] [--results FILE]

Acceptance is measured as in `dspark eval acceptance`: full-γ verification, greedy, conditional
acceptance per position p_k = P(draft k accepted | 1..k−1 accepted) and τ (bonus included).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from dspark_server.bench.common import (
    BenchError,
    command_line,
    concurrency_axis,
    load_prompt_sets,
    machine_info,
    pyplot,
    save_figure,
    split_list,
    write_json,
    write_result,
)

DEFAULT_THRESHOLDS = [round(0.05 * i, 2) for i in range(20)] + [0.97, 0.99]


def _engine(a: argparse.Namespace, draft: str | None, mode: str, running: int) -> Any:
    import torch

    from dspark_server.cli import _engine_config
    from dspark_server.engine.engine import LLMEngine

    if a.threads:
        torch.set_num_threads(a.threads)
    base = _engine_config(argparse.Namespace(**{**vars(a), "draft": draft or a.draft, "spec_mode": None}))
    if base.draft_dir is None:
        raise BenchError("this figure needs a drafter (--draft DIR or --drafts DIRS)")
    return LLMEngine(replace(base, spec=replace(base.spec, mode=mode), max_running=max(running, 1)))


def _generate_all(engine: Any, a: argparse.Namespace, path: str) -> None:
    from dspark_server.offline import GenerateConfig, generate

    gen = GenerateConfig(
        prompts=path,
        limit=a.limit,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        seed=a.seed,
        concurrency=a.record_concurrency,
        progress=not a.quiet,
    )
    for _ in generate(engine, gen):
        pass


# ---------------------------------------------------------------------------------------------
# Per-position acceptance of several drafters


def run_acceptance_command(
    a: argparse.Namespace,
    prompt_files: list[str],
    out: str,
    drafts: list[str] | None = None,
    labels: list[str] | None = None,
    title: str = "Per-position acceptance",
) -> dict[str, Any]:
    from dspark_server.jobs.acceptance import AcceptanceRecorder

    drafts = drafts or split_list(a.drafts) or [a.draft or _default_draft()]
    labels = labels or split_list(a.labels) or [Path(d).name for d in drafts]
    if len(labels) != len(drafts):
        raise BenchError(f"--labels has {len(labels)} entries for {len(drafts)} --drafts")
    sets = load_prompt_sets(prompt_files, a.limit)
    results: dict[str, list[dict[str, Any]]] = {ps.name: [] for ps in sets}
    for draft, label in zip(drafts, labels, strict=True):
        engine = _engine(a, draft, "fixed", a.record_concurrency)
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
            "command": command_line(getattr(a, "argv", None)),
            "drafts": drafts,
            "labels": labels,
            "prompt_sets": {ps.name: ps.path for ps in sets},
            "limit": a.limit,
            "max_tokens": a.max_tokens,
            "temperature": a.temperature,
        },
        "results": results,
    }
    write_result(result, Path(out), "acceptance", _plot_acceptance, a.no_plots)
    return result


def _plot_acceptance(result: dict[str, Any], path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    sets = list(result["results"])
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 3.8), squeeze=False)
    for ax, ps in zip(axes[0], sets, strict=True):
        for e in result["results"][ps]:
            ks = list(range(1, e["gamma"] + 1))
            ax.plot(
                ks,
                e["per_position_conditional_acceptance"],
                marker="o",
                label=f"{e['label']} (τ = {e['mean_acceptance_length']:.2f})",
            )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accept k | accepted k−1)")
        ax.set_ylim(0, 1.02)
        ax.set_title(ps)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


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


def run_threshold_command(a: argparse.Namespace, prompt_files: list[str], out: str) -> dict[str, Any]:
    from dspark_server.bench.oracle import RoundLog

    thresholds = [float(x) for x in split_list(a.thresholds)] or DEFAULT_THRESHOLDS
    sets = load_prompt_sets(prompt_files, a.limit)
    engine = _engine(a, None, "fixed", a.record_concurrency)
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
            "command": command_line(getattr(a, "argv", None)),
            "draft": engine.cfg.draft_dir,
            "gamma": engine.spec.gamma,
            "prompt_sets": {ps.name: ps.path for ps in sets},
            "limit": a.limit,
            "max_tokens": a.max_tokens,
            "thresholds": thresholds,
        },
        "domains": domains,
    }
    write_result(result, Path(out), "threshold_sweep", _plot_thresholds, a.no_plots)
    return result


def _plot_thresholds(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.8))
    for ps, rows in result["domains"].items():
        ts = [r["threshold"] for r in rows]
        axes[0].plot(ts, [r["acceptance_rate"] for r in rows], marker=".", label=ps)
        axes[1].plot(ts, [r["tokens_per_step"] for r in rows], marker=".", label=ps)
    axes[0].set_ylabel("acceptance rate (accepted / verified)")
    axes[1].set_ylabel("tokens per request per step")
    for ax in axes:
        ax.set_xlabel("threshold on calibrated prefix survival")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------
# ECE before / after STS


def _default_draft() -> str:
    from dspark_server.assets import default_draft

    d = default_draft()
    if d is None:
        raise BenchError("no drafter: pass --draft DIR (the bundled demo drafter is not built yet)")
    return d


def find_calibration(a: argparse.Namespace) -> Path:
    from dspark_server.assets import DEMO_CALIBRATION
    from dspark_server.engine.spec_setup import CALIBRATION_FILE

    candidates = [Path(a.calibration)] if a.calibration else []
    if a.draft:
        candidates.append(Path(a.draft) / CALIBRATION_FILE)
    from dspark_server.assets import DEMO_DRAFT

    candidates += [DEMO_DRAFT / CALIBRATION_FILE, DEMO_CALIBRATION]
    for c in candidates:
        if c.is_file():
            return c
    raise BenchError(
        "no calibration JSON: pass --calibration FILE (written by `dspark calibrate`); "
        f"looked in {', '.join(map(str, candidates))}"
    )


def run_ece_command(a: argparse.Namespace, out: str) -> dict[str, Any]:
    from dspark_server.planner import load_sts_calibration

    path = find_calibration(a)
    load_sts_calibration(path)  # validates
    raw = json.loads(path.read_text())
    if not raw.get("ece_before") or not raw.get("ece_after"):
        raise BenchError(f"{path} has no ece_before / ece_after (not written by `dspark calibrate`?)")
    result = {
        "kind": "ece",
        "machine": machine_info(),
        "calibration": str(path),
        "config": {"command": command_line(getattr(a, "argv", None))},
        "dataset": raw.get("dataset"),
        "num_samples": raw.get("num_samples"),
        "temperatures": raw["temperatures"],
        "ece_before": raw["ece_before"],
        "ece_after": raw["ece_after"],
        "max_ece_after": max(raw["ece_after"]),
        "goal_max_ece_after": 0.02,
    }
    write_result(result, Path(out), "ece", _plot_ece, a.no_plots)
    return result


def _plot_ece(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    before, after = result["ece_before"], result["ece_after"]
    ks = list(range(1, len(before) + 1))
    fig, ax = plt.subplots(figsize=(1.5 + 0.6 * len(ks), 3.6))
    ax.bar([k - 0.2 for k in ks], [100 * x for x in before], 0.4, label="before STS", color="tab:gray")
    ax.bar([k + 0.2 for k in ks], [100 * x for x in after], 0.4, label="after STS", color="tab:red")
    ax.axhline(2.0, color="k", linestyle=":", linewidth=1)
    ax.set_xticks(ks)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("ECE of prefix survival (%)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------
# TPS and verification budget vs concurrency


def run_concurrency_command(a: argparse.Namespace, out: str) -> dict[str, Any]:
    from dspark_server.bench.main import serving_config
    from dspark_server.bench.serving import run_serving

    files = [f for item in (a.results or []) for f in split_list(item)]
    out_dir = Path(out)
    if files:
        serving = json.loads(Path(files[0]).read_text())
        source = files[0]
    else:
        serving = run_serving(serving_config(a, out=str(out_dir / "serving")))
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
    from dspark_server.bench.report import serving_markdown

    (out_dir / "concurrency.md").write_text(
        serving_markdown(serving, title="TPS and verification budget vs concurrency")
    )
    if not a.no_plots:
        _plot_concurrency(serving, out_dir / "concurrency.png")
    print(f"wrote {out_dir / 'concurrency.png'}", file=sys.stderr)
    return result


def _plot_concurrency(serving: dict[str, Any], path: Path) -> None:
    from dspark_server.bench.report import MODE_COLORS, _mode_key

    plt = pyplot()
    runs = serving["runs"]
    sets = list(dict.fromkeys(r["prompt_set"] for r in runs))
    modes = sorted(dict.fromkeys(r["mode"] for r in runs), key=_mode_key)
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.8))
    for j, ps in enumerate(sets):
        for mode in modes:
            rows = sorted(
                (r for r in runs if r["prompt_set"] == ps and r["mode"] == mode),
                key=lambda r: r["concurrency"],
            )
            xs = [r["concurrency"] for r in rows]
            label = mode if len(sets) == 1 else f"{mode} ({ps})"
            axes[0].plot(
                xs,
                [r["output_tokens_per_s"] for r in rows],
                marker="o",
                linestyle=styles[j % 4],
                color=MODE_COLORS.get(mode),
                label=label,
            )
            if mode != "off":
                axes[1].plot(
                    xs,
                    [r["mean_verify_budget_per_step"] for r in rows],
                    marker="o",
                    linestyle=styles[j % 4],
                    color=MODE_COLORS.get(mode),
                    label=label,
                )
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("verification budget per step (Σℓ)")
    for ax in axes:
        concurrency_axis(ax, 7)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------
# Everything


def run_paper_suite(a: argparse.Namespace, out: str) -> dict[str, Any]:
    """Each figure whose inputs exist, in its own folder; the rest listed with the reason."""
    from dspark_server.assets import DEMO_DIR

    out_dir = Path(out)
    prompt_files = [f for item in (a.prompts or []) for f in split_list(item)]
    done: dict[str, str] = {}
    skipped: dict[str, str] = {}
    main_draft = a.draft
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

    parallel = a.parallel_draft or (
        str(DEMO_DIR / "draft_none") if (DEMO_DIR / "draft_none" / "config.json").is_file() else None
    )
    if main_draft and prompt_files:
        if parallel:
            attempt(
                "acceptance",
                lambda: run_acceptance_command(
                    a,
                    prompt_files,
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
        gamma_drafts = split_list(a.gamma_drafts)
        if len(gamma_drafts) == 2:
            attempt(
                "gamma",
                lambda: run_acceptance_command(
                    a, prompt_files, str(out_dir / "gamma"), gamma_drafts, ["γ=7", "γ=15"], "γ = 7 vs γ = 15"
                ),
            )
        else:
            skipped["gamma"] = (
                "pass --gamma-drafts G7_DIR,G15_DIR (train the second with "
                "`dspark train draft --gamma 15 --out G15_DIR`)"
            )
        attempt(
            "threshold_sweep",
            lambda: run_threshold_command(
                argparse.Namespace(**{**vars(a), "draft": main_draft}),
                prompt_files,
                str(out_dir / "threshold_sweep"),
            ),
        )
    elif not prompt_files:
        skipped["acceptance, gamma, threshold_sweep"] = "no --prompts given"
    attempt("ece", lambda: run_ece_command(a, str(out_dir / "ece")))
    if a.results or (prompt_files and main_draft):
        attempt("concurrency", lambda: run_concurrency_command(a, str(out_dir / "concurrency")))
    else:
        skipped["concurrency"] = "pass --results SERVING/results.json or --prompts (runs a serving sweep)"
    index = {
        "kind": "paper_index",
        "machine": machine_info(),
        "command": command_line(getattr(a, "argv", None)),
        "figures": done,
        "skipped": skipped,
    }
    write_json(out_dir / "index.json", index)
    for k, v in skipped.items():
        print(f"skipped {k}: {v}", file=sys.stderr)
    return index
