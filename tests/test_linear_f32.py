"""The float32 GEMM kernel of decoding and verification (kernels/linear_f32.cpp) on weights packed
by f32_weights.py, against float64 matrix products, and the property verification relies on: a
row's result does not depend on the rows computed beside it (so a verification forward and a
plain one agree bit for bit)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from dspark_server.models import f32_weights
from dspark_server.models.kernel_library import load_library

LIB = load_library()
needs_kernel = pytest.mark.skipif(
    LIB is None or not LIB.dspark_has_linear_f32(), reason="no kernel library built for AVX2 + FMA here"
)


def linear(
    x: torch.Tensor, wt: torch.Tensor, out: torch.Tensor, accumulate: bool = False, threads: int = 2
) -> int:
    """out (+)= x @ wt through the kernel, ``wt`` [K, N] (any strides) packed first."""
    assert LIB is not None and x.is_contiguous() and out.is_contiguous()
    m, k = x.shape
    wp = f32_weights.packed(wt)
    return int(
        LIB.dspark_linear_f32(
            x.data_ptr(), m, k, wp.data_ptr(), out.shape[1], out.data_ptr(), int(accumulate), threads
        )
    )


def test_packed_layout_is_column_panels_of_24_then_the_tail() -> None:
    """wp[24 p K + k w + c] = wt[k, 24 p + c], w the panel's width (24, the last one 8 or 16)."""
    k, n = 5, 24 * 3 + 16
    wt = torch.arange(k * n, dtype=torch.float32).reshape(k, n)
    wp = f32_weights.packed(wt)
    assert wp.shape == (k * n,) and wp.is_contiguous()
    for col in range(n):
        p, c = divmod(col, 24)
        w = 24 if p < n // 24 else n % 24
        for row in range(k):
            assert wp[24 * p * k + row * w + c] == wt[row, col]
    sliced = torch.arange(4 * 40, dtype=torch.float32).reshape(4, 40)[:, 8:32]  # a column slice
    assert torch.equal(f32_weights.packed(sliced), f32_weights.packed(sliced.contiguous()))
    with pytest.raises(ValueError):
        f32_weights.packed(torch.zeros(4, 12))


@needs_kernel
@pytest.mark.parametrize(
    "m,k,n",
    [(1, 256, 576), (1, 64, 112), (2, 256, 6144), (3, 300, 40), (4, 7, 24), (5, 2048, 104), (8, 576, 256)]
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


@needs_kernel
def test_reads_a_packed_column_slice_of_a_wider_weight() -> None:
    g = torch.Generator().manual_seed(1)
    x, wide = torch.randn(6, 64, generator=g), torch.randn(64, 96, generator=g)
    out = torch.full((6, 32), float("nan"))
    assert linear(x, wide[:, 32:64], out) == 0
    torch.testing.assert_close(out, x @ wide[:, 32:64], atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(threads: int) -> None:
    """Row i of a 1-row call equals row i of every larger call bit for bit (every output is one
    chain of FMAs over k in order, whatever the blocking): verification and plain decoding agree."""
    g = torch.Generator().manual_seed(2)
    k, n = 700, 6144 + 40  # several K passes; a narrower last panel
    w, x = torch.randn(k, n, generator=g), torch.randn(37, k, generator=g)
    full = {m: torch.empty(m, n) for m in (2, 3, 4, 5, 7, 8, 13, 37)}
    for m, out in full.items():
        assert linear(x[:m].contiguous(), w, out, threads=threads) == 0
    for i in (0, 1, 7, 12, 36):
        alone = torch.empty(1, n)
        assert linear(x[i : i + 1].contiguous(), w, alone, threads=threads) == 0
        for m, out in full.items():
            if i < m:
                assert torch.equal(alone[0], out[i]), (i, m)


@needs_kernel
def test_refuses_what_it_cannot_compute() -> None:
    assert LIB is not None
    x, wp, out = torch.randn(2, 16), torch.randn(16 * 12), torch.zeros(2, 12)
    # N not a multiple of the vector width: the caller uses the sgemm
    assert LIB.dspark_linear_f32(x.data_ptr(), 2, 16, wp.data_ptr(), 12, out.data_ptr(), 0, 1) == 1
    assert bool((out == 0).all())


@needs_kernel
def test_blas_setting_keeps_no_packed_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSPARK_F32_GEMM", raising=False)
    assert f32_weights.kernel_serves(LIB)
    monkeypatch.setenv("DSPARK_F32_GEMM", "blas")
    assert not f32_weights.kernel_serves(LIB)
    assert not f32_weights.kernel_serves(None)


@needs_kernel
@pytest.mark.parametrize("packed", [True, False])
def test_greedy_markov_block_reads_w2_packed_as_decided_at_serving(packed: bool) -> None:
    """The greedy Markov block kernel reads W2^T's packed copy when serving decided so (once, in
    ``DSparkDrafter.use_kernels``), the sgemm's layout otherwise; its tokens are the argmax of
    U_k + W2 W1[x_{k-1}] either way, rows of 1 and of 9 requests (the kernel and the sgemm)."""
    from dspark_server.models.drafter_heads import MarkovHead

    torch.manual_seed(3)
    vocab, rank = 160, 16  # N = vocab: a multiple of 8, so the packed copy fits
    head = MarkovHead(vocab, rank)
    head.serve_packed_f32(packed)
    for rows in (1, 9):
        g = torch.Generator().manual_seed(rows)
        base = torch.randn(rows, 7, vocab, generator=g) * 0.3  # small: the bias decides
        anchors = torch.randint(0, vocab, (rows,), generator=g)
        with torch.no_grad():
            got = head.greedy_block(LIB, base, anchors)
            w1, w2 = head.markov_w1.weight.double(), head.markov_w2.weight.double()
            want, prev = [], anchors
            for k in range(7):
                prev = (base[:, k].double() + w1[prev] @ w2.T).argmax(-1)
                want.append(prev)
        assert got is not None and torch.equal(got, torch.stack(want, dim=1))
    assert ("f32_packed" in head._w2t) == packed


@needs_kernel
def test_ctypes_signature_is_registered() -> None:
    assert LIB is not None
    args = LIB.dspark_linear_f32.argtypes
    assert len(args) == 8 and args[3] is ctypes.c_void_p and args[4] is ctypes.c_int64  # packed weight, n
