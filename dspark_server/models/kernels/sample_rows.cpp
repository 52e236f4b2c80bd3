// Temperature sampling in one call: for each row, one draw from softmax(logits / T) by inverse
// CDF with the row's uniform u in [0, 1): the first index whose cumulative weight exceeds
// u * total, in double precision (never a zero-weight index). The same draw as
// sampling.inverse_cdf over sampling.shape_probs' temperature-only distribution, without its
// half-dozen tensor ops (at one request, the plain step's sampling cost about as much as a
// sixth of its forward).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc libmvec's 16-lane expf
#endif

extern "C" {

// logits [rows, vocab] float32, temps [rows] (> 0), uniforms [rows] -> out [rows]. Returns 0, or
// 1 for a bad argument.
int dspark_sample_temperature(const float* logits, int64_t rows, int64_t vocab, const float* temps,
                              const double* uniforms, int64_t* out, int nthreads) {
  if (rows <= 0 || vocab <= 0) return 1;
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
    float m = x[0];
    for (int64_t i = 1; i < vocab; ++i) m = x[i] > m ? x[i] : m;
    const float inv_t = 1.f / temps[r];
    double total = 0.0;
    int64_t i0 = 0;
#ifdef __AVX512F__
    const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_t);
    for (; i0 + 16 <= vocab; i0 += 16) {
      const __m512 e = _ZGVeN16v_expf(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i0), vm), vt));
      _mm512_storeu_ps(w + i0, e);
      total += _mm512_reduce_add_ps(e);
    }
#endif
    for (int64_t i = i0; i < vocab; ++i) {
      w[i] = expf((x[i] - m) * inv_t);
      total += w[i];
    }
    const double target = uniforms[r] * total;
    double cum = 0.0;
    int64_t pick = -1, last = -1;
    for (int64_t i = 0; i < vocab; ++i) {
      if (w[i] <= 0.f) continue;
      last = i;
      cum += w[i];
      if (cum > target) {
        pick = i;
        break;
      }
    }
    out[r] = pick >= 0 ? pick : last;  // rounding left u * total at the end: the last token
    free(w);
  }
  return bad;
}
}
