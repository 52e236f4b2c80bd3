"""The training loop both trainers share: steps, a JSON-lines log, held-out evaluation, checkpoints,
a wall-clock budget and Ctrl-C, with one progress bar.

A trainer supplies what differs — one optimisation step, one evaluation, one checkpoint write —
and keeps its own state; the loop decides when each happens:
  * the log gets one JSON object per step (the step's record, plus the evaluation's summary on
    evaluation steps); a fresh run (step 0) replaces an old log, a resumed one appends;
  * evaluation every ``eval_every`` steps and at the last step (and at step 0 if asked);
  * a checkpoint every ``ckpt_every`` steps, at the last step, when the budget runs out, and on
    Ctrl-C (then the loop returns "interrupted" and the trainer re-raises after exporting);
  * the budget is wall-clock minutes since the loop started, evaluation and checkpoints included.
``train_seconds`` counts only the steps themselves.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Status = Literal["completed", "time budget", "interrupted"]


@dataclass(frozen=True)
class StepReport:
    record: dict[str, Any]  # written to the log (the loop adds "step")
    postfix: dict[str, str]  # shown on the progress bar
    tokens: int  # tokens this step trained on


@dataclass(frozen=True)
class EvalReport:
    summary: Any  # a JSON value added to the step's log record under "heldout"
    message: str  # printed above the progress bar


@dataclass(frozen=True)
class LoopConfig:
    steps: int
    eval_every: int
    ckpt_every: int
    max_minutes: float | None = None
    eval_at_start: bool = False
    progress: bool = True
    desc: str = "train"


@dataclass
class LoopProgress:
    """What the loop counts; trainers resume it from their checkpoints."""

    step: int = 0
    train_seconds: float = 0.0
    tokens_seen: int = 0


def run_training_loop(
    cfg: LoopConfig,
    progress: LoopProgress,
    log_path: Path,
    train_step: Callable[[int], StepReport],
    evaluate: Callable[[], EvalReport] | None,
    save_checkpoint: Callable[[], object],
) -> Status:
    """Run from ``progress.step`` to ``cfg.steps``; ``train_step(step)`` gets the 0-based index of
    the step it runs. Returns how the loop ended."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    bar = tqdm(
        total=cfg.steps,
        initial=progress.step,
        desc=cfg.desc,
        disable=not cfg.progress,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=2.0,
    )
    status: Status = "completed"
    with log_path.open("a" if progress.step > 0 else "w") as log:
        try:
            if evaluate is not None and cfg.eval_at_start and progress.step == 0:
                bar.write(f"step 0 {evaluate().message}")
            while progress.step < cfg.steps:
                t0 = time.perf_counter()
                report = train_step(progress.step)
                progress.step += 1
                progress.train_seconds += time.perf_counter() - t0
                progress.tokens_seen += report.tokens
                step = progress.step
                bar.update(1)
                bar.set_postfix(
                    **report.postfix, tok_s=f"{progress.tokens_seen / max(progress.train_seconds, 1e-9):.0f}"
                )
                record = {"step": step, **report.record}
                if evaluate is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
                    ev = evaluate()
                    record["heldout"] = ev.summary
                    bar.write(f"step {step} {ev.message}")
                log.write(json.dumps(record) + "\n")
                log.flush()
                over_budget = (
                    cfg.max_minutes is not None and time.perf_counter() - t_start > 60.0 * cfg.max_minutes
                )
                if step % cfg.ckpt_every == 0 or step == cfg.steps or over_budget:
                    save_checkpoint()
                if over_budget and step < cfg.steps:
                    status = "time budget"
                    bar.write(
                        f"time budget of {cfg.max_minutes} min reached at step {step}: checkpoint "
                        "saved; rerun with --resume to continue"
                    )
                    break
        except KeyboardInterrupt:
            status = "interrupted"
            save_checkpoint()
            bar.write(f"interrupted at step {progress.step}: checkpoint saved")
        finally:
            bar.close()
    return status
