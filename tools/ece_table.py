"""A table and a plot of `dspark calibrate --evaluate` reports (per-position ECE on held-out rounds).

    python -m tools.ece_table runs/ece/held_out.json --out docs/benchmarks/ece_held_out

Writes OUT.md (per calibration file and sampling temperature: the per-position ECE of the raw
confidences, of STS alone, of the file as the planner applies it, and of the file corrected online
in the rounds' order), OUT.json (the report as read) and OUT.png (file against online, per
temperature).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dspark_server.bench.common import pyplot, save_figure, write_json

COLUMNS = (("raw", "raw"), ("sts", "STS"), ("calibrated", "file"), ("online", "file + online"))
# the sampling floor: a perfectly calibrated survival's ECE on the same number of rounds (reports
# written before it was measured lack it)
FLOOR = (("floor", "floor"), ("floor_p95", "floor, 95th pct"))


def _pct(values: list[float]) -> str:
    return " / ".join(f"{100 * v:.2f}" for v in values)


def markdown(report: dict[str, Any], command: str) -> str:
    out = [
        "## Calibration ECE on held-out prompts",
        "",
        f"Command: `{command}`" if command else "",
        "",
        "Per-position ECE in % (positions 1-γ, separated by /); `file + online`: the file corrected "
        "by `dspark serve`'s online recalibration, replayed over the rounds in their recorded order "
        "(each round planned on the maps fit before it). `floor`: the ECE a perfectly calibrated "
        "survival measures on as many rounds (outcomes drawn from `file + online` itself, 100 draws: "
        "the mean and the 95th percentile); an ECE above the 95th percentile is miscalibration "
        "these rounds can tell apart from chance.",
        "",
        "| calibration | temperature | rounds | prompts | "
        + " | ".join(c for _, c in COLUMNS + FLOOR)
        + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in COLUMNS + FLOOR) + " |",
    ]
    for e in report["evaluations"]:
        cells = [_pct(e[key]) for key, _ in COLUMNS] + [_pct(e[key]) if key in e else "-" for key, _ in FLOOR]
        out.append(
            f"| {e['calibration']} | {e['sampling_temperature']:g} | {e['rounds']} | {e['prompts']} | "
            + " | ".join(cells)
            + " |"
        )
    out.append("")
    return "\n".join(out)


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    evals = report["evaluations"]
    fig, axes = plt.subplots(1, len(evals), figsize=(3.2 * len(evals), 3.2), squeeze=False)
    for ax, e in zip(axes[0], evals, strict=True):
        ks = range(1, len(e["calibrated"]) + 1)
        for key, label in COLUMNS[2:]:
            ax.plot(ks, [100 * v for v in e[key]], marker="o", label=label)
        if "floor_p95" in e:
            ax.plot(
                ks, [100 * v for v in e["floor_p95"]], linestyle="--", color="grey", label="floor, 95th pct"
            )
        ax.axhline(2.0, color="k", linestyle=":", linewidth=1)
        pair = Path(e["calibration"]).parent.parent.name
        ax.set_title(f"{pair} t={e['sampling_temperature']:g}", fontsize=9)
        ax.set_xlabel("position k")
        ax.set_ylabel("ECE (%)")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help="the JSON `dspark calibrate --evaluate` wrote (--out)")
    ap.add_argument("--out", required=True, help="output stem (OUT.md, OUT.json, OUT.png)")
    ap.add_argument("--command", default="", help="the command that made the report, for the table")
    a = ap.parse_args()
    report = json.loads(Path(a.report).read_text())
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(markdown(report, a.command))
    write_json(out.with_suffix(".json"), report)
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out}.md, .json, .png")


if __name__ == "__main__":
    main()
