"""What serving on SGLang needs before an engine starts: CUDA and the pinned SGLang importable
(refused with a clear message otherwise), a drafter SGLang can load, the EOS ids it must stop on,
and the default profile and calibration files beside our own."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from dspark_server.backends.sglang_args import SGLANG_VERSION, SGLangConfig
from dspark_server.config import ModelConfig
from dspark_server.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class SGLangUnavailableError(RuntimeError):
    """The SGLang backend cannot run here (no CUDA device, or SGLang missing/broken)."""


def cuda_status() -> tuple[bool, str]:
    """(usable, description): the first CUDA device's name, or why there is none."""
    try:
        import torch
    except ImportError:
        return False, "PyTorch is not installed"
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} is a CPU-only build"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return False, (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
        )
    return True, torch.cuda.get_device_name(0)


def require_sglang_runtime(
    *,
    cuda: tuple[bool, str] | None = None,
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
    import_module: Callable[[str], Any] = importlib.import_module,
) -> str:
    """Refuse (``SGLangUnavailableError``, a one-paragraph message) unless a CUDA device is
    visible and SGLang imports; returns the installed SGLang version."""
    ok, detail = cuda if cuda is not None else cuda_status()
    if not ok:
        raise SGLangUnavailableError(
            f"the SGLang backend needs an NVIDIA GPU with CUDA, and this machine has none: {detail}. "
            "Run with --backend native on CPU machines, or deploy the GPU image (docs/sglang.md)."
        )
    if find_spec("sglang") is None:
        raise SGLangUnavailableError(
            f"the SGLang backend needs SGLang {SGLANG_VERSION}, which is not installed: "
            "pip install 'dspark-server[sglang]' (or use the GPU Docker image, docs/sglang.md)."
        )
    try:
        import_module("sglang")
    except Exception as exc:  # a --no-deps install (CI) or a broken CUDA stack
        raise SGLangUnavailableError(
            f"SGLang is installed but does not import ({type(exc).__name__}: {exc}); install it with "
            "its dependencies: pip install 'dspark-server[sglang]'."
        ) from exc
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if version != SGLANG_VERSION:
        log.warning(
            "SGLang %s is installed; dspark-server is built and tested against %s", version, SGLANG_VERSION
        )
    return version


def sglang_engine(**kwargs: Any) -> Any:
    import sglang

    return sglang.Engine(**kwargs)


def eos_token_ids(model_dir: str | Path, model_cfg: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The native engine's rule, so both backends stop on the same ids."""
    from dspark_server.engine.engine import eos_token_ids as native_eos_token_ids

    return native_eos_token_ids(str(model_dir), model_cfg.eos_token_ids, tokenizer)


def check_draft_for_sglang(cfg: SGLangConfig) -> int:
    """Refuse drafters SGLang's DSpark worker would reject, before SGLang starts; returns gamma."""
    from dspark_server.models.drafter_checkpoint import read_draft_config

    assert cfg.draft_path is not None
    draft = read_draft_config(cfg.draft_path)
    if draft.markov_rank <= 0:
        raise ValueError(
            f"{cfg.draft_path}: SGLang's DSpark needs a drafter with a Markov head "
            "(markov_rank > 0); this one has none (use --backend native)"
        )
    if cfg.ragged_verify_mode != "static" and not draft.enable_confidence_head:
        raise ValueError(
            f"{cfg.draft_path}: --spec-mode dspark schedules verification from the "
            "drafter's confidence head, which this drafter lacks; use --spec-mode fixed"
        )
    gamma = cfg.gamma or draft.gamma
    if gamma > draft.gamma:
        raise ValueError(f"--gamma {gamma} exceeds the drafter's block size {draft.gamma}")
    return gamma


CALIBRATION_FILE = "sts_calibration.json"  # next to the drafter, as the native engine looks
PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"


def default_sglang_profile_path(model_path: str, gpu_name: str, tp_size: int) -> Path:
    """Where ``dspark profile --backend sglang`` writes the table for this model, GPU and TP size."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")[:40] or "gpu"
    return Path("profiles") / f"{Path(model_path).name}__sglang__{slug}__tp{tp_size}.json"


def with_default_files(cfg: SGLangConfig, gpu_name: str | None) -> SGLangConfig:
    """Fill what the native engine also finds by itself: the STS calibration next to the drafter,
    and (dspark mode) the SPS table ``dspark profile --backend sglang`` writes for this model,
    GPU and TP size, in ./profiles or the package's profiles/."""
    if not cfg.speculative:
        return cfg
    sts = cfg.sts_path
    if sts is None and cfg.draft_path and (Path(cfg.draft_path) / CALIBRATION_FILE).is_file():
        sts = str(Path(cfg.draft_path) / CALIBRATION_FILE)
    sps = cfg.sps_table_path
    if sps is None and gpu_name and cfg.ragged_verify_mode != "static":
        name = default_sglang_profile_path(cfg.model_path, gpu_name, cfg.tp_size).name
        for candidate in (Path("profiles") / name, PROFILES_DIR / name):
            if candidate.is_file():
                sps = str(candidate)
                log.info("using SPS profile %s", candidate)
                break
    return replace(cfg, sts_path=sts, sps_table_path=sps)
