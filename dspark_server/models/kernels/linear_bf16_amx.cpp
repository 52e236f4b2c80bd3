// The AMX inner loop of linear_bf16.cpp: out[M, N] (+)= x[M, K] @ W with x already rounded to bf16
// rows and W in that file's packed layout, on Intel's tile unit (AMX-BF16: TDPBF16PS multiplies a
// tile of up to 16 rows x 32 K values by 32 K values x 16 columns in one instruction).
//
// The packed layout is already what a B tile reads: a 32-column block holds, per K pair, the 32
// columns' pairs in 128 bytes, so the 16 K pairs x 16 columns of one B tile are 16 rows of 64 bytes
// at a 128-byte stride (the block's first or second 16 columns). An A tile is 16 (or M) rows of x
// times 32 K values, read in place from the bf16 rows. A 32-column block is two C tiles.
//
// Each row's sum runs over K in the same order (K chunks of 32 in turn, the instruction's own order
// within a chunk) whatever M is and whatever rows share its tile, so, as for the other two loops, a
// row's result does not depend on the rows computed beside it. Where the vector loops run their
// FMAs, the tile unit runs the arithmetic of a verification block of 8 rows at close to the cost of
// the one row of a plain step, whose weights' bytes bound both (tools/bf16_gemm_ab.py).
//
// Linux gives a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM); each thread
// loads its own tile configuration and releases it at the end of the call.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr long kReqXcompPerm = 0x1023;  // arch_prctl: request a dynamically enabled state
constexpr long kXtileData = 18;         // the tile data state component
constexpr int64_t kPrefetch = 64;       // K pairs ahead (8 KB of a block's stream)

// Tile registers (the intrinsics take them as literals): 0 A (x rows x 32 K), 2 and 3 B (the
// block's halves), 4 and 5 C (the block's halves), and for the last K chunk where K / 2 is not a
// multiple of 16, 1 A and 6 and 7 B.
constexpr int kA = 0, kATail = 1, kB0 = 2, kB1 = 3, kC0 = 4, kC1 = 5, kBTail0 = 6, kBTail1 = 7;

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool permitted() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("amx-tile")) return false;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

__attribute__((target("amx-tile,amx-bf16"))) void configure(int rows, int tail_pairs) {
  TileConfig c;
  memset(&c, 0, sizeof(c));
  c.palette = 1;
  c.rows[kA] = c.rows[kC0] = c.rows[kC1] = static_cast<uint8_t>(rows);
  c.colsb[kA] = c.colsb[kC0] = c.colsb[kC1] = 64;
  c.rows[kB0] = c.rows[kB1] = 16;
  c.colsb[kB0] = c.colsb[kB1] = 64;
  if (!tail_pairs) {  // 6 and 7: the C tiles of a second block
    c.rows[kBTail0] = c.rows[kBTail1] = static_cast<uint8_t>(rows);
    c.colsb[kBTail0] = c.colsb[kBTail1] = 64;
  } else {
    c.rows[kATail] = static_cast<uint8_t>(rows);
    c.colsb[kATail] = static_cast<uint16_t>(4 * tail_pairs);
    c.rows[kBTail0] = c.rows[kBTail1] = static_cast<uint8_t>(tail_pairs);
    c.colsb[kBTail0] = c.colsb[kBTail1] = 64;
  }
  _tile_loadconfig(&c);
}

