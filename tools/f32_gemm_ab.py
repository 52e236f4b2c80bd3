"""Float32 GEMM time by row count: the kernel the fused forwards run on packed weights at the few
rows of decoding and verification (kernels/linear_f32.cpp) against the BLAS sgemm PyTorch links
(MKL) on the serving layout, which serves the larger ones (kernels/gemm.h: ``f32_kernel_rows``).

    python -m tools.f32_gemm_ab --rows 1 4 8 16 32 64 --shapes 256x6144 2048x4608 --threads 2

Prints microseconds per call for each at each (K x N, rows), interleaved (each one's median of
``--repeats`` timed calls, one after the other), and their ratio. The sgemm reads the serving
layout (a [N, K] weight stored column-major, its [K, N] transpose contiguous), the kernel its
packed copy (f32_weights.py). A diagnostic: it needs the kernel library built for AVX2 + FMA.
"""

from __future__ import annotations

import argparse
import functools

import torch

from dspark_server.models import f32_weights
from dspark_server.models.kernel_library import load_library
from tools.bf16_gemm_ab import median_seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    p.add_argument(
        "--shapes", nargs="+", default=["256x6144", "576x256", "2048x9216", "4608x2048"], help="KxN"
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args(argv)
    lib = load_library()
    if lib is None or not lib.dspark_has_linear_f32():
        raise SystemExit("needs the kernel library built for AVX2 + FMA")
    torch.set_num_threads(a.threads)
    print(f"{'K x N':>12} {'rows':>5} {'sgemm us':>9} {'kernel us':>10} {'sgemm/kernel':>13}")
    for shape in a.shapes:
        k, n = (int(v) for v in shape.split("x"))
        wt = torch.randn(k, n)
        wp = f32_weights.packed(wt)
        for m in a.rows:
            x, out = torch.randn(m, k), torch.empty(m, n)
            args = (x.data_ptr(), m, k, wp.data_ptr(), n, out.data_ptr(), 0, a.threads)
            blas = median_seconds(functools.partial(torch.mm, x, wt, out=out), a.repeats)
            ours = median_seconds(functools.partial(lib.dspark_linear_f32, *args), a.repeats)
            print(f"{shape:>12} {m:>5} {blas * 1e6:>9.0f} {ours * 1e6:>10.0f} {blas / ours:>13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
