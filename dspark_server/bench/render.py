"""Markdown tables and plots of the `dspark bench` suites' results (serving sweep, peers, oracle):
what a suite prints and writes beside its JSON. Every table carries the machine it ran on and the
exact command that produced it. (The docs page is assembled by tools/report.py.)"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark_server.bench.common import concurrency_axis, pyplot, save_figure


def fmt(x: Any, digits: int = 2, scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, int) and scale == 1.0:
        return str(x)
    return f"{x * scale:.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def machine_line(machine: dict[str, Any]) -> str:
    parts = [f"{machine.get('cpu', '?')}", f"{machine.get('cores', '?')} cores"]
    if machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']} GiB RAM")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    if machine.get("git_commit"):
        parts.append(f"commit {machine['git_commit']}")
    if machine.get("load_average_1m") is not None:
        parts.append(f"load {machine['load_average_1m']} at start")
    return "Machine: " + ", ".join(parts) + "."


MODE_ORDER = ("off", "fixed", "threshold", "dspark", "dspark_budget")
MODE_COLORS = {
    "off": "tab:gray",
    "fixed": "tab:blue",
    "threshold": "tab:orange",
    "dspark": "tab:red",
    "dspark_budget": "tab:purple",
    "dspark+online": "tab:green",
    "oracle": "black",
}


def mode_key(mode: str) -> tuple[int, str]:
    return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), mode)


# ---------------------------------------------------------------------------------------------
# Serving sweep


def serving_goals(result: dict[str, Any]) -> list[str]:
    """Issue D's goals, per prompt set, where the sweep has the runs to judge them."""
    lines = []
    runs = result["runs"]
    for ps in dict.fromkeys(r["prompt_set"] for r in runs):

        def row(mode: str, c: int, ps: str = ps) -> dict[str, Any] | None:
            return next(
                (r for r in runs if r["prompt_set"] == ps and r["mode"] == mode and r["concurrency"] == c),
                None,
            )

        levels = sorted({r["concurrency"] for r in runs if r["prompt_set"] == ps})
        checks = [(1, "off", 2.0), (64, "off", 1.1), (64, "fixed", 1.15)]
        for c, base, goal in checks:
            ours, ref = row("dspark", c), row(base, c)
            if ours and ref and ref["output_tokens_per_s"]:
                ratio = ours["output_tokens_per_s"] / ref["output_tokens_per_s"]
                lines.append(
                    f"{ps}: dspark / {base} at concurrency {c} = {ratio:.2f}× (goal ≥ {goal}×: "
                    f"{'met' if ratio >= goal else 'missed'})"
                )
        spec = [row("dspark", c) for c in levels]
        vals = [r["mean_verified_drafts_per_request_step"] for r in spec if r]
        if len(vals) >= 2:
            shrinking = all(b <= a + 1e-9 for a, b in zip(vals, vals[1:], strict=False))
            lines.append(
                f"{ps}: dspark verified drafts per request per step "
                f"{' → '.join(f'{v:.2f}' for v in vals)} over concurrency "
                f"{', '.join(map(str, levels))} ({'shrinking' if shrinking else 'not monotone'})"
            )
    return lines


