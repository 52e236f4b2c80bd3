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
//
// Three inner loops compute the same products from the same layout, and the fastest on this CPU
// serves (timed once per process on an L2-resident shape, or DSPARK_BF16_GEMM=dot|fma|amx):
// - dot: AVX512-BF16's VDPBF16PS, two K steps of 16 columns per instruction. On AMD Zen 4 it
//   retires about as often as a float32 FMA, so it does twice the work per cycle.
// - fma: each bf16 pair widened to two float32 vectors (a shift and a mask) and float32 FMAs. On
//   Intel Sapphire / Emerald Rapids VDPBF16PS issues every other cycle while two FMAs issue per
//   cycle (Xeon model 207, one core: 86 against 176 GFLOP/s in registers), so past a few rows,
//   where the GEMM stops waiting on memory, this loop is up to 1.8x faster.
// - amx: the tile unit of Intel CPUs with AMX-BF16 (linear_bf16_amx.cpp), which reads the same
//   packed blocks as its B tiles.
// Either way a row's sum runs over K in the same order whatever M is, so a row's result does not
// depend on the rows computed beside it (verification and plain decoding agree bit for bit).
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "column_blocks.h"

extern "C" {
int dspark_has_amx();
int dspark_linear_bf16_amx(const uint16_t* xb, int64_t m, int64_t k, const uint16_t* wp, int64_t n, float* out,
                           int accumulate, int nthreads);
}

namespace {

constexpr int64_t kPrefetch = 32;  // K pairs ahead (4 KB of the block's stream)

// Both loops below take rows [mb, mb + MM) of x times NB consecutive 32-column blocks (block j at
// w + j * kp_count * 64, columns [n + 32 j, n + 32 j + 32)). Each of a row's sums runs over K in
// the same order whatever MM and NB are; NB > 1 serves the last few rows of a call, where one
// block alone would leave too few independent accumulators to hide the FMA latency (one row, one
// block: two chains of two dependent FMAs per K pair, half the issue rate).

// out[r, n + 32 j : n + 32 j + 32] (+)= the accumulators of row r, block j.
template <int MM, int NB>
__attribute__((target("avx512f"))) inline void store(__m512 (&acc)[MM][NB][2], float* out, int64_t ldo, int64_t n,
                                                     bool accumulate) {
  for (int r = 0; r < MM; ++r)
    for (int j = 0; j < NB; ++j) {
      float* o = out + r * ldo + n + 32 * j;
      if (accumulate) {
        acc[r][j][0] = _mm512_add_ps(acc[r][j][0], _mm512_loadu_ps(o));
        acc[r][j][1] = _mm512_add_ps(acc[r][j][1], _mm512_loadu_ps(o + 16));
      }
      _mm512_storeu_ps(o, acc[r][j][0]);
      _mm512_storeu_ps(o + 16, acc[r][j][1]);
    }
}

// x as bf16 pairs (xp[r * K / 2 + kp]); VDPBF16PS.
template <int MM, int NB>
__attribute__((target("avx512f,avx512bf16"))) void blocks_dot(const void* xv, int64_t kp_count,
                                                               const uint16_t* w, int64_t n, float* out,
                                                               int64_t ldo, bool accumulate) {
  const uint32_t* xp = static_cast<const uint32_t*>(xv);
  const int64_t stride = kp_count * 64;
  __m512 acc[MM][NB][2];
  for (int r = 0; r < MM; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j][0] = acc[r][j][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    // each block is one stream of K * 64 bytes: fetched kPrefetch pairs ahead, the weights of a
    // model too big for the caches arrive while the dot products run (a 200 MB weight at 8 rows:
    // 16.9 -> 10.2 ms; at one row 9.8 -> 8.0 ms)
    __m512bh wv[NB][2];
    for (int j = 0; j < NB; ++j) {
      const uint16_t* wj = w + j * stride;
      _mm_prefetch(reinterpret_cast<const char*>(wj + (kp + kPrefetch) * 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wj + (kp + kPrefetch) * 64 + 32), _MM_HINT_T0);
      wv[j][0] = (__m512bh)_mm512_loadu_si512(wj + kp * 64);
      wv[j][1] = (__m512bh)_mm512_loadu_si512(wj + kp * 64 + 32);
    }
    for (int r = 0; r < MM; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * kp_count + kp]));
      for (int j = 0; j < NB; ++j) {
        acc[r][j][0] = _mm512_dpbf16_ps(acc[r][j][0], wv[j][0], b);
        acc[r][j][1] = _mm512_dpbf16_ps(acc[r][j][1], wv[j][1], b);
      }
    }
  }
  store<MM, NB>(acc, out, ldo, n, accumulate);
}

