"""Per-column piecewise-linear maps: one np.interp call for a whole array, and one value."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_server.planner.piecewise import ColumnInterp


def test_columns_map_as_np_interp_on_their_own_knots_inside_and_outside() -> None:
    rng = np.random.default_rng(3)
    knots = []
    for _ in range(6):
        xs = np.sort(rng.uniform(-3, 3, size=int(rng.integers(1, 9))))
        if xs.size > 2:
            xs[1] = xs[2]  # a repeated knot, as equal-count bins of tied values give
        knots.append((xs.tolist(), np.sort(rng.uniform(0, 1, size=xs.size)).tolist()))
    interp = ColumnInterp(knots)
    x = rng.uniform(-5, 5, size=(50, 6))
    x[0] = [k[0][0] for k in knots]  # on the first knots exactly
    x[1] = [k[0][-1] for k in knots]  # on the last ones
    expected = np.stack([np.interp(x[:, c], *map(np.asarray, knots[c])) for c in range(6)], axis=1)
    np.testing.assert_allclose(interp(x), expected, rtol=0, atol=1e-12)
    for r in range(50):
        for c in range(6):
            assert interp.scalar(c, float(x[r, c])) == pytest.approx(expected[r, c], abs=1e-12)
            assert interp.column(c, x[r : r + 1, c])[0] == expected[r, c]


def test_bad_knots_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one column"):
        ColumnInterp([])
    with pytest.raises(ValueError, match="must not decrease"):
        ColumnInterp([([0.0, 1.0, 0.5], [0.0, 0.5, 1.0])])
    with pytest.raises(ValueError, match="knots"):
        ColumnInterp([([0.0, 1.0], [0.0])])
