// out[M, N] (+)= x[M, K] @ W for float32 weights packed in column panels (f32_weights.py): the
// fused forward's GEMMs (gemm.h) up to a few hundred rows, where the CPU has AVX2 + FMA.
//
// Layout: panels of kPanel = 24 columns (three 8-lane vectors), the last one 8 or 16 wide when N
// is not a multiple of 24; panel p holds columns [24 p, 24 p + w) row after row,
// wp[24 p K + k w + c], so each panel is one contiguous stream of K * w floats.
//
// Why packed: in the serving layout ([K, N] row-major) a panel's rows lie a whole weight row
// apart, and a few rows of x read the weight as thousands of short strided runs that neither the
// hardware prefetcher nor software prefetches keep fed; MKL's sgemm, at these row counts, copies
// (packs) the whole weight on every call instead. On a 2-core AMD EPYC without AVX-512, the K = 8
// twin's GEMMs of one forward (176M weights, 705 MB, two threads), ms at 1 / 2 / 4 / 8 rows:
// strided panels 28 / 38 / 54 / 90, these packed ones 14-16 / 16 / 22-24 / 39 (one row then
// reads about 45 GB/s). MKL's own packed loop catches up at a few hundred rows (gemm.h).
//
// Blocking: threads take disjoint ranges of panels, so they never share an output. One to three
// rows: a tile covers 4 / 2 / 1 panels (12 / 12 / 9 accumulators of 16 registers) over all of K.
// Four rows or more: per panel, K in steps of kKc (the panel's slice, 24 KB, stays in L1) while
// row blocks of at most four rows, as even as possible, pass over it (three-row blocks, whose
// FMAs have registers to spare, were no faster).
//
// Every output is one chain of FMAs over k = 0, 1, ..., K - 1 from 0 (or from out, when
// accumulating), whatever M, the blocking or the thread count: a row's result does not depend on
// the rows computed beside it, so verification and plain decoding agree bit for bit.
#include <immintrin.h>
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// 256-bit vectors on AVX-512 CPUs too: at the few rows the kernel serves a call waits on memory,
// and one code path is the one the tests run wherever they run.
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kPanelVectors = 3;
constexpr int64_t kPanel = kPanelVectors * kLanes;  // columns of a full panel
constexpr int kRows = 4;                              // rows of a tile at most
constexpr int kAccumulators = 12;                     // of the 16 vector registers
constexpr int64_t kKc = 256;                          // K rows of a panel per pass (several row blocks)
constexpr bool kBuilt = true;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }

