// The decoder layer's element-wise steps, one call each, for the serving path: RMSNorm (with the
// residual add before it), q/k RMSNorm + rotary embedding + the K/V store into the pool, and
// SwiGLU's silu(gate) * up. Each rounds where the PyTorch path rounds (round_to<T>), so float32
// results agree with it to float32 rounding and bfloat16 results to bfloat16 rounding. Rows are
// split over OpenMP threads only when the work is large enough to pay for it. Compiled with
// paged_attention.cpp into one library; see kernel_library.py.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "scalar.h"

namespace {

using dspark::load;
using dspark::round_to;
using dspark::store;

constexpr int64_t kParallelWork = 1 << 15;  // elements below which a call runs on one thread

// out = w * rmsnorm(s) with s = x (+ delta, stored to sum_out): Hugging Face's order (normalise
// in float32, round to T, then scale by the weight).
template <typename T>
void rms_norm(const T* x, const T* delta, T* sum_out, const T* w, T* out, int64_t rows, int64_t dim, float eps,
              int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * dim >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    float* s = static_cast<float*>(malloc(sizeof(float) * dim));
    float ss = 0.f;
    for (int64_t j = 0; j < dim; ++j) {
      s[j] = delta ? round_to<T>(load(xr, j) + load(delta + r * dim, j)) : load(xr, j);
      ss += s[j] * s[j];
    }
    const float rstd = 1.f / sqrtf(ss / static_cast<float>(dim) + eps);
    for (int64_t j = 0; j < dim; ++j) {
      if (sum_out) store(sum_out + r * dim, j, s[j]);
      store(out + r * dim, j, load(w, j) * round_to<T>(s[j] * rstd));
    }
    free(s);
  }
}

// One token's packed q|k|v heads [hq + 2 hkv, d]: q and k heads RMS-normalised per head (when
// qk_w is given, weights [hq + hkv, d]) and rotated (rotate-half layout, angle pos * inv_freq);
// q goes to q_out [hq, d], k and v to the pool slot.
// T: the activations' storage type (qkv, q/k norm weights, q_out); C: the caches' (T, or
// bfloat16 under float32 activations: keys and values are rounded once, as they are stored).
template <typename T, typename C = T>
void qk_norm_rope_store(const T* qkv, int64_t tokens, int64_t hq, int64_t hkv, int64_t d, const int64_t* positions,
                        const float* inv_freq, const T* qk_w, float eps, const int64_t* slots, C* k_cache,
                        C* v_cache, T* q_out, int nthreads) {
  const int64_t half = d / 2, width = (hq + 2 * hkv) * d;
#pragma omp parallel for num_threads(nthreads) if (tokens * width >= kParallelWork)
  for (int64_t t = 0; t < tokens; ++t) {
    float* buf = static_cast<float*>(malloc(sizeof(float) * 4 * d));
    float *c = buf, *s = buf + d, *x = buf + 2 * d;  // x: the normed row, then its rotation
    const float pos = static_cast<float>(positions[t]);
    for (int64_t j = 0; j < half; ++j) {
      const float f = pos * inv_freq[j];
      c[j] = c[j + half] = round_to<T>(cosf(f));
      s[j] = s[j + half] = round_to<T>(sinf(f));
    }
    const T* row = qkv + t * width;
    for (int64_t h = 0; h < hq + hkv; ++h) {
      const T* src = row + h * d;
      if (qk_w) {
        float ss = 0.f;
        for (int64_t j = 0; j < d; ++j) ss += load(src, j) * load(src, j);
        const float rstd = 1.f / sqrtf(ss / static_cast<float>(d) + eps);
        for (int64_t j = 0; j < d; ++j) x[j] = round_to<T>(load(qk_w + h * d, j) * round_to<T>(load(src, j) * rstd));
      } else {
        for (int64_t j = 0; j < d; ++j) x[j] = load(src, j);
      }
      for (int64_t j = 0; j < d; ++j) {
        const float rot = j < half ? -x[j + half] : x[j - half];
        x[d + j] = round_to<T>(x[j] * c[j]) + round_to<T>(rot * s[j]);
      }
      if (h < hq)
        for (int64_t j = 0; j < d; ++j) store(q_out + (t * hq + h) * d, j, x[d + j]);
      else
        for (int64_t j = 0; j < d; ++j) store(k_cache + (slots[t] * hkv + (h - hq)) * d, j, x[d + j]);
    }
    for (int64_t h = 0; h < hkv; ++h) {
      const T* src = row + (hq + hkv + h) * d;
      C* dst = v_cache + (slots[t] * hkv + h) * d;
      for (int64_t j = 0; j < d; ++j) store(dst, j, load(src, j));
    }
    free(buf);
  }
}

