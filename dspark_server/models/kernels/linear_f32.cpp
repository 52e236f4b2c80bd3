// out[M, N] (+)= x[M, K] @ W for float32 weights in the serving layout (W [K, N] row-major, row
// stride ldw): the fused forward's GEMMs (gemm.h) where the CPU has AVX2 + FMA.
//
// Why not the BLAS sgemm PyTorch links (MKL): at the few rows of decoding and verification MKL
// copies (packs) the whole weight on every call, and on AMD CPUs it takes a generic path. On a
// 2-core AMD EPYC without AVX-512 (the demo target's shapes, K 256, N 6144, two threads) MKL took
// 164 / 438 / 467 us at 1 / 4 / 8 rows, its packing copy (mkl_blas_def_sgemm_scopy_down16_bdz)
// a quarter of a whole drafting step's time, so verifying 8 tokens cost 3.6 forwards of one.
// Here the weight is read where it lies, once per block of rows (gemm.h has the timings and
// the row count where MKL's packed loop takes over).
//
// Blocking: threads take disjoint ranges of column panels, as wide as the registers hold
// accumulators for the rows (AVX2: 12 vectors at one row, 3 at four), so they never share an
// output; each thread walks row chunks of kMc rows, then K in steps of kKc (a panel's kKc rows
// stay in L1 while the chunk's row blocks of kRows rows pass over it). A panel's rows lie a whole
// weight row apart, so the rows kAhead ahead are prefetched; one row reads 384 contiguous bytes
// a K step and streams at about twice the rate of four rows' 96 (panels 12 vectors wide at every
// row count, sub-tiled, with 64-row K passes, were no faster).
//
// Every output is one chain of FMAs over k = 0, 1, ..., K - 1 from 0 (or from out, when
// accumulating), whatever M, the blocking or the thread count: a row's result does not depend on
// the rows computed beside it, so verification and plain decoding agree bit for bit.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// 256-bit vectors on AVX-512 CPUs too: at the few rows the kernel serves a call waits on memory,
// and one code path is the one the tests run wherever they run.
#if defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kRows = 4;     // MR, the rows of a tile (2 or 3: no faster at 4-16 rows)
constexpr int kMaxTile = 12;  // accumulators in a tile, of 16 registers
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec splat(float s) { return _mm256_set1_ps(s); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
constexpr bool kBuilt = true;
constexpr int64_t kKc = 256;         // K rows of a panel per pass
constexpr int64_t kMc = 64;          // rows of x per chunk
constexpr int64_t kAhead = 16;       // K rows prefetched ahead (48, 96: no faster)
constexpr int kLine = 64 / static_cast<int>(sizeof(float));

// out[r, 0 : NV vectors] for rows r < MR: start from out (`resume`: a later K pass, or an
// accumulating call) or 0, then FMAs over the kc rows of w. The panel's rows lie ldw apart: the
// rows kAhead ahead are prefetched, which a strided stream needs.
template <int MR, int NV>
void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kc, int64_t k_left, float* out,
          int64_t ldo, bool resume) {
  Vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = resume ? load(out + r * ldo + v * kLanes) : zero();
  for (int64_t k = 0; k < kc; ++k) {
    if (k + kAhead < k_left)
      for (int c = 0; c < NV * kLanes; c += kLine)
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + kAhead) * ldw + c), _MM_HINT_T0);
    Vec b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(w + k * ldw + v * kLanes);
    for (int r = 0; r < MR; ++r) {
      const Vec a = splat(x[r * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(a, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) store(out + r * ldo + v * kLanes, acc[r][v]);
}

using Tile = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t, bool);

// tile<MR, NV> for 1 <= MR <= kRows and 1 <= NV <= kMaxTile / MR (null elsewhere)
struct Tiles {
  Tile at[kRows + 1][kMaxTile + 1] = {};
  template <int MR, int NV>
  constexpr void fill() {
    if constexpr (NV <= kMaxTile / MR) at[MR][NV] = &tile<MR, NV>;
    if constexpr (NV < kMaxTile) fill<MR, NV + 1>();
  }
  template <int MR>
  constexpr void rows() {
    fill<MR, 1>();
    if constexpr (MR < kRows) rows<MR + 1>();
  }
  constexpr Tiles() { rows<1>(); }
};
constexpr Tiles kTiles{};

// Vectors per column panel for a block of `rows` rows: all the accumulators the registers hold,
// so one or two rows (decoding) read the weight in wide contiguous runs with many FMA chains.
constexpr int panel_vectors(int64_t rows) {
  return rows >= kRows ? kMaxTile / kRows : kMaxTile / static_cast<int>(rows);
}

// The rows of x times the columns [c0, c1) (multiples of kLanes): one thread's share.
void run_share(const float* x, int64_t m, int64_t k, const float* w, int64_t ldw, int64_t n, float* out,
               bool accumulate, int64_t c0, int64_t c1) {
  for (int64_t m0 = 0; m0 < m; m0 += kMc) {
    const int64_t mc = m - m0 < kMc ? m - m0 : kMc;
    for (int64_t k0 = 0; k0 < k; k0 += kKc) {
      const int64_t kc = k - k0 < kKc ? k - k0 : kKc;
      const bool resume = accumulate || k0 > 0;
      const int nv_full = panel_vectors(mc);
      for (int64_t col = c0; col < c1; col += nv_full * kLanes) {
        const int64_t left = (c1 - col) / kLanes;
        const int nv = left < nv_full ? static_cast<int>(left) : nv_full;
        const float* wp = w + k0 * ldw + col;
        for (int64_t r0 = 0; r0 < mc; r0 += kRows) {
          const int rows = mc - r0 < kRows ? static_cast<int>(mc - r0) : kRows;
          const int tile_nv = nv <= kMaxTile / rows ? nv : kMaxTile / rows;
          for (int v0 = 0; v0 < nv; v0 += tile_nv) {  // a tail block of rows may take narrower tiles
            const int w_nv = nv - v0 < tile_nv ? nv - v0 : tile_nv;
            kTiles.at[rows][w_nv](x + (m0 + r0) * k + k0, k, wp + v0 * kLanes, ldw, kc, k - k0,
                                  out + (m0 + r0) * n + col + v0 * kLanes, n, resume);
          }
        }
      }
    }
  }
}
#else
constexpr bool kBuilt = false;
#endif

}  // namespace

