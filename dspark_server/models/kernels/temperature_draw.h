// The two steps every temperature sampler here takes (sample_rows.cpp for plain steps,
// markov_sample.cpp for draft blocks): the row's weights exp((x - max x) / T), and the
// inverse-CDF draw over them, in double precision, never landing on a zero weight.
#pragma once
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc libmvec's 16-lane expf
#endif

namespace dspark {

// w[i] = exp((x[i] - max x) * inv_t) for i < n; returns their sum (in double).
inline double temperature_weights(const float* x, int64_t n, float inv_t, float* w) {
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = x[i] > m ? x[i] : m;
  double total = 0.0;
  int64_t i0 = 0;
#ifdef __AVX512F__
  const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(inv_t);
  for (; i0 + 16 <= n; i0 += 16) {
    const __m512 e = _ZGVeN16v_expf(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i0), vm), vt));
    _mm512_storeu_ps(w + i0, e);
    total += _mm512_reduce_add_ps(e);
  }
#endif
  for (int64_t i = i0; i < n; ++i) {
    w[i] = expf((x[i] - m) * inv_t);
    total += w[i];
  }
  return total;
}

// The first index whose cumulative weight (in double) exceeds target; the last positive weight's
// index when rounding left target at the end.
inline int64_t inverse_cdf_draw(const float* w, int64_t n, double target) {
  double cum = 0.0;
  int64_t last = n - 1;
  for (int64_t i = 0; i < n; ++i) {
    if (w[i] <= 0.f) continue;
    last = i;
    cum += w[i];
    if (cum > target) return i;
  }
  return last;
}

}  // namespace dspark
