"""Shared pieces of the `dspark bench` suites: machine description, prompt sets, percentiles,
JSON output. Imports no torch at module level (the CLI imports this to build its parser)."""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_server.config import EngineConfig
from dspark_server.machine import cpu_model


class BenchError(RuntimeError):
    """A benchmark could not produce trustworthy numbers (a request failed, counts disagree)."""


@dataclass(frozen=True)
class SuiteConfig:
    """What every in-process suite (peers, oracle, the paper figures) is given."""

    engine: EngineConfig
    prompt_files: tuple[str, ...] = ()
    out: str = "runs/bench"
    limit: int | None = None  # prompts per file
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    rounds: int = 1
    ignore_eos: bool = False
    record_concurrency: int = 8  # requests in flight while recording full-γ rounds
    progress: bool = True
    plots: bool = True
    command: str = ""


@dataclass(frozen=True)
class PromptSet:
    name: str  # file stem, e.g. "humaneval"
    path: str
    prompts: tuple[str, ...]


def load_prompt_sets(paths: Sequence[str], limit: int | None) -> list[PromptSet]:
    """First user turn of each line of every ``{"turns": [...]}`` JSONL file (``limit`` per file)."""
    from dspark_server.offline import read_prompts

    sets = []
    for p in paths:
        prompts = read_prompts(p, limit)
        if not prompts:
            raise BenchError(f"no prompts in {p}")
        sets.append(PromptSet(Path(p).stem, str(p), tuple(prompts)))
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise BenchError(f"prompt files must have distinct names, got {names}")
    return sets


def split_list(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def split_ints(text: str | None) -> list[int]:
    try:
        values = [int(x) for x in split_list(text)]
    except ValueError as exc:
        raise BenchError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise BenchError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); NaN for an empty list."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    out = {f"{prefix}_p{q}_s": percentile(values, q) for q in (50, 90, 99)}
    out[f"{prefix}_mean_s"] = sum(values) / len(values) if values else math.nan
    return out


def git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if out.returncode != 0:
            return None
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, load, library versions: what a reader needs to compare figures."""
    cpu = cpu_model()
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count() or 1,
        "memory_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "git_commit": git_commit(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(var):
            info[var] = os.environ[var]
    return info


def command_line(argv: Sequence[str] | None = None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return "dspark " + " ".join(shlex.quote(a) for a in args)


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(data), indent=2) + "\n")
    return path


def _clean(x: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Tight layout, 120 dpi PNG, figure closed."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def concurrency_axis(ax: Any, legend_size: int = 8) -> None:
    """The x axis every load plot shares: concurrent requests on a log2 scale; grid and legend."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def write_result(
    result: dict[str, Any],
    out_dir: Path,
    name: str,
    render: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], None] | None,
    plots: bool = True,
) -> None:
    """A suite's outputs: NAME.json, NAME.md (``render``'s markdown, also printed), NAME.png."""
    write_json(out_dir / f"{name}.json", result)
    md = render(result)
    (out_dir / f"{name}.md").write_text(md)
    if plot is not None and plots:
        plot(result, out_dir / f"{name}.png")
    print(md)
