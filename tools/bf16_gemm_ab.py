"""Weight-only bf16 GEMM throughput by row count: the packed AVX512-BF16 kernel the fused forwards
run (kernels/linear_bf16.cpp; its dot, fma and, on CPUs with AMX-BF16, amx loops) against MKL's
``gemm_bf16bf16f32`` and float32 sgemm, the two BLAS routines in PyTorch's own MKL.

    python -m tools.bf16_gemm_ab --rows 1 8 32 64 160 512 --k 2048 --n 9216 --threads 2

Prints GFLOP/s per row count for each, interleaved (each routine's median of ``--repeats`` timed
calls, one routine after the other at each row count). The figures behind serving every bf16 GEMM,
prefill chunks included, from the packed kernel (kernels/gemm.h). A diagnostic: it needs the kernel
library and an AVX512-BF16 CPU, and MKL's bf16 symbol (absent from non-MKL builds of PyTorch).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import time
from collections.abc import Callable

import torch

from dspark_server.models import bf16_weights
from dspark_server.models.kernel_library import load_library, torch_blas_symbol
from dspark_server.models.weight_formats import bf16_supported

_Fortran = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 13)


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _blas(fn: Callable[..., None], w: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """out[M, N] = x[M, K] @ w[K, N] through a Fortran column-major gemm (sgemm's arguments)."""
    m, k = x.shape
    n = w.shape[1]
    ints = [ctypes.c_int(v) for v in (n, m, k)]
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    no = ctypes.c_char_p(b"N")

    def call() -> None:
        ni, mi, ki = (ctypes.byref(v) for v in ints)
        fn(no, no, ni, mi, ki, ctypes.byref(alpha), w.data_ptr(), ni, x.data_ptr(), ki, ctypes.byref(beta),
           out.data_ptr(), ni)  # fmt: skip

    return call


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 160, 512])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=9216)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    lib = load_library()
    if not bf16_supported(lib):
        raise SystemExit("needs the kernel library on a CPU with AVX512-BF16")
    assert lib is not None
    torch.set_num_threads(args.threads)
    mkl_bf16, sgemm = torch_blas_symbol("gemm_bf16bf16f32_"), torch_blas_symbol("sgemm_")
    g = torch.Generator().manual_seed(0)
    wt = torch.randn(args.k, args.n, generator=g) * 0.02
    packed, plain = bf16_weights.packed(wt), wt.to(torch.bfloat16)
    print(f"K {args.k}, N {args.n}, {args.threads} threads: GFLOP/s (median of {args.repeats})")
    chosen = ("dot", "fma", "amx")[lib.dspark_bf16_gemm_variant()]
    amx = bool(lib.dspark_has_amx())
    print(f"this process serves the packed kernel's {chosen} loop")
    columns = ("dot", "fma", "amx", "mkl", "sgemm")
    print(
        "rows | packed, dot (VDPBF16PS) | packed, fma (float32 FMAs) | packed, amx (tiles)"
        " | MKL gemm_bf16bf16f32 | sgemm"
    )
    for m in args.rows:
        x = torch.randn(m, args.k, generator=g)
        out = torch.empty(m, args.n)
        flop = 2.0 * m * args.k * args.n

        def packed_call(x: torch.Tensor = x, out: torch.Tensor = out, m: int = m, variant: int = 0) -> object:
            return lib.dspark_linear_bf16_variant(
                x.data_ptr(), m, args.k, packed.data_ptr(), args.n, out.data_ptr(), 0, args.threads, variant
            )

        calls: dict[str, Callable[[], object]] = {
            "dot": functools.partial(packed_call, variant=0),
            "fma": functools.partial(packed_call, variant=1),
        }
        if amx:
            calls["amx"] = functools.partial(packed_call, variant=2)
        if mkl_bf16 is not None:
            calls["mkl"] = _blas(_Fortran(mkl_bf16), plain, x.to(torch.bfloat16), out)
        if sgemm is not None:
            calls["sgemm"] = _blas(_Fortran(sgemm), wt, x, out)
        rate = {name: flop / median_seconds(call, args.repeats) / 1e9 for name, call in calls.items()}
        cells = [f"{rate[name]:.1f}" if name in rate else "-" for name in columns]
        print(f"{m} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