// The same product with float32 FMAs: x is the bf16-rounded rows as float32 (xr[r * K + k]); a
// 32-bit pair of the packed block holds column c's weights at k (low half) and k + 1 (high half),
// which as float32 are the pair shifted left by 16 and the pair with its low half cleared.
template <int MM, int NB>
__attribute__((target("avx512f"))) void blocks_fma(const void* xv, int64_t kp_count, const uint16_t* w,
                                                   int64_t n, float* out, int64_t ldo, bool accumulate) {
  const float* xr = static_cast<const float*>(xv);
  const int64_t k = kp_count * 2, stride = kp_count * 64;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[MM][NB][2];
  for (int r = 0; r < MM; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j][0] = acc[r][j][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    __m512 even[NB][2], odd[NB][2];
    for (int j = 0; j < NB; ++j) {
      const uint16_t* wj = w + j * stride;
      _mm_prefetch(reinterpret_cast<const char*>(wj + (kp + kPrefetch) * 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wj + (kp + kPrefetch) * 64 + 32), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        const __m512i pair = _mm512_loadu_si512(wj + kp * 64 + 32 * h);
        even[j][h] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        odd[j][h] = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
      }
    }
    for (int r = 0; r < MM; ++r) {
      const __m512 xe = _mm512_set1_ps(xr[r * k + 2 * kp]);
      const __m512 xo = _mm512_set1_ps(xr[r * k + 2 * kp + 1]);
      for (int j = 0; j < NB; ++j)
        for (int h = 0; h < 2; ++h) acc[r][j][h] = _mm512_fmadd_ps(even[j][h], xe, acc[r][j][h]);
      for (int j = 0; j < NB; ++j)
        for (int h = 0; h < 2; ++h) acc[r][j][h] = _mm512_fmadd_ps(odd[j][h], xo, acc[r][j][h]);
    }
  }
  store<MM, NB>(acc, out, ldo, n, accumulate);
}

using Block = void (*)(const void*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool);
// [rows][i]: the loop over 1 << i blocks at once (column_blocks.h)
#define DSPARK_BLOCK_TABLE(F)                                                                    \
  {                                                                                              \
    {nullptr, nullptr, nullptr}, {F<1, 1>, F<1, 2>, F<1, 4>}, {F<2, 1>, F<2, 2>, F<2, 2>},       \
        {F<3, 1>, F<3, 2>, F<3, 2>}, {F<4, 1>, F<4, 1>, F<4, 1>}, {F<5, 1>, F<5, 1>, F<5, 1>},   \
        {F<6, 1>, F<6, 1>, F<6, 1>}, {F<7, 1>, F<7, 1>, F<7, 1>}, {F<8, 1>, F<8, 1>, F<8, 1>} \
  }
constexpr Block kDot[9][3] = DSPARK_BLOCK_TABLE(blocks_dot);
constexpr Block kFma[9][3] = DSPARK_BLOCK_TABLE(blocks_fma);
#undef DSPARK_BLOCK_TABLE

enum Variant { kVariantDot = 0, kVariantFma = 1, kVariantAmx = 2, kVariants = 3 };

inline uint32_t rounded_bits(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  return u + 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even at bit 16 (finite inputs)
}

