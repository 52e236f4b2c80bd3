// The whole float32 decoder forward over a packed ragged batch in one call: embedding, every
// layer (RMSNorm, q/k/v GEMM, q/k norm + rotary + K/V store, paged attention, output GEMM with the
// residual, RMSNorm, gate/up GEMM, silu * up, down GEMM with the residual), the captured layers'
// outputs, the final norm and the LM head over the rows that need logits.
//
// At one decoding request the target's arithmetic is a few hundred microseconds of weight reads,
// and a forward of ~60 framework calls from Python costs as much again in dispatch. This file is
// the same sequence of steps as the PyTorch serving path (target.py's forward_kernels), calling
// the same element-wise and attention kernels (layer_ops.cpp, paged_attention.cpp) and the same
// BLAS sgemm PyTorch's linear layers call, whose address the caller passes (PyTorch's own MKL),
// so no BLAS is linked here. Weights are in the serving layout (layers.py: a float32 [N, K]
// weight stored column-major, i.e. its [K, N] transpose contiguous), each with its copy in
// linear_f32.cpp's packed panels (or none) for the kernel that serves the few rows of decoding
// and verification (gemm.h).
//
// Weight-only bf16 (weight_format 1): every GEMM weight is bfloat16 in linear_bf16.cpp's packed
// layout, for decode, verification blocks and prefill chunks alike (gemm.h). Activations, norms
// and the logits stay float32; x is rounded to bf16 at each GEMM's input. A bfloat16 KV cache
// (kv_bf16 = 1) halves the bytes attention reads: at 64 decoding requests over ~500 cached
// tokens, reading the float32 pool was most of a forward.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"
#include "kernels.h"

namespace {

using dspark::Gemms;
using dspark::linear;
using dspark::Sgemm;

// Per layer, in this order: input norm, qkv weight (transposed) and its packed copy, q/k norm
// weights [hq + hkv, d] (or 0: no q/k norm), output weight and its packed copy, post-attention
// norm, gate|up weight and its packed copy, down weight and its packed copy (a packed copy 0:
// none, the sgemm serves).
constexpr int kLayerWeights = 11;

}  // namespace

