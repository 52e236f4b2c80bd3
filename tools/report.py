"""docs/benchmarks.md from result JSON files of any suite (tables are generated, never typed), and
the markdown of the paper figures and engine-level timings. Repository tooling, run from the root:

    python -m tools.report --results runs/bench/serving/results.json --results runs/bench/peers/peers.json \\
        --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark_server.bench.common import split_list
from dspark_server.bench.render import (
    fmt,
    machine_line,
    mode_key,
    oracle_markdown,
    peers_markdown,
    serving_markdown,
    table,
)
from tools.report_engine import (
    decode_throughput_markdown,
    draft_timing_markdown,
    generate_modes_markdown,
    sps_markdown,
)


def acceptance_summary(result: dict[str, Any]) -> list[str]:
    """τ of every drafter per prompt set, and the first drafter's gain over each of the others."""
    sets = list(result["results"])
    labels = [e["label"] for e in result["results"][sets[0]]] if sets else []
    if len(labels) < 2:
        return []
    header = ["prompts"] + [f"τ {lb}" for lb in labels] + [f"{labels[0]} vs {lb}" for lb in labels[1:]]
    rows: list[list[str]] = []
    gains: dict[str, list[float]] = {lb: [] for lb in labels[1:]}
    for ps in sets:
        tau = {e["label"]: e["mean_acceptance_length"] for e in result["results"][ps]}
        row = [ps] + [fmt(tau.get(lb)) for lb in labels]
        for lb in labels[1:]:
            g = tau[labels[0]] / tau[lb] - 1 if tau.get(lb) else math.nan
            gains[lb].append(g)
            row.append(f"{g:+.1%}" if math.isfinite(g) else "–")
        rows.append(row)
    mean = ["mean"] + ["" for _ in labels] + [f"{sum(v) / len(v):+.1%}" for v in gains.values()]
    return [table(header, rows + [mean]), ""]


def acceptance_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    heading = (
        f"{result.get('title', 'Per-position acceptance')}: {' vs '.join(cfg.get('labels', []))}, "
        f"temperature {cfg.get('temperature', 0.0)}"
    )
    out = [
        f"## {heading}",
        "",
        machine_line(result["machine"]),
        "",
        f"Command: `{cfg.get('command', '')}`",
        "",
        f"Temperature {cfg.get('temperature', 0.0)}, first {cfg.get('limit')} prompts per file, "
        f"{cfg.get('max_tokens')} new tokens, every round verifies all γ drafts.",
        "",
    ]
    out += acceptance_summary(result)
    for ps, entries in result["results"].items():
        gamma = max(e["gamma"] for e in entries)
        out += [f"### {ps}", ""]
        header = ["drafter", "γ", "τ", "rounds"] + [f"p{k}" for k in range(1, gamma + 1)]
        rows = [
            [e["label"], str(e["gamma"]), fmt(e["mean_acceptance_length"]), str(e["rounds"])]
            + [fmt(x) for x in e["per_position_conditional_acceptance"]]
            + ["" for _ in range(gamma - e["gamma"])]
            for e in entries
        ]
        out += [table(header, rows), ""]
    out.append(
        "p_k = P(draft k accepted | drafts 1..k−1 accepted), full-γ verification; τ = tokens "
        "per round, bonus included."
    )
    return "\n".join(out) + "\n"


def threshold_markdown(result: dict[str, Any]) -> str:
    out = [
        "## Fixed-threshold sweep",
        "",
        machine_line(result["machine"]),
        "",
        f"Command: `{result['config'].get('command', '')}`",
        "",
        "Replayed on recorded full-γ rounds: ℓ = largest j with calibrated prefix survival ≥ t; "
        "acceptance rate = accepted / verified drafts; tokens per step = emitted tokens per request "
        "per step (accepted + 1).",
        "",
    ]
    for ps, rows in result["domains"].items():
        out += [f"### {ps}", ""]
        out += [
            table(
                ["threshold", "acceptance rate", "tokens / step", "mean ℓ"],
                [
                    [
                        fmt(r["threshold"]),
                        fmt(r["acceptance_rate"], 3),
                        fmt(r["tokens_per_step"], 3),
                        fmt(r["mean_verify_len"]),
                    ]
                    for r in rows
                ],
            ),
            "",
        ]
    return "\n".join(out)


def ece_markdown(result: dict[str, Any]) -> str:
    before, after = result["ece_before"], result["ece_after"]
    out = [
        "## ECE per position before / after STS",
        "",
        f"Calibration file `{result['calibration']}` ({result.get('num_samples')} rounds of "
        f"{result.get('dataset')}).",
        "",
    ]
    out.append(
        table(
            ["position"] + [str(k + 1) for k in range(len(before))],
            [
                ["ECE before (%)"] + [fmt(x, 2, 100) for x in before],
                ["ECE after (%)"] + [fmt(x, 2, 100) for x in after],
                ["temperature"] + [fmt(x, 3) for x in result["temperatures"]],
            ],
        )
    )
    out.append("")
    return "\n".join(out)


