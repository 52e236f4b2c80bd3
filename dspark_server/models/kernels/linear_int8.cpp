// out[M, N] (+)= x[M, K] @ W with W in int8 (one float32 scale per output column) and x, out in
// float32: the drafter's weight-only int8 GEMMs (--draft-weight-dtype int8). A decode-time GEMM
// of a few rows is bound by the bytes of its weight; int8 halves bf16's. The drafter's block pass
// at one request (7 rows) on the K=8 twin read 107 MB in bf16 in 4.3-5.2 ms of a 24 ms step.
//
// Each row of x is quantized to int16 with its own scale (|x| max -> 32767; relative error 2^-16
// of the row's largest value), so the products run on AVX512-VNNI's VPDPWSSD: 32 int16 products
// per instruction into int32 lanes, exact. A float32 FMA loop widening the weights (sign extend,
// convert, then FMAs) was bound by its arithmetic at 7 rows: 3.40 ms against bf16's 4.07 for the
// twin drafter's five GEMMs, VPDPWSSD 2.98 (a scratch A/B, two threads; `python -m
// tools.int8_gemm_ab` now: 2.47 against 3.67 at 7 rows, 1.30 against 3.66 at one). The int32 sums
// are flushed into float32 every kChunkPairs K pairs: with |x| <= 32767 and |w| <= 127, 512
// products cannot overflow. Past ~11 rows the arithmetic dominates and gemm.h serves the bf16
// copy. (Tried: past 11 rows, each block widened to bf16 in L2 and multiplied on AMX's tile unit:
// the widening cost more than the bytes it saved, 4.94 / 6.48 ms against bf16's 4.32 / 5.82 at 12
// / 28 rows.)
//
// W is packed in blocks of 32 columns, each block contiguous, in pairs along K (int8_weights.py):
// wq[((n / 32) * (K / 2) + k / 2) * 64 + (n % 32) * 2 + k % 2], one 64-byte line per K pair, which
// VPMOVSXBW widens to the int16 pairs VPDPWSSD multiplies; the N scales precede it in the buffer.
// A row's sum runs over K in the same order whatever M is.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "column_blocks.h"

namespace {

constexpr int64_t kChunkPairs = 256;  // int32 sums of 512 products of |x| <= 32767, |w| <= 127
constexpr int64_t kAhead = 32;        // K pairs ahead (2 KB of a block's stream)

// Rows [0, MM) of xp (int16 pairs, one int32 per K pair) times NB consecutive blocks (block j at
// w + j * kp_count * 64, columns [n + 32 j, n + 32 j + 32)), scaled by `scale` (laid out as out).
template <int MM, int NB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void blocks(const int32_t* xp, int64_t kp_count,
                                                                 const int8_t* w, const float* scale, int64_t n,
                                                                 float* out, int64_t ldo, bool accumulate) {
  float sums[MM][NB][32];
  memset(sums, 0, sizeof(sums));
  const int64_t stride = kp_count * 64;
  for (int64_t c0 = 0; c0 < kp_count; c0 += kChunkPairs) {
    const int64_t c1 = c0 + kChunkPairs < kp_count ? c0 + kChunkPairs : kp_count;
    __m512i acc[MM][NB][2];
    for (int r = 0; r < MM; ++r)
      for (int j = 0; j < NB; ++j) acc[r][j][0] = acc[r][j][1] = _mm512_setzero_si512();
    for (int64_t kp = c0; kp < c1; ++kp) {
      __m512i wv[NB][2];
      for (int j = 0; j < NB; ++j) {
        const int8_t* wj = w + j * stride + kp * 64;
        _mm_prefetch(reinterpret_cast<const char*>(wj + kAhead * 64), _MM_HINT_T0);
        wv[j][0] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj)));
        wv[j][1] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 32)));
      }
      for (int r = 0; r < MM; ++r) {
        const __m512i b = _mm512_set1_epi32(xp[r * kp_count + kp]);
        for (int j = 0; j < NB; ++j) {
          acc[r][j][0] = _mm512_dpwssd_epi32(acc[r][j][0], wv[j][0], b);
          acc[r][j][1] = _mm512_dpwssd_epi32(acc[r][j][1], wv[j][1], b);
        }
      }
    }
    for (int r = 0; r < MM; ++r)
      for (int j = 0; j < NB; ++j)
        for (int h = 0; h < 2; ++h) {
          float* s = sums[r][j] + 16 * h;
          _mm512_storeu_ps(s, _mm512_add_ps(_mm512_loadu_ps(s), _mm512_cvtepi32_ps(acc[r][j][h])));
        }
  }
  // scale[r * ldo + column] = xs[r] * ws[column], multiplied once per call: with the product of
  // three factors here, the compiler may pair them differently for different MM (it did for one
  // row), and a row's result would depend on the rows computed beside it
  for (int j = 0; j < NB; ++j)
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < MM; ++r) {
        float* o = out + r * ldo + n + 32 * j + 16 * h;
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sums[r][j] + 16 * h), _mm512_loadu_ps(scale + r * ldo + n + 32 * j + 16 * h));
        if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(o));
        _mm512_storeu_ps(o, v);
      }
}