extern "C" {

// Returns 0, or 1 for a bad argument, or the first failing kernel's code + 10.
int dspark_decoder_forward_f32(
    void* sgemm_fn,
    // the batch: T new tokens, their positions and destination slots, and the paged layout
    int64_t tokens, const int64_t* ids, const int64_t* positions, const int64_t* slot_mapping, const int64_t* kv_slots,
    int64_t kmax, const int64_t* q_start, const int64_t* q_len, const int64_t* kv_limit, int64_t nseq,
    // the model
    const float* embed, int64_t hidden, int64_t layers, int64_t hq, int64_t hkv, int64_t d, int64_t inter,
    float eps, float qk_eps, const float* inv_freq, const int64_t* weights, const int64_t* caches,
    const float* final_norm, const float* lm_wt, const float* lm_packed, int64_t vocab,
    // outputs: logits of `rows`, and the outputs of the layers with capture[i] >= 0 at column block capture[i]
    const int64_t* rows, int64_t nrows, float* logits, const int64_t* capture, int64_t ncap, float* hidden_out,
    // block mode (the drafter's block): new keys / values are not stored in the pool but attended
    // to, unmasked, by the queries of their own sequence (slot_mapping unused); normed_out: the
    // final norm's output of `rows` [nrows, hidden], or null
    int block_mode, float* normed_out, int nthreads,
    // gemm.h's WeightFormat: weight-only bf16 (1): `weights` and `lm_wt` point to packed bf16
    // layouts (no float32 copies); weight-only int8 (2): to int8 buffers, their packed copies to bf16
    int weight_format,
    // a bfloat16 KV pool (`caches`): keys and values are rounded to bf16 as they are stored and
    // read back as float32 (block mode's own keys and values stay float32 either way)
    int kv_bf16) {
  Sgemm sgemm = reinterpret_cast<Sgemm>(sgemm_fn);
  if (!sgemm || tokens <= 0 || hidden <= 0 || layers <= 0) return 1;
  const int64_t qkv_w = (hq + 2 * hkv) * d, big = qkv_w > 2 * inter ? qkv_w : 2 * inter;
  float* buf = static_cast<float*>(malloc(sizeof(float) * tokens * (3 * hidden + 2 * hq * d + big + inter)));
  if (!buf) return 1;
  const Gemms g{sgemm, weight_format, nthreads};
  float *x = buf, *h = x + tokens * hidden, *tmp = h + tokens * hidden, *q = tmp + tokens * hidden;
  float *att = q + tokens * hq * d, *wide = att + tokens * hq * d, *mid = wide + tokens * big;
  int rc = 0;
  float *kx = nullptr, *vx = nullptr;
  int64_t* self_slots = nullptr;
  if (block_mode) {  // the block's own keys and values, row t at "slot" t of a scratch cache
    kx = static_cast<float*>(malloc(sizeof(float) * tokens * hkv * d * 2));
    self_slots = static_cast<int64_t*>(malloc(sizeof(int64_t) * tokens));
    if (!kx || !self_slots) {
      free(kx);
      free(self_slots);
      free(buf);
      return 1;
    }
    vx = kx + tokens * hkv * d;
    for (int64_t t = 0; t < tokens; ++t) self_slots[t] = t;
  }
  for (int64_t t = 0; t < tokens; ++t) memcpy(x + t * hidden, embed + ids[t] * hidden, sizeof(float) * hidden);
  const float scale = 1.f / sqrtf(static_cast<float>(d));
  for (int64_t l = 0; l < layers && rc == 0; ++l) {
    const float* const* w = reinterpret_cast<const float* const*>(weights + l * kLayerWeights);
    void* kc = reinterpret_cast<void*>(caches[2 * l]);
    void* vc = reinterpret_cast<void*>(caches[2 * l + 1]);
    rc = dspark_rms_norm(0, x, nullptr, nullptr, w[0], h, tokens, hidden, eps, nthreads);
    if (rc) break;
    if ((rc = linear(g, h, tokens, hidden, w[1], w[2], qkv_w, wide, false))) break;
    rc = dspark_qk_norm_rope_store(block_mode || !kv_bf16 ? 0 : 2, wide, tokens, hq, hkv, d, positions, inv_freq, w[3], qk_eps,
                                   block_mode ? self_slots : slot_mapping, block_mode ? kx : kc,
                                   block_mode ? vx : vc, q, nthreads);
    if (rc) break;
    rc = dspark_paged_attention(kv_bf16 ? 2 : 0, q, kc, vc, kv_slots, kmax, q_start, q_len, kv_limit, kx, vx, nseq, hq, hkv, d, scale,
                                att, nullptr, nthreads);
    if (rc) break;
    if ((rc = linear(g, att, tokens, hq * d, w[4], w[5], hidden, tmp, false))) break;
    // x + attention, then its norm (the residual rounded before the norm, as the PyTorch path)
    rc = dspark_rms_norm(0, x, tmp, x, w[6], h, tokens, hidden, eps, nthreads);
    if (rc) break;
    if ((rc = linear(g, h, tokens, hidden, w[7], w[8], 2 * inter, wide, false))) break;
    rc = dspark_silu_mul(0, wide, mid, tokens, inter, nthreads);
    if (rc) break;
    if ((rc = linear(g, mid, tokens, inter, w[9], w[10], hidden, tmp, false))) break;
    for (int64_t i = 0; i < tokens * hidden; ++i) x[i] += tmp[i];
    if (capture && capture[l] >= 0 && capture[l] < ncap)
      for (int64_t t = 0; t < tokens; ++t)
        memcpy(hidden_out + (t * ncap + capture[l]) * hidden, x + t * hidden, sizeof(float) * hidden);
  }
  if (rc == 0 && nrows > 0) {
    for (int64_t r = 0; r < nrows; ++r) memcpy(tmp + r * hidden, x + rows[r] * hidden, sizeof(float) * hidden);
    rc = dspark_rms_norm(0, tmp, nullptr, nullptr, final_norm, h, nrows, hidden, eps, nthreads);
    if (rc == 0 && normed_out) memcpy(normed_out, h, sizeof(float) * nrows * hidden);
    if (rc == 0) rc = linear(g, h, nrows, hidden, lm_wt, lm_packed, vocab, logits, false);
  }
  free(kx);
  free(self_slots);
  free(buf);
  return rc ? rc + 10 : 0;
}
}