def concurrency_markdown(result: dict[str, Any]) -> str:
    out = [
        "## TPS and verification budget vs concurrency",
        "",
        machine_line(result["machine"]),
        "",
        f"Command: `{result['config'].get('command', '')}` (from `{result.get('source')}`)",
        "",
    ]
    rows = sorted(result["series"], key=lambda r: (r["prompt_set"], r["concurrency"], mode_key(r["mode"])))
    header = ["prompt set", "mode", "conc.", "output tok/s", "budget / step", "verified / req / step", "τ"]
    out.append(
        table(
            header,
            [
                [
                    r["prompt_set"],
                    r["mode"],
                    str(r["concurrency"]),
                    fmt(r["output_tokens_per_s"], 1),
                    fmt(r["mean_verify_budget_per_step"], 1),
                    fmt(r["mean_verified_drafts_per_request_step"]),
                    fmt(r["mean_acceptance_length"]),
                ]
                for r in rows
            ],
        )
    )
    return "\n".join(out) + "\n"


def paper_index_markdown(result: dict[str, Any]) -> str:
    out = ["## Paper figures", "", f"Command: `{result.get('command', '')}`", ""]
    out += [f"- {k}: `{v}`" for k, v in result["figures"].items()]
    out += [f"- {k}: not made ({v})" for k, v in result["skipped"].items()]
    return "\n".join(out) + "\n"


RENDERERS = {
    "serving": serving_markdown,
    "peers": peers_markdown,
    "oracle": oracle_markdown,
    "acceptance": acceptance_markdown,
    "threshold_sweep": threshold_markdown,
    "ece": ece_markdown,
    "concurrency": concurrency_markdown,
    "paper_index": paper_index_markdown,
    "decode_throughput": decode_throughput_markdown,
    "generate_modes": generate_modes_markdown,
    "draft_timing": draft_timing_markdown,
    "sps": sps_markdown,
}


def kind_of(result: dict[str, Any]) -> str:
    if "kind" in result:
        return result["kind"]
    if "sample_batch_tokens" in result:
        return "sps"
    if "runs" in result and "config" in result:
        return "serving"
    raise ValueError("not a dspark bench result (no 'kind' and no 'runs')")


def render(result: dict[str, Any]) -> str:
    kind = kind_of(result)
    if kind == "serving":
        return serving_markdown(result)
    return RENDERERS[kind](result)


REPO = Path(__file__).resolve().parents[1]


def portable(text: str, prompts_dir: str | None = None) -> str:
    """Paths as a fresh clone has them: the repository root dropped (commands run from it) and
    the evaluation prompt directory, which is not shipped, written ``$PROMPTS``."""
    if prompts_dir:
        for form in sorted({prompts_dir, str(Path(prompts_dir).resolve())}, key=len, reverse=True):
            text = text.replace(f"{REPO}/{form.rstrip('/')}/", "$PROMPTS/").replace(
                form.rstrip("/") + "/", "$PROMPTS/"
            )
    return text.replace(f"{REPO}/", "")


def write_report(
    result_paths: Sequence[str],
    out: str | Path,
    title: str = "Benchmarks",
    preface: str | Path | None = None,
    prompts_dir: str | None = None,
) -> Path:
    """One markdown page from several result JSON files (any suite), in the order given.

    Each JSON and the PNGs beside it are copied into a folder named after the page
    (docs/benchmarks.md -> docs/benchmarks/NN-KIND/), so the page and its figures can be committed
    while runs/ stays ignored. Paths in the page are made ``portable``."""
    import shutil

    out = Path(out)
    assets = out.with_suffix("")
    parts = [
        f"# {title}",
        "",
        "Generated by `python -m tools.report` from the result files below (copied, with "
        f"their figures, into `{assets.name}/`); do not edit by hand: rerun the commands shown.",
        "",
    ]
    if preface is not None:  # prose that reads the tables below (it must not type figures itself)
        parts += [Path(preface).read_text().strip(), ""]
    for i, p in enumerate(result_paths, 1):
        path = Path(p)
        result = json.loads(path.read_text())
        kind = kind_of(result)
        dest = assets / f"{i:02d}-{kind}"
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        shutil.copy2(path, dest / path.name)
        parts.append(portable(render(result), prompts_dir))
        for png in sorted(path.parent.glob("*.png")):
            shutil.copy2(png, dest / png.name)
            parts.append(f"![{png.stem}]({assets.name}/{dest.name}/{png.name})")
        data = f"{assets.name}/{dest.name}/{path.name}"
        parts += ["", f"_Data: [`{data}`]({data})_", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", action="append", required=True, help="result JSON file(s), in page order")
    p.add_argument("--out", default="runs/bench/benchmarks.md", help="markdown page to write")
    p.add_argument("--title", default="Benchmarks", help="page title")
    p.add_argument("--preface", default=None, help="markdown prose placed under the title")
    p.add_argument(
        "--prompts-dir", default=None, help="the evaluation prompt directory, shown as $PROMPTS in the page"
    )
    a = p.parse_args(argv)
    files = [f for item in a.results for f in split_list(item)]
    out = write_report(files, a.out, title=a.title, preface=a.preface, prompts_dir=a.prompts_dir)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