def serving_markdown(result: dict[str, Any], title: str = "Serving sweep") -> str:
    cfg = result["config"]
    out = [
        f"## {title}",
        "",
        machine_line(result["machine"]),
        "",
        f"Command: `{cfg.get('command') or 'dspark bench'}`",
        "",
        f"{cfg['max_tokens']} max output tokens, temperature {cfg['temperature']}, "
        + (
            f"Poisson arrivals at {cfg['request_rate']} req/s, "
            if cfg.get("request_rate")
            else "closed loop, "
        )
        + f"{cfg['rounds']} interleaved round(s), median output tokens/s over rounds; "
        "τ = tokens emitted per speculative round (mean acceptance length, bonus included); "
        "verified = draft tokens verified per request per step; budget = Σℓ per step.",
        "",
    ]
    header = [
        "mode",
        "conc.",
        "output tok/s",
        "× off",
        "× fixed",
        "req/s",
        "τ",
        "verified / req / step",
        "budget / step",
        "TTFT p50 (s)",
        "TPOT p50 (ms)",
        "ITL p50 (ms)",
        "e2e p50 (s)",
        "e2e p99 (s)",
        "errors",
    ]
    for ps in dict.fromkeys(r["prompt_set"] for r in result["runs"]):
        rows = sorted(
            (r for r in result["runs"] if r["prompt_set"] == ps),
            key=lambda r: (r["concurrency"], mode_key(r["mode"])),
        )
        n = cfg.get("prompts_per_set", {}).get(ps)
        out += [f"### {ps}" + (f" ({n} prompts)" if n else ""), ""]
        out.append(
            table(
                header,
                [
                    [
                        r["mode"],
                        str(r["concurrency"]),
                        fmt(r["output_tokens_per_s"], 1),
                        fmt(r.get("speedup_vs_off")),
                        fmt(r.get("speedup_vs_fixed")),
                        fmt(r["requests_per_s"], 3),
                        fmt(r["mean_acceptance_length"]),
                        fmt(r["mean_verified_drafts_per_request_step"]),
                        fmt(r["mean_verify_budget_per_step"], 1),
                        fmt(r["ttft_p50_s"], 3),
                        fmt(r["tpot_p50_s"], 1, 1e3),
                        fmt(r["itl_p50_s"], 1, 1e3),
                        fmt(r["e2e_p50_s"], 2),
                        fmt(r["e2e_p99_s"], 2),
                        str(r["errors"]),
                    ]
                    for r in rows
                ],
            )
        )
        out.append("")
    goals = serving_goals(result)
    if goals:
        out += ["Goals (issue D):", ""] + [f"- {g}" for g in goals] + [""]
    return "\n".join(out)


def plot_serving(result: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = pyplot()
    runs = result["runs"]
    sets = list(dict.fromkeys(r["prompt_set"] for r in runs))
    modes = sorted(dict.fromkeys(r["mode"] for r in runs), key=mode_key)
    styles = ["-", "--", ":", "-."]
    paths = []

    def series(ps: str, mode: str, key: str) -> tuple[list[int], list[float]]:
        rows = sorted(
            (r for r in runs if r["prompt_set"] == ps and r["mode"] == mode), key=lambda r: r["concurrency"]
        )
        return [r["concurrency"] for r in rows], [r[key] if r[key] is not None else math.nan for r in rows]

    # TPS vs concurrency, one panel per prompt set.
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 3.8), squeeze=False)
    for ax, ps in zip(axes[0], sets, strict=True):
        for mode in modes:
            xs, ys = series(ps, mode, "output_tokens_per_s")
            ax.plot(xs, ys, marker="o", label=mode, color=MODE_COLORS.get(mode))
        concurrency_axis(ax, 8)
        ax.set_ylabel("output tokens/s")
        ax.set_title(ps)
    paths.append(save_figure(fig, out_dir / "tps_vs_concurrency.png"))

    # Verification: per request and per step.
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.8))
    for mode in modes:
        if mode == "off":
            continue
        for j, ps in enumerate(sets):
            label = mode if len(sets) == 1 else f"{mode} ({ps})"
            for ax, key in zip(
                axes, ("mean_verified_drafts_per_request_step", "mean_verify_budget_per_step"), strict=True
            ):
                xs, ys = series(ps, mode, key)
                ax.plot(
                    xs,
                    ys,
                    marker="o",
                    linestyle=styles[j % len(styles)],
                    label=label,
                    color=MODE_COLORS.get(mode),
                )
    for ax, ylabel in zip(
        axes, ("verified drafts per request per step", "verification budget per step (Σℓ)"), strict=True
    ):
        concurrency_axis(ax, 7)
        ax.set_ylabel(ylabel)
    paths.append(save_figure(fig, out_dir / "verified_drafts_vs_concurrency.png"))

    # Latency.
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.8))
    for mode in modes:
        for j, ps in enumerate(sets):
            label = mode if len(sets) == 1 else f"{mode} ({ps})"
            for ax, key in zip(axes, ("tpot_p50_s", "ttft_p50_s"), strict=True):
                xs, ys = series(ps, mode, key)
                ax.plot(
                    xs,
                    [y * 1e3 for y in ys],
                    marker="o",
                    linestyle=styles[j % len(styles)],
                    label=label,
                    color=MODE_COLORS.get(mode),
                )
    for ax, ylabel in zip(axes, ("TPOT p50 (ms)", "TTFT p50 (ms)"), strict=True):
        concurrency_axis(ax, 7)
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
    paths.append(save_figure(fig, out_dir / "latency_vs_concurrency.png"))

    # τ per prompt set (at the lowest concurrency, where no planner is squeezed by load).
    if len(sets) > 1:
        spec_modes = [m for m in modes if m != "off"]
        c0 = min(r["concurrency"] for r in runs)
        fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(sets) * max(1, len(spec_modes)) / 2, 3.6))
        width = 0.8 / max(1, len(spec_modes))
        for k, mode in enumerate(spec_modes):
            ys = [
                next(
                    (
                        r["mean_acceptance_length"]
                        for r in runs
                        if r["prompt_set"] == ps and r["mode"] == mode and r["concurrency"] == c0
                    ),
                    math.nan,
                )
                for ps in sets
            ]
            ax.bar(
                [i + k * width for i in range(len(sets))], ys, width, label=mode, color=MODE_COLORS.get(mode)
            )
        ax.set_xticks([i + width * (len(spec_modes) - 1) / 2 for i in range(len(sets))], sets)
        ax.set_ylabel(f"τ (tokens per round), concurrency {c0}")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir / "tau_per_prompt_set.png"))
    return paths


