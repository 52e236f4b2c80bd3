"""Piecewise-linear maps, one per column, applied to a whole [R, C] array in one ``np.interp``.

The calibration maps (``SurvivalMap``) and the online correction (``OnlineCalibration``) map each
draft position's value through that position's knots, flat outside them. Position by position
that is γ numpy calls a step; here every column's knots lie on one axis, column c's shifted past
column c-1's, and the inputs are clipped to their own column's knots first, so one call maps the
array. ``scalar`` is the same map on one float (``np.interp``'s arithmetic, in plain Python): at
one request a step maps γ values, and a numpy call costs more than the arithmetic.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np


class ColumnInterp:
    """Column c's map: piecewise-linear through ``knots[c]`` = (xs, ys), xs non-decreasing."""

    def __init__(self, knots: Sequence[tuple[Sequence[float], Sequence[float]]]) -> None:
        if not knots:
            raise ValueError("ColumnInterp needs at least one column")
        xs_all = [[float(x) for x in xs] for xs, _ in knots]
        ys_all = [[float(y) for y in ys] for _, ys in knots]
        for c, (xs, ys) in enumerate(zip(xs_all, ys_all, strict=True)):
            if not xs or len(xs) != len(ys):
                raise ValueError(f"column {c}: {len(xs)} knots x, {len(ys)} knots y")
            if any(b < a for a, b in zip(xs, xs[1:], strict=False)):
                raise ValueError(f"column {c}: knot x values must not decrease")
        self.xs, self.ys = xs_all, ys_all
        lo = np.array([xs[0] for xs in xs_all])
        hi = np.array([xs[-1] for xs in xs_all])
        self._lo, self._hi = lo, hi
        self._shift = np.concatenate([[0.0], np.cumsum(hi - lo + 1.0)[:-1]]) - lo
        self._xs = np.concatenate([np.asarray(xs) + self._shift[c] for c, xs in enumerate(xs_all)])
        self._ys = np.concatenate([np.asarray(ys) for ys in ys_all])
        self._arrays = [(np.asarray(xs), np.asarray(ys)) for xs, ys in zip(xs_all, ys_all, strict=True)]

    @property
    def columns(self) -> int:
        return len(self.xs)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """[R, C] float64 -> [R, C]: column c through column c's map."""
        return np.interp(np.clip(x, self._lo, self._hi) + self._shift, self._xs, self._ys)

    def column(self, c: int, x: np.ndarray) -> np.ndarray:
        """Column c's map on any array of inputs (``np.interp`` on its own knots)."""
        xs, ys = self._arrays[c]
        return np.interp(x, xs, ys)

    def scalar(self, c: int, x: float) -> float:
        """Column c's map on one value, as ``np.interp`` computes it."""
        xs, ys = self.xs[c], self.ys[c]
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        j = bisect_right(xs, x) - 1
        x0, x1, y0, y1 = xs[j], xs[j + 1], ys[j], ys[j + 1]
        if x1 == x0:
            return y0
        return (y1 - y0) / (x1 - x0) * (x - x0) + y0
