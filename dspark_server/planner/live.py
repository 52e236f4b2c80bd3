"""Online upkeep of the planner's inputs while serving.

``LiveSpsTable`` blends measured verify-step times into the profiled SPS table;
``CalibrationDriftTracker`` compares predicted prefix survival with what verification
actually showed, per draft position. Both are thread-safe (the engine records, a metrics
endpoint reads).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .sps import SpsCostTable


@dataclass(frozen=True)
class LiveSpsPoint:
    """One probe of the live curve, for metrics export."""

    batch_tokens: int
    base_steps_per_sec: float
    live_steps_per_sec: float
    num_samples: int
    measured_steps_per_sec: float | None  # 1 / median of the window; None without samples


class LiveSpsTable:
    """A profiled :class:`SpsCostTable` refreshed from live step timings.

    A step over B tokens is filed under the probe whose value the planner uses for B (the
    largest probe <= B, clamped to the table). Each probe keeps its last ``window`` step
    times; its live value is

        (1 - w) * base + w * measured,   w = max_weight * min(1, n / samples_for_full_weight)

    with measured = 1 / median(window), and the result clamped into
    [base / clamp_factor, base * clamp_factor]. The median shrugs off stalls (a GC pause,
    a prefill sharing the step), the clamp bounds what a broken timer can do, and the
    probes themselves never move, so the table stays strictly increasing.
    """

    def __init__(
        self,
        base: SpsCostTable,
        *,
        window: int = 64,
        samples_for_full_weight: int = 32,
        max_weight: float = 0.8,
        clamp_factor: float = 4.0,
        enabled: bool = True,
    ) -> None:
        if window < 1 or samples_for_full_weight < 1:
            raise ValueError("window and samples_for_full_weight must be >= 1")
        if not 0.0 <= max_weight <= 1.0:
            raise ValueError(f"max_weight must be in [0, 1], got {max_weight}")
        if clamp_factor < 1.0:
            raise ValueError(f"clamp_factor must be >= 1, got {clamp_factor}")
        self._base = base
        self._samples_for_full_weight = samples_for_full_weight
        self._max_weight = max_weight
        self._clamp_factor = clamp_factor
        self._enabled = enabled
        self._windows: list[deque[float]] = [deque(maxlen=window) for _ in base.sample_batch_tokens]
        self._lock = threading.Lock()
        self._cached: SpsCostTable | None = None

    @property
    def base(self) -> SpsCostTable:
        return self._base

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        with self._lock:
            self._enabled = bool(value)
            self._cached = None

    def record(self, batch_tokens: int, step_seconds: float) -> bool:
        """File one verify step; returns False (and ignores it) when disabled or the time is
        not a finite positive number."""
        if not self._enabled or not math.isfinite(step_seconds) or step_seconds <= 0 or batch_tokens < 1:
            return False
        idx = self._base.probe_index(batch_tokens)
        with self._lock:
            self._windows[idx].append(float(step_seconds))
            self._cached = None
        return True

    def record_many(self, batch_tokens: int, step_seconds: Sequence[float]) -> None:
        """``record`` for steps of the same batch size, in order (one lock, one lookup)."""
        if not self._enabled or batch_tokens < 1:
            return
        kept = [float(x) for x in step_seconds if math.isfinite(x) and x > 0]
        if not kept:
            return
        idx = self._base.probe_index(batch_tokens)
        with self._lock:
            self._windows[idx].extend(kept)
            self._cached = None

    def reset(self) -> None:
        with self._lock:
            for w in self._windows:
                w.clear()
            self._cached = None

    def _live_value(self, base_sps: float, window: deque[float]) -> tuple[float, float | None]:
        if not window:
            return base_sps, None
        measured = 1.0 / statistics.median(window)
        weight = self._max_weight * min(1.0, len(window) / self._samples_for_full_weight)
        blended = (1.0 - weight) * base_sps + weight * measured
        lo, hi = base_sps / self._clamp_factor, base_sps * self._clamp_factor
        return min(max(blended, lo), hi), measured

    def _curve_locked(self) -> list[LiveSpsPoint]:
        points = []
        for b, base_sps, window in zip(
            self._base.sample_batch_tokens, self._base.sample_steps_per_sec, self._windows, strict=True
        ):
            live, measured = self._live_value(base_sps, window) if self._enabled else (base_sps, None)
            points.append(LiveSpsPoint(b, base_sps, live, len(window), measured))
        return points

    def curve(self) -> list[LiveSpsPoint]:
        """Per probe: base, live and measured SPS and the sample count (for Prometheus)."""
        with self._lock:
            return self._curve_locked()

    def current_table(self) -> SpsCostTable:
        """The table the planner should use now (the base table while disabled). Rebuilt only
        after new samples arrive."""
        with self._lock:
            if self._cached is None:
                if self._enabled:
                    live = [p.live_steps_per_sec for p in self._curve_locked()]
                    self._cached = self._base.with_steps_per_sec(live)
                else:
                    self._cached = self._base
            return self._cached


@dataclass(frozen=True)
class PositionDrift:
    """Calibration at one draft position k (1-based) over the tracker's window."""

    position: int
    count: int
    mean_predicted: float  # mean predicted survival a_k; NaN when count == 0
    mean_realised: float  # fraction of rounds whose first k drafts were all accepted
    gap: float  # mean_predicted - mean_realised (> 0: over-confident)


