"""Weight-only int8 against weight-only bf16 by row count, on a drafter's GEMM shapes read from
memory: the kernels the drafter's fused calls run under --draft-weight-dtype int8 and bfloat16
(kernels/linear_int8.cpp, kernels/linear_bf16.cpp).

    python -m tools.int8_gemm_ab --rows 1 7 8 14 16 --hidden 2048 --intermediate 4608 --vocab 6144

Prints ms per row count for the five GEMMs of one decoder layer and the LM head (q|k|v, o,
gate|up, down, lm_head), each kernel's best of three passes over ``--copies`` copies of every
weight (more bytes than the caches hold, as in serving). The figures behind gemm.h's
``kInt8Rows``: where the int8 kernel stops waiting on memory. The defaults are the K=8 twin
drafter's shapes. A diagnostic: it needs the kernel library on a CPU with AVX512-VNNI and BF16.
"""

from __future__ import annotations

import argparse
import time

import torch

from dspark_server.models import bf16_weights, int8_weights
from dspark_server.models.kernel_library import load_library
from dspark_server.models.weight_formats import int8_supported


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 7, 8, 14, 16])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=4608)
    ap.add_argument("--vocab", type=int, default=6144)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copies", type=int, default=6)
    a = ap.parse_args(argv)
    lib = load_library()
    if not int8_supported(lib):
        raise SystemExit("needs the kernel library on a CPU with AVX512-VNNI and AVX512-BF16")
    h, i = a.hidden, a.intermediate
    shapes = [(h, 2 * h), (h, h), (h, 2 * i), (i, h), (h, a.vocab)]
    weights = {}
    for k, n in shapes:
        wt = torch.randn(k, n) * 0.02
        weights[(k, n)] = (
            [bf16_weights.packed(wt) for _ in range(a.copies)],
            [int8_weights.packed(wt) for _ in range(a.copies)],
        )
    for m in a.rows:
        total = {"bf16": 0.0, "int8": 0.0}
        for (k, n), (bf16, int8) in weights.items():
            x, out = torch.randn(m, k), torch.empty(m, n)
            for name, fn, copies in (
                ("bf16", lib.dspark_linear_bf16, bf16),  # type: ignore[union-attr]
                ("int8", lib.dspark_linear_int8, int8),  # type: ignore[union-attr]
            ):
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    for w in copies:
                        fn(x.data_ptr(), m, k, w.data_ptr(), n, out.data_ptr(), 0, a.threads)
                    best = min(best, (time.perf_counter() - t0) / len(copies))
                total[name] += best
        print(f"rows {m:4d}: bf16 {total['bf16'] * 1e3:6.2f} ms  int8 {total['int8'] * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
