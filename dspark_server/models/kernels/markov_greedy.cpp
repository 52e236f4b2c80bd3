// The vanilla Markov head's greedy left-to-right draft in one call: for k = 1..g,
// x_k = argmax_v (U_k[v] + W2[v] . W1[x_{k-1}]) for every request of the block at once, the
// same arithmetic as drafter_heads.MarkovHead.step_logits + argmax (one GEMM per position through
// the BLAS sgemm PyTorch's addmm runs, whose address the caller passes; the first maximum wins, as
// torch.argmax). The loop is sequential in k — x_{k-1} picks the row of W1 — and a Python loop
// over it costs more in dispatch than the position's GEMM does.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {
using Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                       const int*, const float*, const int*, const float*, float*, const int*);

int64_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  float m = x[0];
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > m) {
      m = x[i];
      best = i;
    }
  return best;
}
}  // namespace

extern "C" {

// base [R, g, V] (U_k per position), anchors [R], w1 [V, r], w2 [V, r] (both row-major) ->
// tokens [R, g]. Returns 0, or 1 for a bad argument.
int dspark_markov_greedy_f32(void* sgemm_fn, int64_t rows, int64_t g, int64_t vocab, int64_t rank, const float* base,
                             const int64_t* anchors, const float* w1, const float* w2, int64_t* tokens,
                             int nthreads) {
  Sgemm sgemm = reinterpret_cast<Sgemm>(sgemm_fn);
  if (!sgemm || rows <= 0 || g <= 0 || vocab <= 0 || rank <= 0) return 1;
  float* z = static_cast<float*>(malloc(sizeof(float) * rows * (rank + vocab)));
  int64_t* prev = static_cast<int64_t*>(malloc(sizeof(int64_t) * rows));
  if (!z || !prev) {
    free(z);
    free(prev);
    return 1;
  }
  float* logits = z + rows * rank;
  for (int64_t i = 0; i < rows; ++i) prev[i] = anchors[i];
  const int vi = static_cast<int>(vocab), ri = static_cast<int>(rows), ki = static_cast<int>(rank);
  const float one = 1.f;
  int rc = 0;
  for (int64_t k = 0; k < g && rc == 0; ++k) {
    for (int64_t i = 0; i < rows; ++i) {
      if (prev[i] < 0 || prev[i] >= vocab) {
        rc = 1;
        break;
      }
      memcpy(z + i * rank, w1 + prev[i] * rank, sizeof(float) * rank);
      memcpy(logits + i * vocab, base + (i * g + k) * vocab, sizeof(float) * vocab);
    }
    if (rc) break;
    // logits^T (V x R, column-major) += W2 (V x r: w2 read transposed) . z^T (r x R)
    sgemm("T", "N", &vi, &ri, &ki, &one, w2, &ki, z, &ki, &one, logits, &vi);
#pragma omp parallel for num_threads(nthreads) if (rows * vocab >= (1 << 16))
    for (int64_t i = 0; i < rows; ++i) {
      prev[i] = argmax(logits + i * vocab, vocab);
      tokens[i * g + k] = prev[i];
    }
  }
  free(z);
  free(prev);
  return rc;
}
}
