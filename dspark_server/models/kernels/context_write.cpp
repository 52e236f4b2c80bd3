// The drafter's context write in one call: for T newly committed target positions, their
// captured target features [T, C] become the injected context c = hidden_norm(fc(features)), and
// every draft layer stores K = rope(k_norm(k_proj(c))) and V = v_proj(c) at the positions' slots
// of the drafter's pool — the steps of drafter.write_context's kernel path (fc, RMSNorm, then per
// layer the k|v columns of the fused q|k|v weight and the K/V store), with the same GEMM
// (gemm.h: float32 kernel or sgemm, or weight-only bf16) as the fused forwards. After every verification
// step it writes the accepted tokens (a few rows), after a prefill chunk the whole chunk. With
// kv_bf16 the pool is bfloat16 (--kv-cache-dtype): keys and values are rounded as they are stored.
#include <stdint.h>
#include <stdlib.h>

#include "gemm.h"
#include "kernels.h"

namespace {
// Per layer, in this order: the k|v weight (float32 [K, ld] slice, or its packed bf16 blocks, or
// its int8 buffer), the row stride ld of the full q|k|v weight (float32), the k|v columns' packed
// float32 copy (or 0: none; under int8 their packed bf16 copy), the k norm weights [hkv, d] (or 0:
// no k norm). `weight_format`: gemm.h's WeightFormat.
constexpr int kLayerEntries = 4;
}  // namespace

extern "C" {

// Returns 0, or 1 for a bad argument, or the first failing kernel's code + 10.
int dspark_context_write_f32(void* sgemm_fn, int weight_format, int64_t tokens, const float* features,
                             int64_t cdim, const void* fc_w, const float* fc_packed, const float* norm_w, int64_t hidden,
                             float eps, int64_t layers, int64_t hkv, int64_t d, float qk_eps, const float* inv_freq,
                             const int64_t* layer_table, const int64_t* positions, const int64_t* slots,
                             const int64_t* caches, int nthreads, int kv_bf16) {
  if (!sgemm_fn || tokens <= 0 || cdim <= 0 || hidden <= 0 || layers <= 0 || hkv <= 0 || d <= 0) return 1;
  const int64_t kv_w = 2 * hkv * d;
  float* buf = static_cast<float*>(malloc(sizeof(float) * tokens * (2 * hidden + kv_w)));
  if (!buf) return 1;
  const dspark::Gemms g{reinterpret_cast<dspark::Sgemm>(sgemm_fn), weight_format, nthreads};
  float *x = buf, *ctx = x + tokens * hidden, *kv = ctx + tokens * hidden;
  int rc = dspark::linear(g, features, tokens, cdim, fc_w, fc_packed, hidden, x, false);
  if (rc == 0) rc = dspark_rms_norm(0, x, nullptr, nullptr, norm_w, ctx, tokens, hidden, eps, nthreads);
  for (int64_t l = 0; l < layers && rc == 0; ++l) {
    const int64_t* e = layer_table + l * kLayerEntries;
    const void* w = reinterpret_cast<const void*>(e[0]);
    if (!w) {
      rc = 1;
      break;
    }
    if ((rc = dspark::linear(g, ctx, tokens, hidden, w, reinterpret_cast<const float*>(e[2]), kv_w, kv, false, e[1]))) break;
    rc = dspark_qk_norm_rope_store(kv_bf16 ? 2 : 0, kv, tokens, 0, hkv, d, positions, inv_freq,
                                   reinterpret_cast<const void*>(e[3]), qk_eps, slots,
                                   reinterpret_cast<void*>(caches[2 * l]), reinterpret_cast<void*>(caches[2 * l + 1]),
                                   nullptr, nthreads);
  }
  free(buf);
  return rc == 0 ? 0 : (rc == 1 ? 1 : rc + 10);
}
}
