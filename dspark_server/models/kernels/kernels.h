// The library's element-wise and attention entry points (layer_ops.cpp, paged_attention.cpp), as
// the fused calls (decoder_forward.cpp, context_write.cpp) call them. dtype 0: float32, 1: bfloat16.
#pragma once
#include <stdint.h>

extern "C" {
int dspark_rms_norm(int dtype, const void* x, const void* delta, void* sum_out, const void* w, void* out,
                    int64_t rows, int64_t dim, float eps, int nthreads);
int dspark_qk_norm_rope_store(int dtype, const void* qkv, int64_t tokens, int64_t hq, int64_t hkv, int64_t d,
                              const int64_t* positions, const float* inv_freq, const void* qk_w, float eps,
                              const int64_t* slots, void* k_cache, void* v_cache, void* q_out, int nthreads);
int dspark_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter, int nthreads);
int dspark_paged_attention(int dtype, const void* q, const void* kc, const void* vc, const int64_t* slots,
                           int64_t kmax, const int64_t* q_start, const int64_t* q_len, const int64_t* kv_limit,
                           const void* kx, const void* vx, int64_t nseq, int64_t hq, int64_t hkv, int64_t d,
                           float scale, void* out, void* lse, int nthreads);
}
