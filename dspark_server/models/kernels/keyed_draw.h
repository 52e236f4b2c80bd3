// Keyed draws for seeded requests (engine/noise.py states the rule; this is its kernel): a row's
// token is argmax_i w_i / E_i, where w are the row's (unnormalised) weights and
// E_i = -log u_i is exponential noise with u_i a pure function of the row's key and i — the
// exponential-race form of Gumbel-max (argmax log w_i + G_i), one log per element instead of two.
// u_i = ((mix64(key + (i + 1) * golden) >> 11) + 1/2) * 2^-53: SplitMix64 as a counter-based
// generator, so any element's noise is computed without the ones before it.
#pragma once
#include <math.h>
#include <stdint.h>

namespace dspark {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t mix64(uint64_t z) {  // SplitMix64's finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline double keyed_uniform(uint64_t key, int64_t i) {  // in (0, 1)
  return (static_cast<double>(mix64(key + static_cast<uint64_t>(i + 1) * kGolden) >> 11) + 0.5) * 0x1.0p-53;
}

// argmax_i w_i / -log(u_i) over w[0, n) (w_i >= 0; zero weights never win unless all are zero),
// the lowest index among equal scores. Exact, but most elements skip their log: -log u >= 1 - u,
// so an element with w_i < (1 - u_i) * best (with a margin far above rounding) cannot win.
inline int64_t keyed_argmax(const float* w, int64_t n, uint64_t key) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i) best = w[i] > w[best] ? i : best;
  if (!(w[best] > 0.f)) return best;
  double best_score = static_cast<double>(w[best]) / -log(keyed_uniform(key, best));
  double bar = best_score * 0.999;
  constexpr int64_t kChunk = 256;
  double u[kChunk];
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t m = n - c0 < kChunk ? n - c0 : kChunk;
    for (int64_t j = 0; j < m; ++j) u[j] = keyed_uniform(key, c0 + j);  // vectorises
    for (int64_t j = 0; j < m; ++j) {
      const double wi = w[c0 + j];
      if (!(wi > 0.0) || wi < (1.0 - u[j]) * bar || c0 + j == best) continue;
      const double score = wi / -log(u[j]);
      if (score > best_score || (score == best_score && c0 + j < best)) {
        best_score = score;
        bar = best_score * 0.999;
        best = c0 + j;
      }
    }
  }
  return best;
}

}  // namespace dspark
