"""SPS cost table: target verification steps per second as a function of batch tokens.

The JSON format is SGLang 0.5.23's ``SpsCostTable``: an object with keys
``sample_batch_tokens`` (strictly increasing ints), ``sample_steps_per_sec`` (same length)
and ``max_batch_tokens`` (>= the largest probe). Lookup uses the largest probe <= B; a B
below the first probe reads the first value, a B above the last probe (even above
``max_batch_tokens``) reads the last value.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPS_TABLE_KEYS: tuple[str, ...] = ("sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens")
# SGLang's loader switches to its additive table type if this substring appears anywhere in
# the file, so it must never appear in the metadata we write next to a plain table.
_ADDITIVE_MARKER = "bias_seconds"
# Largest max_batch_tokens for which lookup_range caches a dense per-token array (8 MiB).
_DENSE_LIMIT = 1 << 20


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpsCostTable:
    """Steps-per-second curve SPS(B); immutable, validated on construction."""

    sample_batch_tokens: tuple[int, ...]
    sample_steps_per_sec: tuple[float, ...]
    max_batch_tokens: int
    _probes_np: np.ndarray = field(init=False, repr=False, compare=False)
    _sps_np: np.ndarray = field(init=False, repr=False, compare=False)
    _dense: np.ndarray | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        tokens = tuple(self.sample_batch_tokens)
        sps = tuple(self.sample_steps_per_sec)
        if not tokens:
            raise ValueError("SPS table needs at least one probe (sample_batch_tokens is empty)")
        if len(tokens) != len(sps):
            raise ValueError(
                "SPS table: sample_batch_tokens and sample_steps_per_sec lengths differ "
                f"({len(tokens)} vs {len(sps)})"
            )
        for b in tokens:
            if not _is_int(b) or b < 1:
                raise ValueError(f"SPS table: sample_batch_tokens must be ints >= 1, got {b!r}")
        for prev, nxt in zip(tokens, tokens[1:], strict=False):
            if nxt <= prev:
                raise ValueError(
                    f"SPS table: sample_batch_tokens must be strictly increasing, got {prev} then {nxt}"
                )
        for v in sps:
            if not _is_number(v) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"SPS table: sample_steps_per_sec must be finite and > 0, got {v!r}")
        if not _is_int(self.max_batch_tokens):
            raise ValueError(f"SPS table: max_batch_tokens must be an int, got {self.max_batch_tokens!r}")
        if self.max_batch_tokens < tokens[-1]:
            raise ValueError(
                f"SPS table: max_batch_tokens ({self.max_batch_tokens}) is below the largest probe "
                f"({tokens[-1]})"
            )
        object.__setattr__(self, "sample_batch_tokens", tokens)
        object.__setattr__(self, "sample_steps_per_sec", tuple(float(v) for v in sps))
        object.__setattr__(self, "_probes_np", np.asarray(tokens, dtype=np.int64))
        object.__setattr__(self, "_sps_np", np.asarray(self.sample_steps_per_sec, dtype=np.float64))

    def probe_index(self, batch_tokens: int) -> int:
        """Index of the probe whose value applies to ``batch_tokens`` (clamped to the table)."""
        idx = bisect.bisect_right(self.sample_batch_tokens, int(batch_tokens)) - 1
        return min(max(idx, 0), len(self.sample_batch_tokens) - 1)

    def lookup(self, batch_tokens: int) -> float:
        return float(self.lookup_array(np.asarray([int(batch_tokens)]))[0])

    def lookup_array(self, batch_tokens: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`lookup` on a numpy array; float64, same shape. Up to
        ``max_batch_tokens`` the probes are a step function (SGLang's reading); past it the step
        time grows in proportion to B — never a flat line: tokens beyond the table are never
        free."""
        idx = np.searchsorted(self._probes_np, batch_tokens, side="right") - 1
        sps = self._sps_np[np.clip(idx, 0, self._probes_np.size - 1)]
        end = int(self.max_batch_tokens)
        b = np.asarray(batch_tokens)
        return np.where(b > end, sps * end / np.maximum(b, 1), sps)

    def lookup_range(self, start: int, count: int) -> np.ndarray:
        """SPS at B = start, start + 1, ..., start + count - 1 (float64): the planner's hot
        path, served by slicing a dense per-token array up to ``max_batch_tokens``."""
        dense = self._dense
        if dense is None:
            if self.max_batch_tokens > _DENSE_LIMIT:
                return self.lookup_array(np.arange(start, start + count))
            dense = self.lookup_array(np.arange(self.max_batch_tokens + 1))
            dense.flags.writeable = False  # handed out as views
            object.__setattr__(self, "_dense", dense)
        if start >= 0 and start + count <= dense.size:  # within the table: a view
            return dense[start : start + count]
        b = np.arange(start, start + count)
        out = dense[np.clip(b, 0, dense.size - 1)]
        end = int(self.max_batch_tokens)
        if start + count - 1 > end:  # past the table: step time in proportion to B
            out = np.where(b > end, dense[-1] * end / np.maximum(b, 1), out)
        return out

    def lookup_tensor(self, batch_tokens: torch.Tensor) -> torch.Tensor:
        """Vectorised :meth:`lookup` on a tensor; float64 CPU tensor, same shape."""
        b = batch_tokens.detach().to("cpu", torch.int64).numpy()
        return torch.from_numpy(self.lookup_array(b))

    def tokens_per_sec(self, batch_tokens: int) -> float:
        return batch_tokens * self.lookup(batch_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample_batch_tokens": list(self.sample_batch_tokens),
            "sample_steps_per_sec": list(self.sample_steps_per_sec),
            "max_batch_tokens": self.max_batch_tokens,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpsCostTable:
        if not isinstance(data, Mapping):
            raise ValueError(f"SPS table: expected a JSON object, got {type(data).__name__}")
        if _ADDITIVE_MARKER in data:
            raise ValueError(
                "SPS table: this is SGLang's additive table (SpsAdditiveCostTable, has "
                "'bias_seconds'); only the plain SpsCostTable format is supported"
            )
        missing = [k for k in SPS_TABLE_KEYS if k not in data]
        if missing:
            raise ValueError(f"SPS table: missing key(s) {missing}")
        tokens, sps = data["sample_batch_tokens"], data["sample_steps_per_sec"]
        if not isinstance(tokens, list) or not isinstance(sps, list):
            raise ValueError("SPS table: sample_batch_tokens and sample_steps_per_sec must be lists")
        return cls(
            sample_batch_tokens=tuple(tokens),
            sample_steps_per_sec=tuple(sps),
            max_batch_tokens=data["max_batch_tokens"],
        )

    def with_steps_per_sec(self, steps_per_sec: Sequence[float]) -> SpsCostTable:
        """Same probes and max, new values (used by the live refresher)."""
        return SpsCostTable(self.sample_batch_tokens, tuple(steps_per_sec), self.max_batch_tokens)


def load_sps_table(path: str | Path) -> SpsCostTable:
    """Read an SGLang-format SPS table; raises ``ValueError`` naming the file on any defect."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"SPS table {p}: cannot read ({e})") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"SPS table {p}: invalid JSON ({e})") from e
    try:
        return SpsCostTable.from_dict(data)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from e


def save_sps_table(table: SpsCostTable, path: str | Path, metadata: Mapping[str, Any] | None = None) -> None:
    """Write ``table`` as SGLang JSON. ``metadata`` keys are added at top level (SGLang's
    msgspec loader ignores unknown keys); they may not shadow the table keys."""
    data = table.to_dict()
    for key, value in (metadata or {}).items():
        if key in data:
            raise ValueError(f"SPS table metadata may not override table key {key!r}")
        data[key] = value
    text = json.dumps(data, indent=2, allow_nan=False)
    if _ADDITIVE_MARKER in text:
        raise ValueError(
            f"SPS table metadata may not contain the string {_ADDITIVE_MARKER!r}: SGLang's loader "
            "would then parse the file as an additive table"
        )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n", encoding="utf-8")


def build_sps_table(
    samples: Mapping[int, Iterable[float]], max_batch_tokens: int | None = None
) -> SpsCostTable:
    """Build a table from measured step times: ``{batch_tokens: [step seconds, ...]}``.

    SPS at each probe is 1 / median(step seconds). Probes with no samples are dropped;
    ``max_batch_tokens`` defaults to the largest probe (as SGLang's profiler does).
    """
    tokens: list[int] = []
    sps: list[float] = []
    for b in sorted(samples):
        secs = [float(s) for s in samples[b]]
        if not secs:
            continue
        bad = [s for s in secs if not math.isfinite(s) or s <= 0]
        if bad:
            raise ValueError(f"step seconds must be finite and > 0; probe {b} has {bad[:3]}")
        tokens.append(int(b))
        sps.append(1.0 / statistics.median(secs))
    if not tokens:
        raise ValueError("build_sps_table: no probe has any sample")
    return SpsCostTable(
        tuple(tokens), tuple(sps), tokens[-1] if max_batch_tokens is None else max_batch_tokens
    )


def monotone_envelope(table: SpsCostTable) -> SpsCostTable:
    """SPS(B) := max over probes B' >= B of the measured SPS(B').

    A forward over more tokens is never truly faster than one over fewer (the smaller batch could
    be padded to the larger one), so a measured rise is timing noise. Left in, it makes the DSpark
    planner stop at the spurious dip before it; the envelope keeps every measured probe's best
    achievable rate and is non-increasing in B.
    """
    sps = list(table.sample_steps_per_sec)
    for i in range(len(sps) - 2, -1, -1):
        sps[i] = max(sps[i], sps[i + 1])
    return table.with_steps_per_sec(sps)


def fit_roofline(table: SpsCostTable) -> SpsCostTable:
    """A dense table (every B up to ``max_batch_tokens``) from the roofline that fits the probes'
    step times best: flat at t0 up to a knee, then rising by a slope that may steepen once more,
    t(B) = t0 + c1 max(0, B - k1) + c2 max(0, B - k2) with k1 < k2 probe points and c1, c2 >= 0
    (c2 = 0: one knee).

    Memory-bound GPUs sit on the flat part for a long way; a compute-bound CPU leaves it almost at
    once. Between the two a CPU serving a model bigger than its caches rises gently while the
    weights' reads still dominate (a 190M-parameter model: +0.4 ms per token from 1 to 8 tokens on
    a 13 ms step), then by the full arithmetic (+1.4 ms per token); one slope through both prices
    every token of a short verification at the steep rate. Probes measured on a busy machine
    scatter around that shape, and their monotone envelope turns the scatter into cliffs where one
    more token seems to cost a whole step; a greedy that stops at the first non-improvement halts
    at the first cliff. The fit minimises squared relative error (weighted least squares for every
    candidate at once, at most 32 candidate knees).
    """
    b = np.asarray(table.sample_batch_tokens, dtype=np.float64)
    t = 1.0 / np.asarray(table.sample_steps_per_sec, dtype=np.float64)
    w = 1.0 / t**2  # relative error: probes span a few ms to a few hundred
    knees = b if b.size <= 32 else np.unique(b[np.round(np.geomspace(1, b.size, 32)).astype(int) - 1])
    # candidates: the flat line, one knee (c2 = 0) at each probe, two knees at each pair
    k1, k2 = np.triu_indices(knees.size, 1)
    first = np.concatenate([knees, knees[k1]])
    second = np.concatenate([np.full(knees.size, np.inf), knees[k2]])
    x = np.stack(
        [
            np.ones((first.size, b.size)),
            np.maximum(0.0, b[None, :] - first[:, None]),
            np.maximum(0.0, b[None, :] - second[:, None]),  # all 0 for one knee
        ],
        axis=2,
    )  # [candidates, probes, 3]
    one = np.arange(first.size) < knees.size
    xw = x * w[None, :, None]
    gram = np.einsum("pni,pnj->pij", xw, x)
    gram[one, 2, 2] = 1.0  # one knee: c2 solves to 0
    coef = np.linalg.solve(gram + 1e-18 * np.eye(3), np.einsum("pni,n->pi", xw, t)[..., None])[..., 0]
    err = np.sum(w * (t[None, :] - np.einsum("pni,pi->pn", x, coef)) ** 2, axis=1)
    ok = (coef[:, 0] > 0) & (coef[:, 1] >= 0) & (coef[:, 2] >= 0) & np.isfinite(err)
    t_flat = float(np.sum(w * t) / np.sum(w))  # the flat line: always a candidate
    best = (float(np.sum(w * (t - t_flat) ** 2)), t_flat, 0.0, 1.0, 0.0, 1.0)
    if ok.any():
        i = int(np.argmin(np.where(ok, err, np.inf)))
        if err[i] < best[0]:
            t0, c1, c2 = (float(v) for v in coef[i])
            knee2 = float(second[i]) if c2 > 0 else float(first[i])
            best = (float(err[i]), t0, c1, float(first[i]), c2, knee2)
    _, t0, c1, k1_at, c2, k2_at = best
    dense = np.arange(1, table.max_batch_tokens + 1, dtype=np.float64)
    seconds = t0 + c1 * np.maximum(0.0, dense - k1_at) + c2 * np.maximum(0.0, dense - k2_at)
    return SpsCostTable(
        tuple(range(1, table.max_batch_tokens + 1)), tuple((1.0 / seconds).tolist()), table.max_batch_tokens
    )


def probe_batch_sizes(max_batch_tokens: int) -> list[int]:
    """Probe points for profiling: powers of two up to ``max_batch_tokens`` plus the
    quarter points between consecutive powers from 8 up (where kernels change tiles),
    always including 1..8 and ``max_batch_tokens`` itself."""
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    points = set(range(1, min(8, max_batch_tokens) + 1))
    p = 8
    while p <= max_batch_tokens:
        points.update(p + (p * q) // 4 for q in range(4))
        p *= 2
    points.add(max_batch_tokens)
    return sorted(x for x in points if x <= max_batch_tokens)


def plot_sps_table(table: SpsCostTable, png_path: str | Path, title: str | None = None) -> Path:
    """Write a PNG: SPS(B) as a step curve (left axis) and B*SPS(B) tokens/s (right axis)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    xs = list(table.sample_batch_tokens)
    ys = list(table.sample_steps_per_sec)
    edge_x = xs + [table.max_batch_tokens]
    edge_y = ys + [ys[-1]]
    fig = Figure(figsize=(8, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.step(edge_x, edge_y, where="post", color="tab:blue", label="SPS(B) (lookup)")
    ax.plot(xs, ys, "o", color="tab:blue", markersize=3)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch tokens B")
    ax.set_ylabel("verify steps / s", color="tab:blue")
    ax.grid(True, which="both", alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(xs, [b * s for b, s in zip(xs, ys, strict=True)], "-", color="tab:orange", label="B·SPS(B)")
    ax2.set_ylabel("batch tokens / s", color="tab:orange")
    ax.set_title(title or f"SPS cost table ({len(xs)} probes, max {table.max_batch_tokens})")
    fig.tight_layout()
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
