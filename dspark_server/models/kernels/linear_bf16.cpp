// out[M, N] (+)= x[M, K] @ W with W in bfloat16 and x, out in float32: weight-only bf16 for the
// fused forward's GEMMs (half the bytes of float32 weights, fp32 accumulation).
//
// Written for the small M of decoding and speculative verification, where MKL's bf16 GEMM was
// slower than float32 sgemm (demo target's shapes, 8 rows: 697 against 501 us), it serves prefill
// chunks and large batches too: each 32-column block is re-read from L2 per 8 rows, and it stays
// 2.5-4x faster than MKL's bf16 GEMM from 32 to 512 rows (gemm.h). W is packed in blocks of 32
// columns, each block contiguous, in pairs along K (wp[((n / 32) * (K / 2) + k / 2) * 64 + (n % 32) * 2 +
// k % 2]: the pairs AVX512-BF16's dot product reads, one block a stream of K * 64 bytes); each
// thread takes blocks, and every block is read once per 8 rows of x, with 16 accumulators in
// registers. x is rounded to bf16 (round to nearest even) once per call.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr int64_t kPrefetch = 32;  // K pairs ahead (4 KB of the block's stream)

// rows [mb, mb + MM) of x (as bf16 pairs, xp[r * K / 2 + kp]) times the 32 columns [n, n + 32)
template <int MM>
__attribute__((target("avx512f,avx512bf16"))) void block32(const uint32_t* xp, int64_t kp_count,
                                                            const uint16_t* w, int64_t n, float* out,
                                                            int64_t ldo, bool accumulate) {
  __m512 acc[MM][2];
  for (int r = 0; r < MM; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    // the block is one stream of K * 64 bytes: fetched kPrefetch pairs ahead, the weights of a
    // model too big for the caches arrive while the dot products run (a 200 MB weight at 8 rows:
    // 16.9 -> 10.2 ms; at one row 9.8 -> 8.0 ms)
    _mm_prefetch(reinterpret_cast<const char*>(w + (kp + kPrefetch) * 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (kp + kPrefetch) * 64 + 32), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kp * 64);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kp * 64 + 32);
    for (int r = 0; r < MM; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * kp_count + kp]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, b);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, b);
    }
  }
  for (int r = 0; r < MM; ++r) {
    float* o = out + r * ldo + n;
    if (accumulate) {
      acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_loadu_ps(o));
      acc[r][1] = _mm512_add_ps(acc[r][1], _mm512_loadu_ps(o + 16));
    }
    _mm512_storeu_ps(o, acc[r][0]);
    _mm512_storeu_ps(o + 16, acc[r][1]);
  }
}

using Block = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool);
constexpr Block kBlocks[9] = {nullptr,     block32<1>, block32<2>, block32<3>, block32<4>,
                              block32<5>, block32<6>, block32<7>, block32<8>};

}  // namespace

extern "C" {

// Whether this CPU runs the kernel (AVX512-BF16).
int dspark_has_bf16() { return __builtin_cpu_supports("avx512bf16") ? 1 : 0; }

// out[i] = x[i] rounded to bf16 (to nearest even; finite inputs): the GEMM input rounding.
void dspark_round_bf16(const float* x, int64_t count, uint16_t* out) {
  for (int64_t i = 0; i < count; ++i) {
    uint32_t u;
    memcpy(&u, x + i, sizeof(u));
    u += 0x7FFFu + ((u >> 16) & 1u);
    out[i] = static_cast<uint16_t>(u >> 16);
  }
}

// Returns 0, or 1 for a bad argument (K odd, N not a multiple of 32, no AVX512-BF16).
int dspark_linear_bf16(const float* x, int64_t m, int64_t k, const uint16_t* wp, int64_t n, float* out,
                       int accumulate, int nthreads) {
  if (m <= 0 || k <= 0 || k % 2 || n <= 0 || n % 32 || !dspark_has_bf16()) return 1;
  const int64_t kp_count = k / 2;
  uint16_t* xb = static_cast<uint16_t*>(malloc(sizeof(uint16_t) * m * k));
  if (!xb) return 1;
  dspark_round_bf16(x, m * k, xb);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb);
  const int64_t nblocks = n / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && nblocks > 1)
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int64_t mb = 0; mb < m; mb += 8) {
      const int64_t mm = m - mb < 8 ? m - mb : 8;
      kBlocks[mm](xp + mb * kp_count, kp_count, wp + b * kp_count * 64, b * 32, out + mb * n, n,
                  accumulate != 0);
    }
  }
  free(xb);
  return 0;
}
}
