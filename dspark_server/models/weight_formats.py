"""How a fused call keeps its GEMM weights (kernels/gemm.h's ``WeightFormat``), and the addresses
of one weight in that format.

- float32: the serving layout itself, with a copy packed for linear_f32.cpp's kernel of a few
  rows where that kernel builds (f32_weights.py); the BLAS sgemm serves larger calls.
- bfloat16: one packed bf16 copy (bf16_weights.py) serves every call, on CPUs with AVX512-BF16.
- int8: a packed int8 copy with per-column scales (int8_weights.py) serves calls of up to
  ``kInt8Rows`` rows (decoding: the drafter's block pass and context writes), a packed bf16 copy
  the larger ones (prompt context writes); on CPUs with AVX512-VNNI and AVX512-BF16. Offered for
  the drafter only (``--draft-weight-dtype``): its precision moves which tokens it drafts, never
  which tokens the target's verification emits.

The model keeps its float32 weights in every format; activations stay float32.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from enum import IntEnum

import torch

from dspark_server.models import bf16_weights, f32_weights, int8_weights


class WeightFormat(IntEnum):
    FLOAT32 = 0
    BF16 = 1
    INT8 = 2


_DTYPES = {
    WeightFormat.FLOAT32: torch.float32,
    WeightFormat.BF16: torch.bfloat16,
    WeightFormat.INT8: torch.int8,
}


def bf16_supported(lib: ctypes.CDLL | None) -> bool:
    """Whether weight-only bf16 GEMMs run here (the kernel library on a CPU with AVX512-BF16)."""
    return lib is not None and bool(lib.dspark_has_bf16())


def int8_supported(lib: ctypes.CDLL | None) -> bool:
    """Whether weight-only int8 GEMMs run here (AVX512-VNNI for them, AVX512-BF16 for the calls of
    many rows)."""
    return bf16_supported(lib) and bool(lib.dspark_has_int8())  # type: ignore[union-attr]


def chosen_format(
    lib: ctypes.CDLL | None, weight_dtype: torch.dtype, mats: Sequence[torch.Tensor]
) -> WeightFormat:
    """The format ``weight_dtype`` asks for where this CPU and every [K, N] weight of ``mats``
    allow it, else float32."""
    if weight_dtype == torch.int8 and int8_supported(lib) and all(int8_weights.fits(m) for m in mats):
        return WeightFormat.INT8
    if weight_dtype == torch.bfloat16 and bf16_supported(lib) and all(bf16_weights.fits(m) for m in mats):
        return WeightFormat.BF16
    return WeightFormat.FLOAT32


def format_dtype(fmt: WeightFormat) -> torch.dtype:
    return {
        WeightFormat.FLOAT32: torch.float32,
        WeightFormat.BF16: torch.bfloat16,
        WeightFormat.INT8: torch.int8,
    }[fmt]


def gemm_addresses(
    wt: torch.Tensor, fmt: WeightFormat, packed_f32: bool, held: list[torch.Tensor]
) -> tuple[int, int]:
    """The two addresses a fused call's GEMM reads for the [K, N] weight ``wt`` (kernels/gemm.h):
    in float32 ``wt`` itself and its copy packed for linear_f32.cpp (0 unless ``packed_f32`` and
    the shape fits the kernel: the sgemm then serves every M); in bf16 its packed bf16 copy and 0;
    in int8 its int8 buffer and its packed bf16 copy. Copies are kept in ``held``."""
    if fmt == WeightFormat.INT8:
        held += [int8_weights.packed(wt), bf16_weights.packed(wt)]
        return held[-2].data_ptr(), held[-1].data_ptr()
    if fmt == WeightFormat.BF16:
        held.append(bf16_weights.packed(wt))
        return held[-1].data_ptr(), 0
    held.append(wt)
    if not (packed_f32 and f32_weights.fits(wt)):
        return wt.data_ptr(), 0
    held.append(f32_weights.packed(wt))
    return wt.data_ptr(), held[-1].data_ptr()
