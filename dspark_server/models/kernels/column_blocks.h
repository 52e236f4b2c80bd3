// How the packed small-M GEMM kernels (linear_bf16.cpp's vector loops, linear_int8.cpp) split a
// call over threads: the weight's 32-column blocks in groups, each block taken 8 rows of x at a
// time, and the last m % 8 rows over several blocks at once where the group allows it (one block
// alone would leave a tail of 1-3 rows too few independent accumulators to hide the FMA latency).
#pragma once
#include <stdint.h>

namespace dspark {

// a tail of r rows takes up to this many consecutive blocks at once
constexpr int64_t kTailBlocks[9] = {0, 4, 2, 2, 1, 1, 1, 1, 1};

// The index of a tail of `blocks` consecutive blocks (1, 2 or 4) in a kernel table's row.
inline int tail_index(int64_t blocks) { return blocks == 4 ? 2 : static_cast<int>(blocks) - 1; }

// rows8(b, mb) for every block b and 8-row group starting at mb; tail(b, blocks, first_row) for the
// rows from first_row on, over `blocks` consecutive blocks from b. Threads take groups of 4 (or 2)
// blocks where there are enough to keep every thread busy.
template <class Rows8, class Tail>
inline void over_column_blocks(int64_t nblocks, int64_t m, int nthreads, Rows8 rows8, Tail tail) {
  int64_t group = 1;
  if (nblocks % 4 == 0 && nblocks / 4 >= 2 * nthreads)
    group = 4;
  else if (nblocks % 2 == 0 && nblocks / 2 >= 2 * nthreads)
    group = 2;
  const int64_t full = m / 8 * 8, rest = m - full;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && nblocks / group > 1)
  for (int64_t b0 = 0; b0 < nblocks; b0 += group) {
    for (int64_t b = b0; b < b0 + group; ++b)
      for (int64_t mb = 0; mb < full; mb += 8) rows8(b, mb);
    if (rest) {
      const int64_t step = kTailBlocks[rest] < group ? kTailBlocks[rest] : group;
      for (int64_t b = b0; b < b0 + group; b += step) tail(b, step, full);
    }
  }
}

}  // namespace dspark
