"""Weight-only int8 copies of a drafter's GEMM weights (kernels/linear_int8.cpp).

A weight ``wt`` [K, N] (the serving layout's contiguous transpose) is quantized per output column
(symmetric: the column's largest magnitude -> 127, round to nearest) and packed for the kernel as
the bf16 layout is (bf16_weights.py): blocks of 32 columns, each block contiguous, in pairs along
K (``[N / 32, K / 2, 32, 2]``), one 64-byte line per K pair. The N float32 scales come first in
the same buffer, so the kernel takes one address. Half the bytes of bf16: the drafter's block pass
and context writes read every weight once per step for a few rows, and those reads are its cost.
"""

from __future__ import annotations

import torch

from dspark_server.models import bf16_weights

BLOCK = bf16_weights.BLOCK


def fits(wt: torch.Tensor) -> bool:
    """Whether the kernel takes this [K, N] weight: K even, N a multiple of ``BLOCK``."""
    return bf16_weights.fits(wt)


def quantized(wt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[K, N] float -> (int8 [K, N], float32 scales [N]): ``wt`` ~= q * scales."""
    w = wt.detach().float()
    amax = w.abs().amax(dim=0)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return q, scales


def packed(wt: torch.Tensor) -> torch.Tensor:
    """[K, N] float -> one int8 buffer: N float32 scales, then [N / 32, K / 2, 32, 2] int8."""
    k, n = wt.shape
    if not fits(wt):
        raise ValueError(f"a packed int8 weight needs K even and N a multiple of {BLOCK}, got {k} x {n}")
    q, scales = quantized(wt)
    return torch.cat([scales.contiguous().view(torch.int8), bf16_weights.pair_blocks(q).reshape(-1)])


def dequantized(wt: torch.Tensor) -> torch.Tensor:
    """The float32 weight the int8 kernel multiplies by (for tests and error bounds)."""
    q, scales = quantized(wt)
    return q.float() * scales
