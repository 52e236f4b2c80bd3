"""Formatting shared by the report renderers: numbers, markdown tables, the machine line."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def fmt(x: Any, digits: int = 2, scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, int) and scale == 1.0:
        return str(x)
    return f"{x * scale:.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def machine_line(machine: dict[str, Any]) -> str:
    parts = [f"{machine.get('cpu', '?')}", f"{machine.get('cores', '?')} cores"]
    if machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']} GiB RAM")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    if machine.get("git_commit"):
        parts.append(f"commit {machine['git_commit']}")
    if machine.get("load_average_1m") is not None:
        parts.append(f"load {machine['load_average_1m']} at start")
    return "Machine: " + ", ".join(parts) + "."
