// The vanilla Markov head's greedy left-to-right draft in one call: for k = 1..g,
// x_k = argmax_v (U_k[v] + W2[v] . W1[x_{k-1}]) for every request of the block at once, the
// same arithmetic as drafter_heads.MarkovHead.step_logits + argmax (one GEMM per position through
// the BLAS sgemm PyTorch's addmm runs, whose address the caller passes; the first maximum wins, as
// torch.argmax). The loop is sequential in k — x_{k-1} picks the row of W1 — and a Python loop
// over it costs more in dispatch than the position's GEMM does.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"  // dspark_linear_bf16

#include "markov.h"

namespace {

constexpr int64_t kDirectRows = 2;  // up to this many requests: one pass over W2^T per request

// The first maximum of x[lo, hi) -> (value, index).
inline void argmax(const float* x, int64_t lo, int64_t hi, float* best, int64_t* at) {
  float m = x[lo];
#pragma omp simd reduction(max : m)
  for (int64_t i = lo; i < hi; ++i) m = x[i] > m ? x[i] : m;
  int64_t i = lo;
  while (i < hi && !(x[i] == m)) ++i;
  *best = m;
  *at = i < hi ? i : lo;
}

// logits[lo, hi) = base + sum_j z[j] * w2t[j, lo:hi) for one request.
inline void bias_direct(const float* base, const float* z, const float* w2t, int64_t vocab, int64_t rank, int64_t lo,
                        int64_t hi, float* logits) {
  for (int64_t v = lo; v < hi; ++v) logits[v] = base[v];
  for (int64_t j = 0; j < rank; ++j) {
    const float zj = z[j];
    const float* w = w2t + j * vocab;
#pragma omp simd
    for (int64_t v = lo; v < hi; ++v) logits[v] += zj * w[v];
  }
}
}  // namespace

extern "C" {

// dspark_markov_greedy_f32 for a few requests (each on its own) under weight-only bf16: the bias
// W2 W1[x] is linear_bf16.cpp's small-M GEMM (W1[x] rounded to bf16, W2^T [r, V] packed as the
// fused forwards' weights are) accumulated onto U_k: half the bytes of float32 W2, read by the
// AVX512-BF16 dot products.
int dspark_markov_greedy_bf16w(int64_t rows, int64_t g, int64_t vocab, int64_t rank, const float* base,
                               const int64_t* anchors, const float* w1, const uint16_t* w2_packed, int64_t* tokens,
                               int nthreads) {
  if (rows <= 0 || g <= 0 || vocab <= 0 || rank <= 0) return 1;
  for (int64_t i = 0; i < rows; ++i)
    if (anchors[i] < 0 || anchors[i] >= vocab) return 1;
  float* logits = static_cast<float*>(malloc(sizeof(float) * vocab));
  if (!logits) return 1;
  int rc = 0;
  for (int64_t i = 0; i < rows && rc == 0; ++i) {
    int64_t prev = anchors[i];
    for (int64_t k = 0; k < g; ++k) {
      memcpy(logits, base + (i * g + k) * vocab, sizeof(float) * vocab);
      if ((rc = dspark_linear_bf16(w1 + prev * rank, 1, rank, w2_packed, vocab, logits, 1, nthreads))) break;
      float m;
      argmax(logits, 0, vocab, &m, &prev);
      tokens[i * g + k] = prev;
    }
  }
  free(logits);
  return rc;
}

// base [R, g, V] (U_k per position), anchors [R], w1 [V, r] row-major, w2t [r, V] (W2 transposed,
// contiguous) and its packed copy w2p (linear_f32.cpp's panels, or null) -> tokens [R, g].
// Returns 0, or 1 for a bad argument.
int dspark_markov_greedy_f32(void* sgemm_fn, int64_t rows, int64_t g, int64_t vocab, int64_t rank, const float* base,
                             const int64_t* anchors, const float* w1, const float* w2t, const float* w2p, int64_t* tokens,
                             int nthreads) {
  dspark::Sgemm sgemm = reinterpret_cast<dspark::Sgemm>(sgemm_fn);
  if (!sgemm || rows <= 0 || g <= 0 || vocab <= 0 || rank <= 0) return 1;
  for (int64_t i = 0; i < rows; ++i)
    if (anchors[i] < 0 || anchors[i] >= vocab) return 1;
  const dspark::Gemms gemms{sgemm, dspark::kFloat32, nthreads};
  dspark::MarkovBlock block(rows, g, vocab, rank, base, w1, w2t, w2p);
  if (!block.start(anchors)) return 1;
  float *z = block.z, *logits = block.logits;
  int64_t* prev = block.prev;
  for (int64_t k = 0; k < g; ++k) {
    block.embed_prev();
    if (rows <= kDirectRows) {
      // few requests: each thread takes a slice of the vocabulary of every request
      for (int64_t i = 0; i < rows; ++i) {
        const int nt = nthreads > 1 ? nthreads : 1;
        float best[64];
        int64_t at[64];
        const int parts = nt < 64 ? nt : 64;
#pragma omp parallel for num_threads(parts) schedule(static)
        for (int p = 0; p < parts; ++p) {
          const int64_t lo = vocab * p / parts, hi = vocab * (p + 1) / parts;
          bias_direct(base + (i * g + k) * vocab, z + i * rank, w2t, vocab, rank, lo, hi, logits + i * vocab);
          argmax(logits + i * vocab, lo, hi, &best[p], &at[p]);
        }
        int64_t win = at[0];
        float m = best[0];
        for (int p = 1; p < parts; ++p)
          if (best[p] > m) m = best[p], win = at[p];
        prev[i] = win;
        tokens[i * g + k] = win;
      }
      continue;
    }
    block.corrected_logits(gemms, k);
#pragma omp parallel for num_threads(nthreads) if (rows * vocab >= (1 << 16))
    for (int64_t i = 0; i < rows; ++i) {
      float m;
      argmax(logits + i * vocab, 0, vocab, &m, &prev[i]);
      tokens[i * g + k] = prev[i];
    }
  }
  return 0;
}
}
