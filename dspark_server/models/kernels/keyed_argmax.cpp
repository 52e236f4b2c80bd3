// Keyed draws over whole rows in one call (keyed_draw.h): seeded plain steps and the coupled
// verification of seeded drafts, where the PyTorch form costs a generator, 6,144 float64 uniforms
// and two logs per row.
#include <stdint.h>

#include "keyed_draw.h"

extern "C" {

// w [rows, vocab] float32 (>= 0), keys [rows] -> out [rows]. Returns 0, or 1 for a bad argument.
int dspark_keyed_argmax(const float* w, int64_t rows, int64_t vocab, const uint64_t* keys, int64_t* out,
                        int nthreads) {
  if (rows <= 0 || vocab <= 0) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && rows > 1)
  for (int64_t r = 0; r < rows; ++r) out[r] = dspark::keyed_argmax(w + r * vocab, vocab, keys[r]);
  return 0;
}
}
