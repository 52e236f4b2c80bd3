"""row_argmax / take_rows return exactly what the PyTorch expressions they replace return."""

from __future__ import annotations

import pytest
import torch

from dspark_server.models.row_ops import row_argmax, take_rows


def _hard_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 6144, generator=g)
    x[1, 7] = x[1, 4000] = x[1].max() + 1.0  # a tie: the first index wins
    x[2, 100] = float("nan")  # NaN counts as maximal
    x[2, 50] = float("nan")
    x[3] = float("-inf")  # all -inf: index 0
    x[4, :] = 0.0  # all equal: index 0
    x[5, -1] = float("inf")
    x[6, 0] = x[6].max() + 1.0  # maximum at the first column
    return x


def test_row_argmax_equals_torch_argmax_on_ties_nan_and_inf() -> None:
    x = _hard_rows()
    got = row_argmax(x)
    assert got.dtype == torch.long
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert got[1].item() == 7 and got[2].item() == 50 and got[3].item() == 0


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x[::2],  # non-contiguous rows
        lambda x: x[:, ::3],  # non-contiguous columns
        lambda x: x.reshape(3, 3, -1),  # three dimensions
        lambda x: x[0],  # one row
        lambda x: x.to(torch.bfloat16),  # the PyTorch fallback
        lambda x: x.double(),
    ],
)
def test_row_argmax_on_views_and_dtypes(view) -> None:  # type: ignore[no-untyped-def]
    x = view(_hard_rows())
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("shape", [(5,), (2, 3), (0,)])
def test_take_rows_equals_advanced_indexing(shape: tuple[int, ...]) -> None:
    x = torch.randn(11, 4, 6)
    index = torch.randint(0, 11, shape)
    assert torch.equal(take_rows(x, index), x[index])
