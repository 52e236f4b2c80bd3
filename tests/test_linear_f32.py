"""The float32 GEMM kernel of decoding and verification (kernels/linear_f32.cpp) against float64
matrix products, and the property verification relies on: a row's result does not depend on the
rows computed beside it (so a verification forward and a plain one agree bit for bit)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from dspark_server.models.kernel_library import load_library

LIB = load_library()
pytestmark = pytest.mark.skipif(
    LIB is None or not LIB.dspark_has_linear_f32(), reason="no kernel library built for AVX2 + FMA here"
)


def linear(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, accumulate: bool = False, threads: int = 2
) -> int:
    """out (+)= x @ w through the kernel; ``w`` [K, N] may be a column slice (row stride > N)."""
    assert LIB is not None and x.is_contiguous() and out.is_contiguous() and w.stride(1) == 1
    m, k = x.shape
    rc = LIB.dspark_linear_f32(
        x.data_ptr(), m, k, w.data_ptr(), w.stride(0), out.shape[1], out.data_ptr(), int(accumulate), threads
    )
    return int(rc)


@pytest.mark.parametrize(
    "m,k,n",
    [(1, 256, 576), (2, 256, 6144), (3, 300, 40), (4, 7, 24), (5, 2048, 104), (8, 576, 256)]
    + [(13, 513, 8), (70, 96, 200)],
)
@pytest.mark.parametrize("accumulate", [False, True])
def test_matches_float64_product(m: int, k: int, n: int, accumulate: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    start = torch.randn(m, n, generator=g)
    out = start.clone()
    assert linear(x, w, out, accumulate) == 0
    ref = x.double() @ w.double() + (start.double() if accumulate else 0.0)
    # float32 sums over k terms: a few ulps of the terms' magnitude
    assert float((out.double() - ref).abs().max()) <= 1e-5 * k**0.5 * float(ref.abs().max())


def test_reads_a_column_slice_of_a_wider_weight() -> None:
    g = torch.Generator().manual_seed(1)
    x, wide = torch.randn(6, 64, generator=g), torch.randn(64, 96, generator=g)
    out = torch.full((6, 32), float("nan"))
    assert linear(x, wide[:, 32:64], out) == 0
    torch.testing.assert_close(out, x @ wide[:, 32:64], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(threads: int) -> None:
    """Row i of a 1-row call equals row i of every larger call bit for bit (every output is one
    chain of FMAs over k in order, whatever the blocking): verification and plain decoding agree."""
    g = torch.Generator().manual_seed(2)
    k, n = 700, 6144 + 40  # several K passes; a narrower last panel
    w, x = torch.randn(k, n, generator=g), torch.randn(37, k, generator=g)
    full = {m: torch.empty(m, n) for m in (2, 3, 8, 13, 37)}
    for m, out in full.items():
        assert linear(x[:m].contiguous(), w, out, threads=threads) == 0
    for i in (0, 1, 7, 12, 36):
        alone = torch.empty(1, n)
        assert linear(x[i : i + 1].contiguous(), w, alone, threads=threads) == 0
        for m, out in full.items():
            if i < m:
                assert torch.equal(alone[0], out[i]), (i, m)


def test_refuses_what_it_cannot_compute() -> None:
    x, w, out = torch.randn(2, 16), torch.randn(16, 12), torch.zeros(2, 12)
    assert linear(x, w, out) == 1  # N not a multiple of the vector width: the caller uses sgemm
    assert bool((out == 0).all())


def test_blas_setting_turns_the_kernel_off() -> None:
    code = "import dspark_server.models.kernel_library as k; print(k.load_library().dspark_f32_gemm_kernel())"
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_F32_GEMM"}

    def kernel_on(extra: dict[str, str]) -> str:
        cmd = [sys.executable, "-c", code]
        done = subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, check=True)
        return done.stdout.strip()

    assert (kernel_on({}), kernel_on({"DSPARK_F32_GEMM": "blas"})) == ("1", "0")


def test_ctypes_signature_is_registered() -> None:
    assert LIB is not None
    assert LIB.dspark_linear_f32.argtypes[4] is ctypes.c_int64  # the weight's row stride
