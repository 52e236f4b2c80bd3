"""Weight-only bfloat16 copies of the fused forward's GEMM weights (kernels/linear_bf16.cpp).

A weight ``wt`` [K, N] (the serving layout's contiguous transpose) is kept once in bf16, packed
for the kernel: blocks of 32 columns, each block contiguous, in pairs along K
(``[N / 32, K / 2, 32, 2]``), the pairs AVX512-BF16's dot product multiplies and, each half
of a block at a 128-byte stride, the B tiles of AMX's TDPBF16PS (kernels/linear_bf16_amx.cpp).
The kernel serves every batch size (MKL's own bf16 GEMM is several times slower on AMD CPUs:
kernels/gemm.h).

Rounding is PyTorch's float32 -> bfloat16 conversion (round to nearest even), the same as the
kernels apply to the activations.
"""

from __future__ import annotations

import torch

BLOCK = 32  # columns per packed block (two 16-lane vectors)


def fits(wt: torch.Tensor) -> bool:
    """Whether the kernels take this [K, N] weight: K even, N a multiple of ``BLOCK``."""
    k, n = wt.shape
    return k % 2 == 0 and n % BLOCK == 0


def pair_blocks(wt: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [N / 32, K / 2, 32, 2], contiguous, in ``wt``'s dtype: the packed layout (also
    the int8 copies', int8_weights.py). The caller checks ``fits``."""
    k, n = wt.shape
    return wt.reshape(k // 2, 2, n // BLOCK, BLOCK).permute(2, 0, 3, 1).contiguous()


def packed(wt: torch.Tensor) -> torch.Tensor:
    """[K, N] float32 -> [N / 32, K / 2, 32, 2] bfloat16, contiguous."""
    k, n = wt.shape
    if not fits(wt):
        raise ValueError(f"a packed bf16 weight needs K even and N a multiple of {BLOCK}, got {k} x {n}")
    return pair_blocks(wt).to(torch.bfloat16)