# ---------------------------------------------------------------------------------------------
# Other suites


def peers_markdown(result: dict[str, Any]) -> str:
    out = [
        "## Peer comparison (concurrency 1)",
        "",
        machine_line(result["machine"]),
        "",
        f"Command: `{result['config'].get('command', '')}`",
        "",
        f"{result['config']['num_prompts']} prompts × {result['config']['rounds']} round(s), "
        f"{result['config']['max_tokens']} max new tokens, greedy; each system runs every prompt in turn "
        "(interleaved), tokens counted from token ids.",
        "",
    ]
    rows = [
        [s["system"], s["description"], fmt(s["tokens_per_s"], 1), str(s["tokens"]), fmt(s["seconds"], 1)]
        for s in result["systems"]
    ]
    out.append(table(["system", "what", "tokens/s", "tokens", "seconds"], rows))
    out.append("")
    if result.get("ratios"):
        out += ["Ratios (ours / theirs):", ""]
        out += [f"- {k}: {fmt(v)}×" for k, v in result["ratios"].items()]
        out.append("")
    for note in result.get("notes", []):
        out.append(f"Note: {note}")
    return "\n".join(out) + "\n"


def oracle_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    out = [
        "## Oracle replay",
        "",
        machine_line(result["machine"]),
        "",
        f"Command: `{cfg.get('command', '')}`",
        "",
        f"{result['recorded']['requests']} requests, {result['recorded']['rounds']} full-γ rounds "
        f"(γ = {result['recorded']['gamma']}) recorded on {', '.join(cfg['prompt_sets'])}; replayed "
        "through each planner with the same SPS table; Θ = realised tokens per second under the SPS "
        "cost model; ratio = Θ / Θ(oracle).",
        "",
    ]
    planners = [p for p in result["planners"] if p != "oracle"]
    header = (
        ["concurrency"]
        + [f"{p} Θ/oracle" for p in planners]
        + ["oracle Θ (tok/s)"]
        + [f"{p} ℓ̄" for p in planners + ["oracle"]]
    )
    rows = []
    for rep in result["replays"]:
        ps = rep["planners"]
        rows.append(
            [str(rep["concurrency"])]
            + [fmt(ps[p]["ratio_to_oracle"], 3) for p in planners]
            + [fmt(ps["oracle"]["throughput"], 1)]
            + [fmt(ps[p]["mean_verify_len"]) for p in planners + ["oracle"]]
        )
    out.append(table(header, rows))
    out.append("")
    return "\n".join(out)
