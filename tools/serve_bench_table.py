"""Tables, ratios and a plot from the external-client serving benchmark's output lines.

    python -m tools.serve_bench_table RUN.txt [RUN.txt ...] --title T --out docs/benchmarks/serve_bench

Each input holds the lines ``../shared/tools/serve-bench.sh`` prints (SGLang 0.5.23's
``sglang.bench_serving`` against ``dspark serve`` in each mode, and optionally llama.cpp):
``SYSTEM SET c=C T=T tps=X ttft_ms=Y tpot_ms=Z``. Writes OUT.md (a table per prompt set and
temperature: output tokens/s per system, dspark / off, dspark / the best other mode, median TTFT
and dspark's TTFT / off's), OUT.json (the parsed numbers) and OUT.png (tokens/s vs concurrency).
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from dspark_server.bench.common import write_json

LINE = re.compile(
    r"^(?P<sys>\S+) (?P<set>\S+) c=(?P<c>\d+) T=(?P<t>[\d.]+) tps=(?P<tps>[\d.]+) "
    r"ttft_ms=(?P<ttft>[\d.]+) tpot_ms=(?P<tpot>[\d.]+)"
    r"(?: vpr_round=(?P<vpr_round>[\d.]+))?(?: vpr_step=(?P<vpr_step>[\d.]+))?"
)
OURS = "ours-dspark"


def parse(paths: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            m = LINE.match(line.strip())
            if m:
                rows.append(
                    {
                        "system": m["sys"],
                        "set": m["set"],
                        "concurrency": int(m["c"]),
                        "temperature": float(m["t"]),
                        "tps": float(m["tps"]),
                        "ttft_ms": float(m["ttft"]),
                        "tpot_ms": float(m["tpot"]),
                        # draft tokens verified per request per drafting round / per decoding
                        # step (plain steps count 0); absent in older runs
                        "verified_per_round": float(m["vpr_round"]) if m["vpr_round"] else None,
                        "verified_per_step": float(m["vpr_step"]) if m["vpr_step"] else None,
                    }
                )
    return rows


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (system, set, concurrency, temperature): the median of each number over the
    rounds that measured it (runs with ROUNDS > 1 print a line per round)."""
    groups: dict[tuple[str, str, int, float], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["system"], r["set"], r["concurrency"], r["temperature"])].append(r)
    out = []
    for same in groups.values():
        row = dict(same[0], rounds=len(same))
        for key in ("tps", "ttft_ms", "tpot_ms", "verified_per_round", "verified_per_step"):
            values = [r[key] for r in same if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        out.append(row)
    return out


def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def tables(rows: list[dict[str, Any]]) -> str:
    by: dict[tuple[str, float], dict[int, dict[str, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        by[(r["set"], r["temperature"])][r["concurrency"]][r["system"]] = r
    systems = sorted({r["system"] for r in rows}, key=lambda s: (not s.startswith("ours"), s))
    out = []
    for (name, temp), per_c in sorted(by.items()):
        out.append(f"### {name}, temperature {temp:g}\n")
        head = ["concurrency", *[f"{s} tok/s" for s in systems]]
        if OURS in systems:
            head += ["dspark / off", "dspark / best other", "TTFT off ms", "TTFT dspark ms", "TTFT ratio"]
            if any(r.get("verified_per_step") is not None for r in rows if r["system"] == OURS):
                head += ["dspark verified / request / step"]
        out.append("| " + " | ".join(head) + " |")
        out.append("| " + " | ".join("---" for _ in head) + " |")
        for c in sorted(per_c):
            cell = per_c[c]
            line = [str(c), *[_fmt(cell[s]["tps"], 0) if s in cell else "–" for s in systems]]
            if OURS in systems and OURS in cell:
                ours = cell[OURS]
                off = cell.get("ours-off")
                others = [cell[s]["tps"] for s in systems if s != OURS and s in cell]
                line += [
                    _fmt(ours["tps"] / off["tps"] if off else None),
                    _fmt(ours["tps"] / max(others) if others else None),
                    _fmt(off["ttft_ms"] if off else None, 0),
                    _fmt(ours["ttft_ms"], 0),
                    _fmt(ours["ttft_ms"] / off["ttft_ms"] if off and off["ttft_ms"] > 0 else None),
                ]
                if "dspark verified / request / step" in head:
                    line.append(_fmt(ours.get("verified_per_step")))
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = sorted({(r["set"], r["temperature"]) for r in rows})
    fig = Figure(figsize=(4.5 * len(panels), 3.8), dpi=110)
    FigureCanvasAgg(fig)
    for i, (name, temp) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for system in sorted({r["system"] for r in rows}):
            pts = sorted(
                (r["concurrency"], r["tps"])
                for r in rows
                if r["system"] == system and r["set"] == name and r["temperature"] == temp
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=system, markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{name}, T={temp:g}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def plot_verified(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """dspark's verified drafts per request per decoding step against concurrency, one line per
    prompt set and temperature (the paper's Figure 8); False when the runs do not carry it."""
    ours = [r for r in rows if r["system"] == OURS and r.get("verified_per_step") is not None]
    if not ours:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0, 3.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, temp in sorted({(r["set"], r["temperature"]) for r in ours}):
        pts = sorted(
            (r["concurrency"], r["verified_per_step"])
            for r in ours
            if r["set"] == name and r["temperature"] == temp
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{name}, T={temp:g}", markersize=3)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("verified drafts / request / step")
    ax.set_title(title, fontsize=6)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="serve-bench.sh output files")
    p.add_argument("--out", type=Path, required=True, help="path prefix: writes .md, .json, .png")
    p.add_argument("--title", default="dspark serve under SGLang's bench_serving")
    p.add_argument("--command", default="", help="the command that produced the runs (quoted in the page)")
    a = p.parse_args(argv)
    rows = medians(parse(a.runs))
    if not rows:
        p.error("no serve-bench lines found")
    write_json(a.out.with_suffix(".json"), rows)
    plot(rows, a.out.with_suffix(".png"), a.title)
    page = [f"## {a.title}\n"]
    if a.command:
        page.append(f"Measured with `{a.command}` (generated by `python -m tools.serve_bench_table`).\n")
    page.append(f"![tokens/s vs concurrency]({a.out.with_suffix('.png').name})\n")
    fig8 = a.out.with_name(a.out.name + ".verified.png")
    if plot_verified(rows, fig8, a.title):
        page.append(f"![verified drafts per request per step vs concurrency]({fig8.name})\n")
    page.append(tables(rows))
    a.out.with_suffix(".md").write_text("\n".join(page))
    print(tables(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
