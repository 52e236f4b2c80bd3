"""Bundled demo model pair (target + DSpark drafter + calibration), trained by `dspark train demo`."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFT = DEMO_DIR / "draft"
DEMO_CALIBRATION = DEMO_DIR / "calibration.json"


def default_target() -> str:
    if not (DEMO_TARGET / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled demo model is missing ({DEMO_TARGET}); pass --model DIR or build it "
            "with `dspark train demo`"
        )
    return str(DEMO_TARGET)


def default_draft(variant: str | None = None) -> str | None:
    """The shipped drafter, or an ablation variant (``markov``, ``rnn``, ``none``) built beside it."""
    path = DEMO_DRAFT if variant in (None, "markov") else DEMO_DIR / f"draft_{variant}"
    if variant not in (None, "markov") and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no '{variant}' demo drafter at {path}; train it with "
            f"`dspark train draft --head {variant} --out {path}`"
        )
    return str(path) if (path / "config.json").is_file() else None
