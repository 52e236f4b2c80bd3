"""Packed float32 copies of the fused forwards' GEMM weights (kernels/linear_f32.cpp).

A weight ``wt`` [K, N] (the serving layout's contiguous transpose, or a column slice of one) is
copied into column panels of ``PANEL`` columns, the last one 8 or 16 wide when N is not a
multiple of 24, each panel contiguous row after row (``[N / 24, K, 24]`` then ``[K, tail]``,
flattened): at the few rows of decoding and verification the kernel then reads every panel as
one stream, which the strided serving layout did not allow (kernels/linear_f32.cpp has the
timings). The serving layout stays for the BLAS sgemm of larger batches and for the PyTorch
paths, so a float32 model served by the fused forwards holds its GEMM weights twice;
``DSPARK_F32_GEMM=blas`` keeps no copies and runs the sgemm at every batch size.
"""

from __future__ import annotations

import ctypes
import os

import torch

PANEL = 24  # columns per panel (three 8-lane vectors)
LANES = 8  # N must be a multiple of this


def kernel_serves(lib: ctypes.CDLL | None) -> bool:
    """Whether the fused forwards keep packed copies for the kernel: the library has it (AVX2 +
    FMA) and ``DSPARK_F32_GEMM`` is not ``blas``."""
    if lib is None or not lib.dspark_has_linear_f32():
        return False
    return os.environ.get("DSPARK_F32_GEMM", "").strip().lower() != "blas"


def fits(wt: torch.Tensor) -> bool:
    """Whether the kernel takes this [K, N] weight: N a multiple of 8."""
    return int(wt.shape[1]) % LANES == 0


def packed(wt: torch.Tensor) -> torch.Tensor:
    """[K, N] float32 (any strides) -> the panels, one contiguous float32 vector of K * N."""
    k, n = (int(s) for s in wt.shape)
    if wt.dtype != torch.float32 or not fits(wt):
        raise ValueError(
            f"a packed float32 weight needs float32 and N a multiple of {LANES}, got {wt.dtype} {k} x {n}"
        )
    full = n // PANEL * PANEL
    body = wt[:, :full].reshape(k, full // PANEL, PANEL).permute(1, 0, 2).reshape(-1)
    tail = wt[:, full:].reshape(-1)
    return torch.cat([body, tail]).detach().contiguous()
