// The GEMM the fused calls (decoder_forward.cpp, context_write.cpp, markov.h) run: out[M, N]
// (+)= x[M, K] times a weight, float32 through linear_f32.cpp's kernel on the weight's packed
// copy up to a few hundred rows (decoding, verification, prefill chunks) and through the
// BLAS sgemm whose address the caller passes (PyTorch's own MKL) on the serving layout above
// them, or weight-only bf16 through linear_bf16.cpp's packed kernel at every M, or weight-only int8
// (linear_int8.cpp) for the few rows of decoding. MKL's own bf16
// GEMM is not used: on an AMD EPYC with AVX512-BF16 it took a generic path no faster than float32
// sgemm (`python -m tools.bf16_gemm_ab`, K 2048, N 9216, two threads, GFLOP/s at 1 / 32 / 160 /
// 512 rows: MKL bf16 1.6 / 78 / 133 / 163, sgemm 11 / 60 / 108 / 162, the packed kernel 44 / 361
// / 414 / 414).
#pragma once
#include <stdint.h>

extern "C" {
int dspark_linear_bf16(const float* x, int64_t m, int64_t k, const uint16_t* wp, int64_t n, float* out,
                       int accumulate, int nthreads);
int dspark_linear_f32(const float* x, int64_t m, int64_t k, const float* wp, int64_t n, float* out, int accumulate,
                      int nthreads);
int dspark_linear_int8(const float* x, int64_t m, int64_t k, const void* w, int64_t n, float* out, int accumulate,
                       int nthreads);
}

namespace dspark {

// Float32 GEMMs of up to this many rows run linear_f32.cpp's kernel on the packed copy, larger
// ones the BLAS sgemm on the serving layout: MKL packs the weight on every call, a cost that does
// not grow with the rows, and its packed loop then catches up with the kernel's. On the 2-core
// AMD EPYC (Zen 3, AVX2) of linear_f32.cpp, two threads, us of sgemm / kernel at 1, 8, 32, 128,
// 256, 512 rows (`python -m tools.f32_gemm_ab --rows 1 8 32 128 256 512`): K 256 x N 6144: 185 /
// 138, 864 / 285, 990 / 524, 4545 / 2101, 5875 / 4259, 10616 / 8818; K 2048 x N 9216: 2765 /
// 1687, 10799 / 4039, 17075 / 8591, 38762 / 28848, 67478 / 57174, 127840 / 117417. A CPU with
// AVX-512 gives MKL twice the vector width the kernel uses, hence the sgemm from a few hundred
// rows on (prefill chunks and the largest batches). Without AVX-512 the kernel keeps ahead to 512
// rows (K 2048, us of sgemm / kernel at 128, 256, 512 rows: N 9216 34834 / 27996, 63885 / 57384,
// 117571 / 112023; N 6144 23511 / 18371, 39456 / 36341, 75176 / 73549; K 4608 x N 2048 21073 /
// 13642, 33707 / 27303, 61813 / 57234), so there it serves every step of the default 512-token
// budget, prefill chunks included.
inline int64_t f32_kernel_rows(int64_t k) {
  static const bool wide = __builtin_cpu_supports("avx512f");
  if (!wide) return 512;
  return k >= 1024 ? 128 : 256;
}

// Fortran BLAS sgemm (LP64), column-major.
using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                       const int*, const float*, const int*, const float*, float*, const int*);

// How a fused call's weights are kept (the `weight_format` its callers pass).
enum WeightFormat : int {
  kFloat32 = 0,
  kBf16 = 1,  // weight-only bf16: every weight is in linear_bf16.cpp's packed layout
  kInt8 = 2,  // weight-only int8 (linear_int8.cpp) up to kInt8Rows rows, its bf16 copy above them
};

// Up to this many rows the int8 kernel serves an int8 weight, the bf16 kernel (AMX or AVX512-BF16)
// above: the int8 kernel's VNNI products cost more arithmetic per row, and past ~11 rows it stops
// waiting on memory. The twin drafter's five GEMMs (K=8 twin, two threads, weights from memory, ms
// of bf16 / int8 at 1, 7, 11, 12, 14 rows: 3.66 / 1.30, 3.67 / 2.47, 3.66 / 3.56, 3.71 / 3.96,
// 3.84 / 4.31; `python -m tools.int8_gemm_ab --rows 1 7 11 12 14`): one request's block pass (7
// rows) and context writes of accepted tokens read int8, prompt chunks and larger batches bf16.
constexpr int64_t kInt8Rows = 11;

struct Gemms {
  Sgemm sgemm;
  int format;  // WeightFormat
  int nthreads;
};

// out[M, N] = x[M, K] @ wt[K, N] (+ out when accumulate). Float32: w = wt in the serving layout,
// `ldw` its row stride (N, or more for a slice of a wider weight's columns), and `packed` its copy
// in linear_f32.cpp's panels (null: none kept, the sgemm serves every M). The sgemm sees row-major
// out as column-major out^T = W (N x K, column-major: wt's rows) times x^T (K x M). Weight-only
// bf16: w is the packed layout of exactly these N columns. Int8: w is int8_weights.py's buffer
// of these N columns and `packed` their packed bf16 copy.
inline int linear(const Gemms& g, const float* x, int64_t m, int64_t k, const void* w, const float* packed,
                  int64_t n, float* out, bool accumulate, int64_t ldw = 0) {
  if (g.format == kInt8 && m > kInt8Rows && packed)
    return dspark_linear_bf16(x, m, k, reinterpret_cast<const uint16_t*>(packed), n, out, accumulate ? 1 : 0,
                              g.nthreads);
  if (g.format == kInt8) return dspark_linear_int8(x, m, k, w, n, out, accumulate ? 1 : 0, g.nthreads);
  if (g.format == kBf16)
    return dspark_linear_bf16(x, m, k, static_cast<const uint16_t*>(w), n, out, accumulate ? 1 : 0, g.nthreads);
  if (packed && m <= f32_kernel_rows(k) && dspark_linear_f32(x, m, k, packed, n, out, accumulate ? 1 : 0, g.nthreads) == 0)
    return 0;
  const int mi = static_cast<int>(m), ki = static_cast<int>(k), ni = static_cast<int>(n);
  const int ld = static_cast<int>(ldw > 0 ? ldw : n);
  const float one = 1.f, beta = accumulate ? 1.f : 0.f;
  g.sgemm("N", "N", &ni, &mi, &ki, &one, static_cast<const float*>(w), &ld, x, &ki, &beta, out, &ni);
  return 0;
}

}  // namespace dspark
