"""Figures of tools/paper.py's suites, drawn from their result dictionaries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark_server.bench.common import concurrency_axis, pyplot, save_figure


def plot_acceptance(result: dict[str, Any], path: Path) -> None:
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


def plot_thresholds(result: dict[str, Any], path: Path) -> None:
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


def plot_ece(result: dict[str, Any], path: Path) -> None:
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


def plot_concurrency(serving: dict[str, Any], path: Path) -> None:
    from dspark_server.bench.render import MODE_COLORS, mode_key

    plt = pyplot()
    runs = serving["runs"]
    sets = list(dict.fromkeys(r["prompt_set"] for r in runs))
    modes = sorted(dict.fromkeys(r["mode"] for r in runs), key=mode_key)
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