extern "C" {

// Whether this build has the kernel (compiled for AVX2 + FMA here): else callers use
// the BLAS sgemm.
int dspark_has_linear_f32() { return kBuilt ? 1 : 0; }

// Whether the fused forward's float32 GEMMs run this kernel (1) or the BLAS sgemm (0): the kernel
// where this build has it, unless DSPARK_F32_GEMM=blas (read once per process).
int dspark_f32_gemm_kernel() {
  static const int on = [] {
    const char* env = getenv("DSPARK_F32_GEMM");
    return kBuilt && !(env && strcmp(env, "blas") == 0) ? 1 : 0;
  }();
  return on;
}

// out[m, n] = x[m, k] @ w (+ out when accumulate): w [k, n] row-major with row stride ldw (n, or
// more for a slice of a wider weight's columns). Returns 1 (nothing written) where it does not
// apply: no kernel in this build, n not a multiple of the vector width, bad sizes.
int dspark_linear_f32(const float* x, int64_t m, int64_t k, const float* w, int64_t ldw, int64_t n, float* out,
                      int accumulate, int nthreads) {
#if defined(__AVX2__) && defined(__FMA__)
  if (m <= 0 || k <= 0 || n <= 0 || n % kLanes || ldw < n) return 1;
  // threads split the columns in whole panels; a small weight is not worth a second thread
  const int64_t panel = panel_vectors(m < kMc ? m : kMc) * kLanes, panels = (n + panel - 1) / panel;
  int threads = nthreads > 1 && k * n >= (int64_t{1} << 15) ? nthreads : 1;
  if (threads > panels) threads = static_cast<int>(panels);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
    const int64_t c0 = panels * t / nt * panel, c1 = panels * (t + 1) / nt * panel;
    run_share(x, m, k, w, ldw, n, out, accumulate != 0, c0, c1 < n ? c1 : n);
  }
  return 0;
#else
  (void)x, (void)m, (void)k, (void)w, (void)ldw, (void)n, (void)out, (void)accumulate, (void)nthreads;
  return 1;
#endif
}

}  // extern "C"
