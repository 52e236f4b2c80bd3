"""Online recalibration: the calibration file corrected by the server's own verified rounds.

A calibration file is fit on the prompts it was recorded on; traffic it has not seen accepts
differently. On 444 held-out prompts (code, chat, math) the shipped demo calibration, whose
cross-validated ECE on its own prompts is <= 2.1% per position, measured 2.2-5.5% at temperature
0, 1.2-12.0% at 0.3, 0.7-3.8% at 0.7 and 1.3-8.0% at 1.0 (`dspark calibrate --evaluate`,
docs/benchmarks.md). Every verified round says, for each position it verified, whether that many
drafts were accepted: the same evidence the file was fit on, about the traffic being served.

``OnlineCalibration`` keeps, per sampling regime of the file and per draft position, a window of
the last ``window`` observed (file survival a_k, accepted >= k) pairs, and refits a reliability
map on it: equal-count bins of a_k, isotonic realised frequencies, knots at the bins' mean a_k
(``reliability_knots``, the file's own stage-2 fit). The planner then plans on the map applied to
the file's survival, made non-increasing in k again. A position with fewer than ``min_samples``
observations in the window keeps the file's value, so a fresh server plans exactly as the file
says. The map reads a_k only, never the token it prices, and positions a round did not verify are
not observed: the planner's choice depends on a_k alone, so that selection leaves the realised
rate at a given a_k unbiased (as in ``CalibrationDriftTracker``).

Window 1024 and 8 bins were chosen by replaying the held-out rounds in their recorded order,
each step planned on the maps fit before it (prequential ECE, per position, in %; `dspark
calibrate --evaluate`, docs/benchmarks/ece_held_out_session20.md): temperature 0: 1.1-2.3
(file 2.2-5.5), 0.3: 0.2-1.7 (1.2-12.0), 0.7: 0.1-0.9 (0.7-3.8), 1.0: 0.0-1.2 (1.3-8.0). Longer
windows follow a change of traffic more slowly (2048 and 4096: at most 3.6 and 4.7 at
temperature 0); a per-position logistic correction instead of the map left 3.7-4.7 at 0.

The windows are ``CalibrationDriftTracker``s, one per regime (the drift tracker's ring of
(predicted, realised) per position, here of the file's survival rather than the plan's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .calibration import reliability_knots
from .live import CalibrationDriftTracker
from .piecewise import ColumnInterp


@dataclass(frozen=True)
class OnlineCalibrationConfig:
    window: int = 1024  # observations kept per regime and position
    bins: int = 8  # equal-count bins of the reliability map
    min_samples: int = 256  # observations before a position's map is used
    refit_every: int = 64  # rounds recorded between refits
    min_refit_interval_s: float = 0.25  # and at most this often (a refit costs ~1 ms per regime)


class OnlineCalibration:
    """Reliability maps per (regime, position) refit on a sliding window of verified rounds.

    ``regimes``: the calibration file's sampling temperatures (its regime keys, ascending); a
    row is corrected by the map of the regime nearest its temperature (ties to the lower key).
    """

    def __init__(
        self, gamma: int, regimes: tuple[float, ...], config: OnlineCalibrationConfig | None = None
    ) -> None:
        if gamma < 1 or not regimes:
            raise ValueError("gamma must be >= 1 and there must be at least one regime")
        self.config = config or OnlineCalibrationConfig()
        if self.config.window < self.config.min_samples or self.config.bins < 1:
            raise ValueError("window must hold min_samples and bins must be >= 1")
        self.gamma = gamma
        self.regimes = np.asarray(sorted(regimes), dtype=np.float64)
        m = len(self.regimes)
        self._windows = [CalibrationDriftTracker(gamma, self.config.window) for _ in range(m)]
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending_rows = 0
        self._fitted_at = -np.inf
        self._active = False
        self._stale: set[int] = set()  # regimes with rounds filed since their maps were fit
        # knots per (regime, position): None = the file's value as it is
        self._maps: list[list[tuple[np.ndarray, np.ndarray] | None]] = [[None] * gamma for _ in range(m)]
        # per regime, the positions that have a map and those maps in one ColumnInterp
        self._interp: list[tuple[list[int], ColumnInterp] | None] = [None] * m
        self.refits = 0

    def regime_index(self, temperatures: np.ndarray) -> np.ndarray:
        """[R] sampling temperatures -> [R] index of the nearest regime (ties to the lower)."""
        t = np.asarray(temperatures, dtype=np.float64).reshape(-1)
        if len(self.regimes) == 1:
            return np.zeros(t.shape, dtype=np.int64)
        return np.abs(t[:, None] - self.regimes[None, :]).argmin(axis=1)

    def active(self) -> bool:
        """Whether any map is in use (a fresh instance corrects nothing)."""
        return self._active

    def correct(self, survival: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
        """[R, γ] the file's prefix survival -> the survival to plan on (a new array)."""
        out = np.array(survival, dtype=np.float64, copy=True)
        if not self._active or out.shape[0] == 0:
            return out
        idx = self.regime_index(temperatures)
        if out.shape[0] == 1:  # one request: γ values in plain floats (numpy calls cost more)
            out[0] = self._correct_row(out[0].tolist(), int(idx[0]))
            return out
        first = int(idx[0])
        if bool((idx == first).all()):  # the common case: one regime for the whole step
            groups: list[tuple[int, slice | np.ndarray]] = [(first, slice(None))]
        else:
            groups = [(m, idx == m) for m in np.unique(idx).tolist()]
        for m, rows in groups:
            stacked = self._interp[m]
            if stacked is not None:
                cols, interp = stacked
                sub = out[rows]
                sub[:, cols] = interp(sub[:, cols])
                out[rows] = sub
        np.minimum.accumulate(out, axis=1, out=out)
        return out

    def _correct_row(self, row: list[float], m: int) -> list[float]:
        stacked = self._interp[m]
        if stacked is not None:
            for c, k in enumerate(stacked[0]):
                row[k] = stacked[1].scalar(c, row[k])
        for k in range(1, len(row)):
            row[k] = min(row[k], row[k - 1])
        return row

    @staticmethod
    def _stacked(maps: list[tuple[np.ndarray, np.ndarray] | None]) -> tuple[list[int], ColumnInterp] | None:
        cols = [k for k, knots in enumerate(maps) if knots is not None]
        if not cols:
            return None
        return cols, ColumnInterp([(maps[k][0].tolist(), maps[k][1].tolist()) for k in cols])  # type: ignore[index]

    def record(
        self, survival: np.ndarray, temperatures: np.ndarray, accepted: np.ndarray, lens: np.ndarray
    ) -> bool:
        """One step's rounds: the file's survival [R, γ] the rows were planned from (before
        ``correct``), their temperatures, drafts accepted and verified [R]. Positions 1..ℓ_r are
        observed. The rounds wait in a list until the next refit is due (a step pays an append,
        not the window's bookkeeping). Returns whether the maps were refit."""
        pred = np.asarray(survival, dtype=np.float64)
        acc = np.asarray(accepted).reshape(-1)
        ell = np.asarray(lens).reshape(-1)
        if pred.ndim != 2 or pred.shape[1] != self.gamma or not (pred.shape[0] == acc.size == ell.size):
            raise ValueError(f"survival must be [R, {self.gamma}] with R accepted counts and lengths")
        if pred.shape[0] == 0:
            return False
        self._pending.append((pred, np.asarray(temperatures, dtype=np.float64).reshape(-1), acc, ell))
        self._pending_rows += pred.shape[0]
        cfg = self.config
        if self._pending_rows < cfg.refit_every:
            return False
        now = time.perf_counter()
        if now - self._fitted_at < cfg.min_refit_interval_s:
            if self._pending_rows >= cfg.window:  # file them meanwhile: the list stays bounded
                self._file_pending()
            return False
        self._fitted_at = now
        self._file_pending()
        stale, self._stale = sorted(self._stale), set()
        for m in stale:
            for k in range(self.gamma):
                self._maps[m][k] = self._fit(m, k)
            self._interp[m] = self._stacked(self._maps[m])
        self._active = any(knots is not None for row in self._maps for knots in row)
        self.refits += 1
        return True

    def _file_pending(self) -> None:
        """Write the waiting rounds into the windows; their regimes' maps are stale."""
        pred = np.concatenate([p for p, _, _, _ in self._pending])
        idx = self.regime_index(np.concatenate([t for _, t, _, _ in self._pending]))
        acc = np.concatenate([a for _, _, a, _ in self._pending])
        ell = np.concatenate([e for _, _, _, e in self._pending])
        self._pending, self._pending_rows = [], 0
        touched = np.unique(idx).tolist()
        self._stale.update(touched)
        for m in touched:
            rows = idx == m
            self._windows[m].record_arrays(pred[rows], acc[rows], ell[rows])

    def _fit(self, m: int, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        pred, real = self._windows[m].observations(k)
        if pred.size < self.config.min_samples:
            return None
        xs, ys = reliability_knots(torch.from_numpy(pred), torch.from_numpy(real), self.config.bins)
        return np.asarray(xs), np.asarray(ys)

    def maps(self) -> dict[tuple[float, int], tuple[tuple[float, ...], tuple[float, ...]]]:
        """The maps in use: (regime, position 1..γ) -> (knots a_k, corrected a_k)."""
        out = {}
        for m, row in enumerate(self._maps):
            for k, knots in enumerate(row):
                if knots is not None:
                    out[(float(self.regimes[m]), k + 1)] = (
                        tuple(knots[0].tolist()),
                        tuple(knots[1].tolist()),
                    )
        return out