class CalibrationDriftTracker:
    """Sliding window, per draft position, of (predicted survival a_k, realised 0/1).

    Only positions that were verified say anything: for a request verified with l_r drafts,
    positions 1..l_r are observed (realised = accepted >= k); later ones are skipped. The
    planner's choice depends on a_k, not on the outcome, so this selection does not bias
    the realised rate at a given predicted value.
    """

    def __init__(self, gamma: int, window: int = 4096) -> None:
        if gamma < 1 or window < 1:
            raise ValueError("gamma and window must be >= 1")
        self._gamma = gamma
        self._window = window
        self._pred = np.zeros((gamma, window), dtype=np.float64)
        self._real = np.zeros((gamma, window), dtype=np.float64)
        self._count = np.zeros(gamma, dtype=np.int64)  # samples ever written (ring position)
        self._lock = threading.Lock()

    @property
    def gamma(self) -> int:
        return self._gamma

    def record(
        self,
        predicted_survival: torch.Tensor,
        accepted: torch.Tensor,
        verify_lens: torch.Tensor | None = None,
    ) -> None:
        """``predicted_survival`` [R, gamma] a(r, k) used by the planner; ``accepted`` [R]
        drafts accepted; ``verify_lens`` [R] drafts verified (None: all gamma)."""
        pred = predicted_survival.detach().to("cpu", torch.float64).numpy()
        acc = accepted.detach().to("cpu", torch.int64).numpy().reshape(-1)
        lens = (
            None if verify_lens is None else verify_lens.detach().to("cpu", torch.int64).numpy().reshape(-1)
        )
        self.record_arrays(pred, acc, lens)

    def record_arrays(self, pred: np.ndarray, acc: np.ndarray, lens: np.ndarray | None = None) -> None:
        """``record`` on numpy arrays (the engine's per-step path)."""
        if pred.ndim != 2 or pred.shape[1] != self._gamma:
            raise ValueError(f"predicted_survival must be [R, {self._gamma}], got {pred.shape}")
        acc = acc.reshape(-1)
        lens = np.full(acc.shape, self._gamma, dtype=np.int64) if lens is None else lens.reshape(-1)
        if acc.shape[0] != pred.shape[0] or lens.shape[0] != pred.shape[0]:
            raise ValueError("predicted_survival, accepted and verify_lens disagree on R")
        observed = lens[:, None] > np.arange(self._gamma)[None, :]  # [R, gamma]
        per_position = observed.sum(axis=0)
        with self._lock:
            if int(per_position.max(initial=0)) > self._window:  # more than a window at once
                for k in range(self._gamma):
                    self._append(k, pred[observed[:, k], k], (acc[observed[:, k]] > k).astype(np.float64))
                return
            rows, cols = np.nonzero(observed)  # one ring write for every observed (r, k)
            rank = (np.cumsum(observed, axis=0) - 1)[rows, cols]
            slots = (self._count[cols] + rank) % self._window
            self._pred[cols, slots] = pred[rows, cols]
            self._real[cols, slots] = acc[rows] > cols
            self._count += per_position

    def _append(self, k: int, pred: np.ndarray, real: np.ndarray) -> None:
        n = pred.shape[0]
        if n == 0:
            return
        if n > self._window:
            pred, real, n = pred[-self._window :], real[-self._window :], self._window
        slots = (self._count[k] + np.arange(n)) % self._window
        self._pred[k, slots] = pred
        self._real[k, slots] = real
        self._count[k] += n

    def observations(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Position ``k``'s window (0-based): the predicted survival and the realised 0/1 of its
        observations in ring order (copies)."""
        with self._lock:
            n = int(min(self._count[k], self._window))
            return self._pred[k, :n].copy(), self._real[k, :n].copy()

    def summary(self) -> list[PositionDrift]:
        with self._lock:
            out = []
            for k in range(self._gamma):
                n = int(min(self._count[k], self._window))
                if n == 0:
                    out.append(PositionDrift(k + 1, 0, math.nan, math.nan, math.nan))
                    continue
                mp = float(self._pred[k, :n].mean())
                mr = float(self._real[k, :n].mean())
                out.append(PositionDrift(k + 1, n, mp, mr, mp - mr))
            return out

    def reset(self) -> None:
        with self._lock:
            self._count[:] = 0
