"""`dspark profile --backend sglang`: the SPS table measured on SGLang's engine, in our format.

This wraps SGLang's own profiler (``sglang.benchmark.dspark_sps_profiler``) rather than timing
forwards ourselves, because the table must describe the step SGLang's planner schedules: its
DSpark verify step with CUDA graphs, at the batch sizes it captured. The profiler never launches
a server, so this job does:

1. start SGLang's HTTP server in a child process (``sglang.launch_server.run_server`` on
   ``ServerArgs`` built from the same :class:`SGLangConfig` as ``dspark serve --backend sglang``),
   with the environment the profiler requires: ``SGLANG_RAGGED_VERIFY_MODE=static`` (every request
   verifies gamma + 1 tokens, so B = requests x (gamma + 1)), ``SGLANG_DSPARK_ENABLE_SPS_RECORD=1``
   (per-step records on ``/server_info``) and ``SGLANG_SIMULATE_ACC_LEN=1.0`` (each step commits
   only the bonus token, so the KV length grows predictably);
2. run the profiler's ``profile_all`` against it (a sweep of running-request counts, each held
   until enough steady steps are recorded; median step time per batch-token count);
3. read the fitted table with our loader, write it with ``save_sps_table`` plus metadata (GPU,
   model, gamma, SGLang version) and our PNG; SGLang's raw records/rounds/manifest stay beside it
   in ``<out stem>.sglang/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dspark_server.backends.sglang_args import SGLANG_VERSION, SGLangConfig, build_server_kwargs
from dspark_server.backends.sglang_runtime import (
    check_draft_for_sglang,
    cuda_status,
    default_sglang_profile_path,
    require_sglang_runtime,
)
from dspark_server.planner import SpsCostTable, load_sps_table, plot_sps_table, save_sps_table

log = logging.getLogger(__name__)

PROFILE_ENV: dict[str, str] = {
    "SGLANG_RAGGED_VERIFY_MODE": "static",
    "SGLANG_DSPARK_ENABLE_SPS_RECORD": "1",
    "SGLANG_SIMULATE_ACC_LEN": "1.0",
}
PROFILER_MODULE = "sglang.benchmark.dspark_sps_profiler"
HEALTH_POLL_S = 2.0


@dataclass(frozen=True)
class SGLangProfileConfig:
    """``max_batch_size``: running requests at the top of the sweep (per data-parallel rank; the
    sweep is SGLang's 1, 2, 4, 8, 16, 24, ... up to it) unless ``batch_sizes`` lists them.
    ``max_batch_tokens``: the table's max_batch_tokens (default: the largest probe)."""

    server: SGLangConfig
    out: str | None = None
    max_batch_size: int = 64
    batch_sizes: tuple[int, ...] | None = None
    repeats: int = 1
    input_len: int = 16
    temperature: float = 1.0
    min_steady_steps: int = 32
    min_steady_seconds: float = 10.0
    round_timeout_s: float = 300.0
    max_batch_tokens: int | None = None
    startup_timeout_s: float = 900.0
    port: int | None = None

    def __post_init__(self) -> None:
        if self.server.draft_path is None:
            raise ValueError("profiling SGLang's DSpark verify step needs a drafter (--draft DIR)")
        if self.max_batch_size < 1 or self.repeats < 1 or self.input_len < 1:
            raise ValueError("max_batch_size, repeats and input_len must be >= 1")
        if self.batch_sizes is not None and (not self.batch_sizes or min(self.batch_sizes) < 1):
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")

    @property
    def sweep_max(self) -> int:
        return max(self.batch_sizes) if self.batch_sizes else self.max_batch_size


def profile_server_kwargs(cfg: SGLangProfileConfig, port: int) -> dict[str, Any]:
    """ServerArgs for the profiled server: the serving configuration in DSpark mode, with room
    (running requests, decode CUDA graphs) for the largest batch of the sweep. The SPS table and
    STS file are not passed: static verification reads neither."""
    server = replace(
        cfg.server,
        spec_mode="dspark",
        verify_mode="static",
        sps_table_path=None,
        sts_path=None,
        max_running=max(cfg.server.max_running or 0, cfg.sweep_max),
    )
    kw = build_server_kwargs(server, host="127.0.0.1", port=port)
    kw.setdefault("cuda_graph_max_bs_decode", cfg.sweep_max)
    return kw


def raw_dir_for(out: Path) -> Path:
    """Where SGLang's profiler writes its table, records, rounds and manifest."""
    return out.with_name(out.stem + ".sglang")


def convert_sglang_table(path: str | Path) -> SpsCostTable:
    """SGLang's fitted ``SpsCostTable`` JSON -> ours (same format; validated by our loader)."""
    text = Path(path).read_text(encoding="utf-8")
    if '"bias_seconds"' in text:
        raise ValueError(
            f"{path}: SGLang wrote an additive (off-diagonal) table; dspark uses the "
            "plain SpsCostTable only (run the profiler without --fracs)"
        )
    return load_sps_table(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


class _SizedVocab:
    """What the profiler needs of a tokenizer: ``len()`` (the vocabulary size, for random prompts)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def _load_profiler(vocab_size: int) -> Any:
    import importlib

    mod = importlib.import_module(PROFILER_MODULE)
    if getattr(mod, "should_skip_due_to_max_running_requests", None) is None:
        raise RuntimeError(
            f"{PROFILER_MODULE} fell back to its torch-free mode (see the warning "
            "above: a dependency of sglang.benchmark is missing); install SGLang "
            "with its dependencies: pip install 'dspark-server[sglang]'"
        )
    # The profiler sizes random prompts with len(HF tokenizer); with skip_tokenizer_init the server
    # needs no HF tokenizer, so give it the model's vocabulary size directly.
    vars(mod)["get_tokenizer"] = lambda _path: _SizedVocab(vocab_size)
    return mod


def run_sglang_profile(cfg: SGLangProfileConfig) -> tuple[SpsCostTable, Path]:
    from dspark_server.config import ModelConfig

    version = require_sglang_runtime()
    _, gpu = cuda_status()
    gamma = check_draft_for_sglang(replace(cfg.server, spec_mode="dspark", verify_mode="static"))
    out = (
        Path(cfg.out)
        if cfg.out
        else default_sglang_profile_path(cfg.server.model_path, gpu, cfg.server.tp_size)
    )
    raw = raw_dir_for(out)
    raw.mkdir(parents=True, exist_ok=True)
    port = cfg.port or _free_port()
    base_url = f"http://127.0.0.1:{port}"
    kwargs = profile_server_kwargs(cfg, port)
    vocab = ModelConfig.from_dir(cfg.server.model_path).vocab_size
    log.info("profiling SGLang %s DSpark verify steps on %s: %s", version, gpu, kwargs)
    env = {**os.environ, **PROFILE_ENV}
    child = subprocess.Popen(
        [sys.executable, "-m", "dspark_server.jobs.profile_sglang", "--child-server", json.dumps(kwargs)],
        env=env,
        start_new_session=True,
    )
    try:
        _wait_healthy(child, base_url, cfg.startup_timeout_s)
        profiler = _load_profiler(vocab)
        settings = profiler.RoundSettings(
            input_len=cfg.input_len,
            temperature=cfg.temperature,
            min_steady_steps=cfg.min_steady_steps,
            min_steady_seconds=cfg.min_steady_seconds,
            round_timeout_seconds=cfg.round_timeout_s,
        )
        batch_sizes = (
            list(cfg.batch_sizes)
            if cfg.batch_sizes
            else profiler.build_request_count_sweep(cfg.max_batch_size)
        )
        sglang_out = raw / "table.json"
        profiler.profile_all(
            base_url=base_url,
            batch_sizes=batch_sizes,
            settings=settings,
            out=str(sglang_out),
            max_batch_tokens=cfg.max_batch_tokens,
            repeats=cfg.repeats,
            self_check=True,
            local_tokenizer_path=cfg.server.model_path,
            fracs=None,
            plot=False,
        )
    finally:
        _stop(child)
    table = convert_sglang_table(sglang_out)
    save_sps_table(
        table,
        out,
        metadata={
            "source": f"sglang {version} {PROFILER_MODULE} (static verify, simulated accept length 1)",
            "model": Path(cfg.server.model_path).name,
            "draft": Path(cfg.server.draft_path or "").name,
            "gamma": gamma,
            "gpu": gpu,
            "tp_size": cfg.server.tp_size,
            "dtype": cfg.server.dtype,
            "batch_sizes": batch_sizes,
            "repeats": cfg.repeats,
            "sglang_raw": str(raw),
        },
    )
    plot_sps_table(
        table, out.with_suffix(".png"), title=f"SPS (SGLang, {gpu}): {Path(cfg.server.model_path).name}"
    )
    return table, out


def _wait_healthy(child: subprocess.Popen, base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(
                f"the SGLang server exited with status {child.returncode} during start-up (its log is above)"
            )
        if _get(base_url + "/health") == 200:
            return
        time.sleep(HEALTH_POLL_S)
    raise TimeoutError(f"the SGLang server did not become healthy within {timeout_s:.0f} s")


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)


def _child_server(kwargs: dict[str, Any]) -> None:
    """Child process: SGLang's own HTTP server on ``ServerArgs(**kwargs)``."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    try:
        run_server(ServerArgs(**kwargs))
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="internal: the SGLang server child of `dspark profile --backend sglang`"
    )
    p.add_argument("--child-server", required=True, help="ServerArgs kwargs as JSON")
    a = p.parse_args(argv)
    _child_server(json.loads(a.child_server))


__all__ = [
    "PROFILE_ENV",
    "SGLANG_VERSION",
    "SGLangProfileConfig",
    "convert_sglang_table",
    "default_sglang_profile_path",
    "profile_server_kwargs",
    "run_sglang_profile",
]

if __name__ == "__main__":
    main()