// The configured rows of x (bf16 rows of K, from `x`) times one 32-column block (its stream of
// kp_count * 64 bf16 at w), or two consecutive blocks (`kPair`: tiles 6 and 7 the second block's C,
// four independent accumulations instead of two, where K / 2 is a multiple of 16), stored as
// float32 at c (row stride ldc floats). Each column's sum runs over K in the same order either way.
template <bool kPair>
__attribute__((target("amx-tile,amx-bf16"))) void blocks(const uint16_t* x, int64_t k, const uint16_t* w,
                                                          int64_t kp_count, float* c, int64_t ldc) {
  const uint16_t* w1 = w + kp_count * 64;
  const int64_t full = kp_count / 16 * 16;
  _tile_zero(4);
  _tile_zero(5);
  if (kPair) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t kp = 0; kp < full; kp += 16) {
    // a block is one stream of kp_count * 128 bytes: fetched kPrefetch K pairs ahead
    for (int line = 0; line < 32; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kp + kPrefetch) * 64) + 64 * line, _MM_HINT_T0);
      if (kPair) _mm_prefetch(reinterpret_cast<const char*>(w1 + (kp + kPrefetch) * 64) + 64 * line, _MM_HINT_T0);
    }
    _tile_loadd(0, x + 2 * kp, 2 * k);
    _tile_loadd(2, w + kp * 64, 128);
    _tile_loadd(3, w + kp * 64 + 32, 128);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if (kPair) {
      _tile_loadd(2, w1 + kp * 64, 128);
      _tile_loadd(3, w1 + kp * 64 + 32, 128);
      _tile_dpbf16ps(6, 0, 2);
      _tile_dpbf16ps(7, 0, 3);
    }
  }
  if (!kPair && full < kp_count) {
    _tile_loadd(1, x + 2 * full, 2 * k);
    _tile_loadd(6, w + full * 64, 128);
    _tile_loadd(7, w + full * 64 + 32, 128);
    _tile_dpbf16ps(4, 1, 6);
    _tile_dpbf16ps(5, 1, 7);
  }
  _tile_stored(4, c, 4 * ldc);
  _tile_stored(5, c + 16, 4 * ldc);
  if (kPair) {
    _tile_stored(6, c + 32, 4 * ldc);
    _tile_stored(7, c + 48, 4 * ldc);
  }
}

__attribute__((target("amx-tile"))) void release() { _tile_release(); }

}  // namespace

extern "C" {

// Whether this CPU and kernel give the process the tile unit (AMX-BF16).
int dspark_has_amx() { return permitted() ? 1 : 0; }

// xb: the M rows of x as bf16, padded with zero rows to a multiple of 16 where M > 16 (the last
// tile reads them; their results are dropped). Returns 0, or 1 where the tile unit is not given.
int dspark_linear_bf16_amx(const uint16_t* xb, int64_t m, int64_t k, const uint16_t* wp, int64_t n, float* out,
                           int accumulate, int nthreads) {
  if (!permitted()) return 1;
  const int rows = m < 16 ? static_cast<int>(m) : 16;
  const int64_t kp_count = k / 2, chunks = (m + rows - 1) / rows, nblocks = n / 32;
  const int tail_pairs = static_cast<int>(kp_count % 16);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && nblocks > 1)
  {
    configure(rows, tail_pairs);
    alignas(64) float tmp[16 * 64];
    // two blocks a step where the tiles allow it and every thread still gets work
    const int64_t group = !tail_pairs && nblocks % 2 == 0 && nblocks / 2 >= nthreads ? 2 : 1;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < nblocks / group; ++g) {
      const int64_t b = g * group, cols = 32 * group;
      const uint16_t* w = wp + b * kp_count * 64;
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t r0 = ch * rows, valid = m - r0 < rows ? m - r0 : rows;
        float* o = out + r0 * n + 32 * b;
        const bool direct = !accumulate && valid == rows;
        float* c = direct ? o : tmp;
        const int64_t ldc = direct ? n : cols;
        if (group == 2)
          blocks<true>(xb + r0 * k, k, w, kp_count, c, ldc);
        else
          blocks<false>(xb + r0 * k, k, w, kp_count, c, ldc);
        if (direct) continue;
        for (int64_t r = 0; r < valid; ++r)
          for (int64_t j = 0; j < cols; ++j) o[r * n + j] = (accumulate ? o[r * n + j] : 0.f) + tmp[r * cols + j];
      }
    }
    release();
  }
  return 0;
}
}
