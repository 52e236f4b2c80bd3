// The GEMM the fused calls (decoder_forward.cpp, context_write.cpp) run: out[M, N] (+)= x[M, K]
// times a weight in the serving layout, float32 through linear_f32.cpp's kernel at the few rows
// of decoding and verification and through the BLAS sgemm whose address the caller passes
// (PyTorch's own MKL) above them, or weight-only bf16 through linear_bf16.cpp's packed kernel at every
// M. MKL's own bf16 GEMM is not used: on this AMD EPYC it takes a generic path no faster than
// float32 sgemm (`python -m tools.bf16_gemm_ab`, K 2048, N 9216, two threads, GFLOP/s at 1 / 32 /
// 160 / 512 rows: MKL bf16 1.6 / 78 / 133 / 163, sgemm 11 / 60 / 108 / 162, the packed kernel
// 44 / 361 / 414 / 414).
#pragma once
#include <stdint.h>

extern "C" {
int dspark_linear_bf16(const float* x, int64_t m, int64_t k, const uint16_t* wp, int64_t n, float* out,
                       int accumulate, int nthreads);
int dspark_linear_f32(const float* x, int64_t m, int64_t k, const float* w, int64_t ldw, int64_t n, float* out,
                      int accumulate, int nthreads);
int dspark_f32_gemm_kernel();
}

namespace dspark {

// Float32 GEMMs of up to this many rows run linear_f32.cpp's kernel, larger ones the BLAS sgemm:
// MKL packs the weight on every call, a cost that does not grow with the rows, and its packed
// loop then overtakes the kernel's, from about 12 rows at K 256 (the demo pair) and 32 at K 2048
// (the K = 8 twin). On the 2-core AMD EPYC of linear_f32.cpp, two threads, microseconds of sgemm
// / kernel at 1, 4, 8, 16, 32 rows: K 256 x N 6144: 153 / 97, 475 / 209, 534 / 348, 589 / 687,
// 976 / 1313; K 2048 x N 4608: 1047 / 554, 4773 / 1414, 5386 / 2216, 6161 / 4070, 8544 / 7547
// (`python -m tools.f32_gemm_ab`).
inline int64_t f32_kernel_rows(int64_t k) { return k >= 1024 ? 32 : 12; }

// Fortran BLAS sgemm (LP64), column-major.
using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                       const int*, const float*, const int*, const float*, float*, const int*);

struct Gemms {
  Sgemm sgemm;
  bool bf16;  // weight-only bf16: every weight is in linear_bf16.cpp's packed layout
  int nthreads;
  bool f32_kernel = dspark_f32_gemm_kernel() != 0;  // float32: linear_f32.cpp where it applies, else the BLAS
};

// out[M, N] = x[M, K] @ wt[K, N] (+ out when accumulate): row-major out is column-major out^T =
// W (N x K, column-major: wt's rows) times x^T (K x M). Float32: w = wt, `ldw` its row stride (N,
// or more for a slice of a wider weight's columns). Weight-only bf16: w is the packed layout of
// exactly these N columns.
inline int linear(const Gemms& g, const float* x, int64_t m, int64_t k, const void* w, int64_t n, float* out,
                  bool accumulate, int64_t ldw = 0) {
  if (g.bf16)
    return dspark_linear_bf16(x, m, k, static_cast<const uint16_t*>(w), n, out, accumulate ? 1 : 0, g.nthreads);
  const int64_t stride = ldw > 0 ? ldw : n;
  const float* wf = static_cast<const float*>(w);
  if (g.f32_kernel && m <= f32_kernel_rows(k) &&
      dspark_linear_f32(x, m, k, wf, stride, n, out, accumulate ? 1 : 0, g.nthreads) == 0)
    return 0;
  const int mi = static_cast<int>(m), ki = static_cast<int>(k), ni = static_cast<int>(n);
  const int ld = static_cast<int>(stride);
  const float one = 1.f, beta = accumulate ? 1.f : 0.f;
  g.sgemm("N", "N", &ni, &mi, &ki, &one, wf, &ld, x, &ki, &beta, out, &ni);
  return 0;
}

}  // namespace dspark