// out [rows, inter] = silu(gate) * up of gate_up [rows, 2 * inter] (gate first).
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t inter, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * inter >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * inter;
    const T* u = g + inter;
    for (int64_t j = 0; j < inter; ++j) {
      const float a = load(g, j);
      store(out + r * inter, j, round_to<T>(a / (1.f + expf(-a))) * load(u, j));
    }
  }
}

}  // namespace

extern "C" {

// dtype 0: float32, 1: bfloat16 for every tensor argument except positions / slots (int64) and
// inv_freq (float32); qk_norm_rope_store also takes 2: float32 activations, bfloat16 caches. Each returns 0, or 3 for an unknown dtype. Optional pointers may be null.
int dspark_rms_norm(int dtype, const void* x, const void* delta, void* sum_out, const void* w, void* out,
                    int64_t rows, int64_t dim, float eps, int nthreads) {
  if (dtype == 0)
    rms_norm(static_cast<const float*>(x), static_cast<const float*>(delta), static_cast<float*>(sum_out),
             static_cast<const float*>(w), static_cast<float*>(out), rows, dim, eps, nthreads);
  else if (dtype == 1)
    rms_norm(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(delta), static_cast<uint16_t*>(sum_out),
             static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), rows, dim, eps, nthreads);
  else
    return 3;
  return 0;
}

int dspark_qk_norm_rope_store(int dtype, const void* qkv, int64_t tokens, int64_t hq, int64_t hkv, int64_t d,
                              const int64_t* positions, const float* inv_freq, const void* qk_w, float eps,
                              const int64_t* slots, void* k_cache, void* v_cache, void* q_out, int nthreads) {
  if (dtype == 0)
    qk_norm_rope_store(static_cast<const float*>(qkv), tokens, hq, hkv, d, positions, inv_freq,
                       static_cast<const float*>(qk_w), eps, slots, static_cast<float*>(k_cache),
                       static_cast<float*>(v_cache), static_cast<float*>(q_out), nthreads);
  else if (dtype == 1)
    qk_norm_rope_store(static_cast<const uint16_t*>(qkv), tokens, hq, hkv, d, positions, inv_freq,
                       static_cast<const uint16_t*>(qk_w), eps, slots, static_cast<uint16_t*>(k_cache),
                       static_cast<uint16_t*>(v_cache), static_cast<uint16_t*>(q_out), nthreads);
  else if (dtype == 2)  // float32 activations, bfloat16 caches
    qk_norm_rope_store(static_cast<const float*>(qkv), tokens, hq, hkv, d, positions, inv_freq,
                       static_cast<const float*>(qk_w), eps, slots, static_cast<uint16_t*>(k_cache),
                       static_cast<uint16_t*>(v_cache), static_cast<float*>(q_out), nthreads);
  else
    return 3;
  return 0;
}

int dspark_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter, int nthreads) {
  if (dtype == 0)
    silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter, nthreads);
  else if (dtype == 1)
    silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, inter, nthreads);
  else
    return 3;
  return 0;
}
}