int run(int variant, const float* x, int64_t m, int64_t k, const uint16_t* wp, int64_t n, float* out, int accumulate,
        int nthreads) {
  if (m <= 0 || k <= 0 || k % 2 || n <= 0 || n % 32 || !__builtin_cpu_supports("avx512bf16")) return 1;
  const bool amx = variant == kVariantAmx;
  if (amx && !dspark_has_amx()) return 1;
  const int64_t kp_count = k / 2;
  const bool fma = variant == kVariantFma;
  // dot and amx read the rows as bf16 pairs, fma as bf16-rounded float32; amx reads whole 16-row
  // tiles past 16 rows, so its last one is padded with zero rows
  const int64_t rows = amx && m > 16 ? (m + 15) / 16 * 16 : m;
  const size_t elem = fma ? sizeof(float) : sizeof(uint16_t);
  void* xb = malloc(elem * rows * k);
  if (!xb) return 1;
  for (int64_t i = 0; i < m * k; ++i) {
    const uint32_t bits = rounded_bits(x[i]);
    if (fma)
      static_cast<uint32_t*>(xb)[i] = bits & 0xFFFF0000u;
    else
      static_cast<uint16_t*>(xb)[i] = static_cast<uint16_t>(bits >> 16);
  }
  if (amx) {
    memset(static_cast<uint16_t*>(xb) + m * k, 0, elem * (rows - m) * k);
    const int status = dspark_linear_bf16_amx(static_cast<uint16_t*>(xb), m, k, wp, n, out, accumulate, nthreads);
    free(xb);
    return status;
  }
  const Block(*blocks)[3] = fma ? kFma : kDot;
  const int64_t row_stride = k * static_cast<int64_t>(fma ? sizeof(float) : sizeof(uint16_t));
  const char* xbytes = static_cast<const char*>(xb);
  const int64_t nblocks = n / 32, block_stride = kp_count * 64;
  dspark::over_column_blocks(
      nblocks, m, nthreads,
      [&](int64_t b, int64_t mb) {
        blocks[8][0](xbytes + mb * row_stride, kp_count, wp + b * block_stride, b * 32, out + mb * n, n,
                     accumulate != 0);
      },
      [&](int64_t b, int64_t step, int64_t first) {
        blocks[m - first][dspark::tail_index(step)](xbytes + first * row_stride, kp_count, wp + b * block_stride,
                                                    b * 32, out + first * n, n, accumulate != 0);
      });
  free(xb);
  return 0;
}

double seconds() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// The faster variant on this CPU: 8 rows times a 1 MB weight (in L2, so the arithmetic is timed,
// not memory), one thread, best of 5 alternating rounds of 10 calls each (~10 ms in all).
int timed_choice() {
  const int64_t m = 8, k = 1024, n = 512;
  float* x = static_cast<float*>(calloc(m * k + m * n, sizeof(float)));
  uint16_t* w = static_cast<uint16_t*>(calloc(k * n, sizeof(uint16_t)));
  if (!x || !w) {
    free(x);
    free(w);
    return kVariantDot;
  }
  for (int64_t i = 0; i < m * k; ++i) x[i] = static_cast<float>(i % 7) * 0.25f;
  for (int64_t i = 0; i < k * n; ++i) w[i] = static_cast<uint16_t>(0x3C00 + i % 97);
  double best[kVariants] = {1e30, 1e30, 1e30};
  const int variants = dspark_has_amx() ? 3 : 2;
  for (int round = 0; round < 5; ++round)
    for (int v = 0; v < variants; ++v) {
      const double t0 = seconds();
      for (int i = 0; i < 10; ++i) run(v, x, m, k, w, n, x + m * k, 0, 1);
      const double dt = seconds() - t0;
      if (dt < best[v]) best[v] = dt;
    }
  free(x);
  free(w);
  int chosen = kVariantDot;
  for (int v = 1; v < variants; ++v)
    if (best[v] < best[chosen]) chosen = v;
  return chosen;
}

int chosen_variant() {
  static const int variant = [] {
    const char* env = getenv("DSPARK_BF16_GEMM");
    if (env && strcmp(env, "dot") == 0) return static_cast<int>(kVariantDot);
    if (env && strcmp(env, "fma") == 0) return static_cast<int>(kVariantFma);
    if (env && strcmp(env, "amx") == 0 && dspark_has_amx()) return static_cast<int>(kVariantAmx);
    return __builtin_cpu_supports("avx512bf16") ? timed_choice() : static_cast<int>(kVariantDot);
  }();
  return variant;
}

}  // namespace

extern "C" {

// Whether this CPU runs the kernel (AVX512-BF16).
int dspark_has_bf16() { return __builtin_cpu_supports("avx512bf16") ? 1 : 0; }

// The inner loop dspark_linear_bf16 runs in this process: 0 dot (VDPBF16PS), 1 fma (float32 FMAs),
// 2 amx (the tile unit).
int dspark_bf16_gemm_variant() { return chosen_variant(); }

// Returns 0, or 1 for a bad argument (K odd, N not a multiple of 32, no AVX512-BF16, unknown variant,
// amx without the tile unit).
int dspark_linear_bf16_variant(const float* x, int64_t m, int64_t k, const uint16_t* wp, int64_t n, float* out,
                               int accumulate, int nthreads, int variant) {
  if (variant < 0 || variant >= kVariants) return 1;
  return run(variant, x, m, k, wp, n, out, accumulate, nthreads);
}

// The same with this process's variant.
int dspark_linear_bf16(const float* x, int64_t m, int64_t k, const uint16_t* wp, int64_t n, float* out,
                       int accumulate, int nthreads) {
  return run(chosen_variant(), x, m, k, wp, n, out, accumulate, nthreads);
}
}