using Block = void (*)(const int32_t*, int64_t, const int8_t*, const float*, int64_t, float*, int64_t, bool);
// [rows][i]: the loop over 1 << i blocks at once (column_blocks.h)
constexpr Block kBlocks[9][3] = {
    {nullptr, nullptr, nullptr},
    {blocks<1, 1>, blocks<1, 2>, blocks<1, 4>},
    {blocks<2, 1>, blocks<2, 2>, blocks<2, 2>},
    {blocks<3, 1>, blocks<3, 2>, blocks<3, 2>},
    {blocks<4, 1>, blocks<4, 1>, blocks<4, 1>},
    {blocks<5, 1>, blocks<5, 1>, blocks<5, 1>},
    {blocks<6, 1>, blocks<6, 1>, blocks<6, 1>},
    {blocks<7, 1>, blocks<7, 1>, blocks<7, 1>},
    {blocks<8, 1>, blocks<8, 1>, blocks<8, 1>}};

bool supported() {
  static const bool ok = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  return ok;
}

}  // namespace

extern "C" {

// Whether this CPU runs the kernel (AVX512-BW and AVX512-VNNI).
int dspark_has_int8() { return supported() ? 1 : 0; }

// `w`: N float32 column scales, then the packed int8 blocks (int8_weights.py). Returns 0, or 1
// for a shape the kernel does not take (K odd, N not a multiple of 32) or a CPU without it.
int dspark_linear_int8(const float* x, int64_t m, int64_t k, const void* w, int64_t n, float* out, int accumulate,
                       int nthreads) {
  if (m <= 0 || k <= 0 || k % 2 || n <= 0 || n % 32 || !supported()) return 1;
  const float* ws = static_cast<const float*>(w);
  const int8_t* wq = reinterpret_cast<const int8_t*>(ws + n);
  int16_t* xq = static_cast<int16_t*>(malloc(sizeof(int16_t) * m * k + sizeof(float) * m * n));
  if (!xq) return 1;
  float* scale = reinterpret_cast<float*>(xq + m * k);  // [m, n]: row scale x column scale
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * k;
    float amax = 0.f;
    for (int64_t i = 0; i < k; ++i) amax = fmaxf(amax, fabsf(row[i]));
    const float xs = amax > 0.f ? amax / 32767.f : 1.f, inv = 1.f / xs;
    for (int64_t i = 0; i < k; ++i) xq[r * k + i] = static_cast<int16_t>(lrintf(row[i] * inv));
    for (int64_t c = 0; c < n; ++c) scale[r * n + c] = xs * ws[c];
  }
  const int32_t* xp = reinterpret_cast<const int32_t*>(xq);
  const int64_t kp_count = k / 2, nblocks = n / 32, stride = kp_count * 64;
  dspark::over_column_blocks(
      nblocks, m, nthreads,
      [&](int64_t b, int64_t mb) {
        kBlocks[8][0](xp + mb * kp_count, kp_count, wq + b * stride, scale + mb * n, b * 32, out + mb * n, n,
                      accumulate != 0);
      },
      [&](int64_t b, int64_t step, int64_t first) {
        kBlocks[m - first][dspark::tail_index(step)](xp + first * kp_count, kp_count, wq + b * stride,
                                                     scale + first * n, b * 32, out + first * n, n, accumulate != 0);
      });
  free(xq);
  return 0;
}

}  // extern "C"
