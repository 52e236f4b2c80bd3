"""`dspark profile`: measure the target's SPS curve on this machine and write SGLang's table."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from dspark_server.config import EngineConfig
from dspark_server.engine.model_runner import ModelRunner
from dspark_server.engine.profiler import machine_description, profile_context, profile_key, profile_sps
from dspark_server.planner import SpsCostTable, plot_sps_table, save_sps_table


@dataclass(frozen=True)
class ProfileConfig:
    engine: EngineConfig
    out: str | None = None
    max_batch_tokens: int = 512
    block: int = 8
    repeats: int = 7


def default_profile_path(model_dir: str) -> Path:
    cpu = str(machine_description()["cpu"])
    slug = re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-")[:40]
    threads = machine_description()["torch_threads"]
    return Path("profiles") / f"{Path(model_dir).name}__{slug}__{threads}t.json"


def run_profile(cfg: ProfileConfig) -> tuple[SpsCostTable, Path]:
    runner = ModelRunner(cfg.engine)
    with tqdm(desc="SPS probes", unit="probe", file=sys.stderr) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        table = profile_sps(
            runner,
            cfg.max_batch_tokens,
            block=cfg.block,
            context=profile_context(cfg.engine.max_model_len),
            repeats=cfg.repeats,
            progress=progress,
        )
    out = Path(cfg.out) if cfg.out else default_profile_path(cfg.engine.model_dir)
    save_sps_table(
        table,
        out,
        metadata={
            "profile_key": profile_key(cfg.engine.model_dir, cfg.engine.serving_dtype()),
            "model": Path(cfg.engine.model_dir).name,
            "dtype": cfg.engine.serving_dtype(),
            "machine": machine_description(),
            "block": cfg.block,
            "repeats": cfg.repeats,
        },
    )
    plot_sps_table(table, out.with_suffix(".png"), title=f"SPS: {Path(cfg.engine.model_dir).name}")
    return table, out