// out[r, j * 24 + v * 8 ...] for rows r < MR of NP panels NV vectors wide (NP > 1: full panels,
// panel j at w + j * pstride): start from out (`resume`: a later K pass, or an accumulating call)
// or 0, then FMAs over the kc rows of the panels from w (the first pass's row k0 of each).
template <int MR, int NP, int NV>
void tile(const float* x, int64_t ldx, const float* w, int64_t pstride, int64_t kc, float* out, int64_t ldo,
          bool resume) {
  static_assert(MR * NP * NV <= kAccumulators && (NP == 1 || NV == kPanelVectors));
  constexpr int64_t width = NV * kLanes;
  Vec acc[MR][NP][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j)
      for (int v = 0; v < NV; ++v)
        acc[r][j][v] = resume ? load(out + r * ldo + j * kPanel + v * kLanes) : _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    Vec b[NP][NV];
    for (int j = 0; j < NP; ++j)
      for (int v = 0; v < NV; ++v) {
        b[j][v] = load(w + j * pstride + k * width + v * kLanes);
        // several rows: b stays in a register. Left to itself GCC folds the load into each row's
        // FMA (12 accumulators + 3 b + 1 broadcast fill all 16 registers), so a 4-row step
        // issued 16 loads for 12 FMAs and waited on the load ports: the K=8 twin's GEMMs of one
        // forward at 8 / 16 rows took 40-45 / 69-74 ms, with b held 31-34 / 46-51
        if constexpr (MR > 1) asm("" : "+x"(b[j][v]));
      }
    for (int r = 0; r < MR; ++r) {
      const Vec a = _mm256_set1_ps(x[r * ldx + k]);
      for (int j = 0; j < NP; ++j)
        for (int v = 0; v < NV; ++v) acc[r][j][v] = _mm256_fmadd_ps(a, b[j][v], acc[r][j][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j)
      for (int v = 0; v < NV; ++v) store(out + r * ldo + j * kPanel + v * kLanes, acc[r][j][v]);
}

using Tile = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool);

template <int MR>
Tile pick_rows(int np, int nv) {
  if constexpr (MR == 1)
    if (np == 4) return &tile<1, 4, kPanelVectors>;
  if constexpr (MR <= 2)
    if (np == 2) return &tile<MR, 2, kPanelVectors>;
  return nv == 1 ? &tile<MR, 1, 1> : nv == 2 ? &tile<MR, 1, 2> : &tile<MR, 1, kPanelVectors>;
}

// The tile for rows (1-4) of np panels (np > 1 only where the registers hold them), nv vectors wide.
Tile pick(int rows, int np, int nv) {
  switch (rows) {
    case 1:
      return pick_rows<1>(np, nv);
    case 2:
      return pick_rows<2>(np, nv);
    case 3:
      return pick_rows<3>(np, nv);
    default:
      return pick_rows<4>(np, nv);
  }
}

// Panels a tile covers at `rows` rows (1-3): as many as the accumulators hold.
constexpr int panels_per_tile(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

// The rows of x times panels [p0, p1) of the n columns: one thread's share.
void run_share(const float* x, int64_t m, int64_t k, const float* wp, int64_t n, float* out, bool accumulate,
               int64_t p0, int64_t p1) {
  const int64_t full_panels = n / kPanel;
  auto width = [&](int64_t p) { return p < full_panels ? kPanel : n - full_panels * kPanel; };
  if (m < kRows) {  // one pass over K with groups of panels
    const int rows = static_cast<int>(m), group = panels_per_tile(m);
    for (int64_t p = p0; p < p1;) {
      const int np = p + group <= p1 && p + group <= full_panels ? group : 1;
      pick(rows, np, static_cast<int>(width(p) / kLanes))(x, k, wp + p * kPanel * k, kPanel * k, k,
                                                          out + p * kPanel, n, accumulate);
      p += np;
    }
    return;
  }
  const int64_t blocks = (m + kRows - 1) / kRows;  // row blocks of m / blocks rows, the first m % blocks one more
  const int64_t kc_step = blocks == 1 ? k : kKc;
  for (int64_t p = p0; p < p1; ++p) {
    const int nv = static_cast<int>(width(p) / kLanes);
    const float* panel = wp + p * kPanel * k;
    for (int64_t k0 = 0; k0 < k; k0 += kc_step) {
      const int64_t kc = k - k0 < kc_step ? k - k0 : kc_step;
      for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
        const int rows = static_cast<int>(m / blocks + (b < m % blocks ? 1 : 0));
        pick(rows, 1, nv)(x + r0 * k + k0, k, panel + k0 * width(p), 0, kc, out + r0 * n + p * kPanel, n,
                          accumulate || k0 > 0);
        r0 += rows;
      }
    }
  }
}
#else
constexpr bool kBuilt = false;
#endif

}  // namespace

extern "C" {

// Whether this build has the kernel (compiled for AVX2 + FMA here): else the fused forwards keep
// no packed copies and run the BLAS sgemm.
int dspark_has_linear_f32() { return kBuilt ? 1 : 0; }

// out[m, n] = x[m, k] @ W (+ out when accumulate), W [k, n] in the packed layout above. Returns 1
// (nothing written) where it does not apply: no kernel in this build, n not a multiple of the
// vector width, bad sizes.
int dspark_linear_f32(const float* x, int64_t m, int64_t k, const float* wp, int64_t n, float* out, int accumulate,
                      int nthreads) {
#if defined(__AVX2__) && defined(__FMA__)
  if (m <= 0 || k <= 0 || n <= 0 || n % kLanes) return 1;
  // threads split the panels (in whole tile groups at few rows); a small weight is not worth a
  // second thread
  const int64_t panels = (n + kPanel - 1) / kPanel, group = m < kRows ? panels_per_tile(m) : 1;
  const int64_t groups = (panels + group - 1) / group;
  int threads = nthreads > 1 && k * n >= (int64_t{1} << 15) ? nthreads : 1;
  if (threads > groups) threads = static_cast<int>(groups);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
    const int64_t p0 = groups * t / nt * group, p1 = groups * (t + 1) / nt * group;
    run_share(x, m, k, wp, n, out, accumulate != 0, p0, p1 < panels ? p1 : panels);
  }
  return 0;
#else
  (void)x, (void)m, (void)k, (void)wp, (void)n, (void)out, (void)accumulate, (void)nthreads;
  return 1;
#endif
}

}  // extern "C"
