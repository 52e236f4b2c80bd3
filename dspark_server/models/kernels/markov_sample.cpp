// The vanilla Markov head's sampled left-to-right draft in one call, for rows shaped by
// temperature alone: for k = 1..g, q_k = softmax((U_k + W2 . W1[x_{k-1}]) / T) and x_k is one
// inverse-CDF draw from q_k with the row's uniform u_k — the arithmetic of
// drafter_heads.MarkovHead.step_logits, sampling.shape_probs (temperature only) and
// sampling.inverse_cdf, position by position, without their dozen tensor ops per position (at one
// request a sampled block cost about a third of a drafting step in dispatch). q_k is written out:
// verification's acceptance test and residual need the distribution each draft came from, and
// each x_k is drawn from exactly the q_k written.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc libmvec's 16-lane expf
#endif

#include "markov.h"

namespace {

// q = softmax(x / t) over [0, vocab); returns the first index whose cumulative q (in double)
// exceeds u * sum(q), else the last index with q > 0 (rounding left u * sum at the end).
int64_t softmax_draw(const float* x, int64_t vocab, float t, double u, float* q) {
  const float inv_t = 1.f / t;
  float m = x[0] * inv_t;
  for (int64_t i = 1; i < vocab; ++i) {
    const float s = x[i] * inv_t;
    m = s > m ? s : m;
  }
  float total = 0.f;
  int64_t i0 = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  const __m512 vt = _mm512_set1_ps(inv_t), vm = _mm512_set1_ps(m);
  for (; i0 + 16 <= vocab; i0 += 16) {
    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i0), vt), vm));
    _mm512_storeu_ps(q + i0, e);
    acc = _mm512_add_ps(acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (int64_t i = i0; i < vocab; ++i) {
    q[i] = expf(x[i] * inv_t - m);
    total += q[i];
  }
  const float inv = 1.f / total;
  double cdf_end = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    q[i] *= inv;
    cdf_end += q[i];
  }
  const double target = u * cdf_end;
  double cum = 0.0;
  int64_t last = vocab - 1;
  for (int64_t i = 0; i < vocab; ++i) {
    if (q[i] <= 0.f) continue;
    cum += q[i];
    last = i;
    if (cum > target) return i;
  }
  return last;
}
}  // namespace

extern "C" {

// base [R, g, V] (U_k per position), anchors [R], w1 [V, r] row-major, w2t [r, V] (W2 transposed,
// contiguous), temps [R] (> 0), uniforms [R, g] in [0, 1) -> tokens [R, g], probs [R, g, V].
// Returns 0, or 1 for a bad argument.
int dspark_markov_sample_f32(void* sgemm_fn, int64_t rows, int64_t g, int64_t vocab, int64_t rank,
                             const float* base, const int64_t* anchors, const float* w1, const float* w2t,
                             const float* temps, const double* uniforms, int64_t* tokens, float* probs,
                             int nthreads) {
  dspark::Sgemm sgemm = reinterpret_cast<dspark::Sgemm>(sgemm_fn);
  if (!sgemm || rows <= 0 || g <= 0 || vocab <= 0 || rank <= 0) return 1;
  for (int64_t i = 0; i < rows; ++i) {
    if (anchors[i] < 0 || anchors[i] >= vocab || !(temps[i] > 0.f)) return 1;
    for (int64_t k = 0; k < g; ++k)
      if (!(uniforms[i * g + k] >= 0.0 && uniforms[i * g + k] < 1.0)) return 1;
  }
  dspark::MarkovBlock block(rows, g, vocab, rank, base, w1, w2t);
  if (!block.start(anchors)) return 1;
  for (int64_t k = 0; k < g; ++k) {
    block.embed_prev();
    block.corrected_logits(sgemm, k);
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && rows > 1)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t at = (i * g + k) * vocab;
      block.prev[i] = softmax_draw(block.logits + i * vocab, vocab, temps[i], uniforms[i * g + k], probs + at);
      tokens[i * g + k] = block.prev[i];
    }
  }
  return 0;
}
}
