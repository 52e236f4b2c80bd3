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
            "with `dspark train demo`")
    return str(DEMO_TARGET)


def default_draft() -> str | None:
    return str(DEMO_DRAFT) if (DEMO_DRAFT / "config.json").is_file() else None
