// The vanilla Markov head's sampled left-to-right draft in one call, for rows shaped by
// temperature alone: for k = 1..g, q_k = softmax((U_k + W2 . W1[x_{k-1}]) / T) and x_k is one
// inverse-CDF draw from q_k with the row's uniform u_k — the arithmetic of
// drafter_heads.MarkovHead.step_logits, sampling.shape_probs (temperature only) and
// sampling.inverse_cdf, position by position, without their dozen tensor ops per position (at one
// request a sampled block cost about a third of a drafting step in dispatch). q_k is written out:
// verification's acceptance test and residual need the distribution each draft came from, and
// each x_k is drawn from exactly the q_k written. Seeded rows (keyed[i] != 0) draw x_k by their
// keyed noise instead (keyed_draw.h, key keys[i, k]), from the same q_k.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "keyed_draw.h"
#include "markov.h"
#include "temperature_draw.h"

namespace {

// q = softmax(x / t) over [0, vocab), then one draw from q: inverse CDF with uniform u, or the
// keyed draw of key where keyed.
int64_t softmax_draw(const float* x, int64_t vocab, float t, double u, bool keyed, uint64_t key, float* q) {
  const float inv = static_cast<float>(1.0 / dspark::temperature_weights(x, vocab, 1.f / t, q));
  double cdf_end = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    q[i] *= inv;
    cdf_end += q[i];
  }
  return keyed ? dspark::keyed_argmax(q, vocab, key) : dspark::inverse_cdf_draw(q, vocab, u * cdf_end);
}
}  // namespace

extern "C" {

// base [R, g, V] (U_k per position), anchors [R], w1 [V, r] row-major, w2t [r, V] (W2 transposed,
// contiguous) and its packed copy w2p (linear_f32.cpp's panels, or null), temps [R] (> 0),
// uniforms [R, g] in [0, 1), keyed [R] and keys [R, g] (both null when no row is seeded) ->
// tokens [R, g], probs [R, g, V]. Returns 0, or 1 for a bad argument.
int dspark_markov_sample_f32(void* sgemm_fn, int64_t rows, int64_t g, int64_t vocab, int64_t rank,
                             const float* base, const int64_t* anchors, const float* w1, const float* w2t, const float* w2p,
                             const float* temps, const double* uniforms, const uint8_t* keyed,
                             const uint64_t* keys, int64_t* tokens, float* probs, int nthreads) {
  dspark::Sgemm sgemm = reinterpret_cast<dspark::Sgemm>(sgemm_fn);
  if (!sgemm || rows <= 0 || g <= 0 || vocab <= 0 || rank <= 0 || (keyed == nullptr) != (keys == nullptr))
    return 1;
  for (int64_t i = 0; i < rows; ++i) {
    if (anchors[i] < 0 || anchors[i] >= vocab || !(temps[i] > 0.f)) return 1;
    for (int64_t k = 0; k < g; ++k)
      if (!(uniforms[i * g + k] >= 0.0 && uniforms[i * g + k] < 1.0)) return 1;
  }
  const dspark::Gemms gemms{sgemm, dspark::kFloat32, nthreads};
  dspark::MarkovBlock block(rows, g, vocab, rank, base, w1, w2t, w2p);
  if (!block.start(anchors)) return 1;
  for (int64_t k = 0; k < g; ++k) {
    block.embed_prev();
    block.corrected_logits(gemms, k);
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1 && rows > 1)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t at = (i * g + k) * vocab;
      const bool seeded = keyed != nullptr && keyed[i] != 0;
      const uint64_t key = seeded ? keys[i * g + k] : 0;
      block.prev[i] =
          softmax_draw(block.logits + i * vocab, vocab, temps[i], uniforms[i * g + k], seeded, key, probs + at);
      tokens[i * g + k] = block.prev[i];
    }
  }
  return 0;
}
}
