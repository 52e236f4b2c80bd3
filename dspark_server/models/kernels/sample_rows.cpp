// Temperature sampling in one call: for each row, one draw from softmax(logits / T) by inverse
// CDF with the row's uniform u in [0, 1): the first index whose cumulative weight exceeds
// u * total, in double precision (never a zero-weight index). The same draw as
// sampling.inverse_cdf over sampling.shape_probs' temperature-only distribution, without its
// half-dozen tensor ops (at one request, the plain step's sampling cost about as much as a
// sixth of its forward). Seeded rows (keyed[r] != 0) take their keyed draw (keyed_draw.h) over the
// same weights instead.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "keyed_draw.h"
#include "temperature_draw.h"

extern "C" {

// logits [rows, vocab] float32, temps [rows] (> 0), uniforms [rows], keyed [rows] and keys [rows]
// (both null when no row is seeded) -> out [rows]. Returns 0, or 1 for a bad argument.
int dspark_sample_temperature(const float* logits, int64_t rows, int64_t vocab, const float* temps,
                              const double* uniforms, const uint8_t* keyed, const uint64_t* keys, int64_t* out,
                              int nthreads) {
  if (rows <= 0 || vocab <= 0 || (keyed == nullptr) != (keys == nullptr)) return 1;
  for (int64_t r = 0; r < rows; ++r)
    if (!(temps[r] > 0.f) || !(uniforms[r] >= 0.0 && uniforms[r] < 1.0)) return 1;
  int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows > 1) reduction(| : bad)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * vocab;
    float* w = static_cast<float*>(malloc(sizeof(float) * vocab));
    if (!w) {
      bad = 1;
      continue;
    }
    const double total = dspark::temperature_weights(x, vocab, 1.f / temps[r], w);
    out[r] = keyed != nullptr && keyed[r] != 0 ? dspark::keyed_argmax(w, vocab, keys[r])
                                               : dspark::inverse_cdf_draw(w, vocab, uniforms[r] * total);
    free(w);
  }
  return bad;
}
}
