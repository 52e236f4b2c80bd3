// The GEMM the fused calls (decoder_forward.cpp, context_write.cpp) run: out[M, N] (+)= x[M, K]
// times a weight in the serving layout, float32 through the BLAS sgemm whose address the caller
// passes (PyTorch's own MKL), or weight-only bf16 (the packed small-M kernel of linear_bf16.cpp
// below kSmallRows rows, MKL's bf16 GEMM from there).
#pragma once
#include <stdint.h>

extern "C" {
int dspark_linear_bf16(const float* x, int64_t m, int64_t k, const uint16_t* wp, int64_t n, float* out,
                       int accumulate, int nthreads);
void dspark_round_bf16(const float* x, int64_t count, uint16_t* out);
}

namespace dspark {

// Fortran BLAS sgemm (LP64), column-major.
using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                       const int*, const float*, const int*, const float*, float*, const int*);

// Fortran MKL gemm_bf16bf16f32 (LP64): sgemm's arguments with bf16 A and B.
using Bgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const uint16_t*,
                       const int*, const uint16_t*, const int*, const float*, float*, const int*);

constexpr int64_t kSmallRows = 32;  // below: the packed small-M kernel; from here: MKL's bf16 GEMM

struct Gemms {
  Sgemm sgemm;
  Bgemm bgemm;    // weight-only bf16 only
  uint16_t* xb;   // weight-only bf16: scratch for x rounded to bf16 (rows x the widest K)
  int nthreads;
};

// out[M, N] = x[M, K] @ wt[K, N] (+ out when accumulate): row-major out is column-major out^T =
// W (N x K, column-major: wt's rows) times x^T (K x M). Float32: w = wt. Weight-only bf16: w is
// the packed layout, plain the [K, N] bf16 one. `ldw`: the row stride of wt / plain (N, or more
// for a slice of a wider weight's columns, whose packed blocks then start at w).
inline int linear(const Gemms& g, const float* x, int64_t m, int64_t k, const void* w, const void* plain, int64_t n,
                  float* out, bool accumulate, int64_t ldw = 0) {
  const int mi = static_cast<int>(m), ki = static_cast<int>(k), ni = static_cast<int>(n);
  const int ld = static_cast<int>(ldw > 0 ? ldw : n);
  const float one = 1.f, beta = accumulate ? 1.f : 0.f;
  if (!plain) {
    g.sgemm("N", "N", &ni, &mi, &ki, &one, static_cast<const float*>(w), &ld, x, &ki, &beta, out, &ni);
    return 0;
  }
  if (m < kSmallRows)
    return dspark_linear_bf16(x, m, k, static_cast<const uint16_t*>(w), n, out, accumulate ? 1 : 0, g.nthreads);
  dspark_round_bf16(x, m * k, g.xb);
  g.bgemm("N", "N", &ni, &mi, &ki, &one, static_cast<const uint16_t*>(plain), &ld, g.xb, &ki, &beta, out, &ni);
  return 0;
}

}  // namespace dspark
