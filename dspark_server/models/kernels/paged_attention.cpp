// Attention that reads keys and values in place from a slot-addressed KV pool.
//
// The pool of one layer is [num_slots, Hkv, D] (slot = page * page_size + offset). Sequence r's
// query rows are q[q_start[r] .. q_start[r] + q_len[r]) of the packed [T, Hq, D] queries; its key
// position j lives in slot slots[r * kmax + j]; query row t sees key positions 0 .. kv_limit[t] - 1
// (position + 1 for causal decoding, verification blocks and prefill chunks; the context length
// for the drafter's block). One work item is (sequence, kv head, tile of query rows): every query
// head of the GQA group and every row of the tile are scored against a block of keys at a time,
// with an online softmax, so no per-sequence copy of the history is ever made. Accumulation is in
// float32 for both float32 and bfloat16 pools. Built once (g++ -O3 -march=native -fopenmp) and
// called through ctypes; see paged_kernel.py.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr int64_t kTile = 16;   // query rows per work item
constexpr int64_t kBlock = 32;  // keys per online-softmax update
constexpr float kNegBig = -1e30f;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {  // round to nearest even, as torch does
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) {
    p[i] = static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  p[i] = static_cast<uint16_t>(bits >> 16);
}

// Rows [k_lo, k_hi) of one kv head, as float32 (a pointer into the pool for float32).
template <typename T, int64_t D>
struct KeyBlock {
  float k[kBlock * D];
  float v[kBlock * D];
  const float* kp[kBlock];
  const float* vp[kBlock];
  void fill(const T* kc, const T* vc, const int64_t* slots, int64_t n, int64_t hkv, int64_t h) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t off = (slots[j] * hkv + h) * D;
      if constexpr (sizeof(T) == sizeof(float)) {
        kp[j] = reinterpret_cast<const float*>(kc) + off;
        vp[j] = reinterpret_cast<const float*>(vc) + off;
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) k[j * D + d] = load(kc + off, d);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) v[j * D + d] = load(vc + off, d);
        kp[j] = k + j * D;
        vp[j] = v + j * D;
      }
    }
  }
};

template <typename T, int64_t D>
void work_item(const T* q, const T* kc, const T* vc, const int64_t* slots, const int64_t* kv_limit,
               int64_t row0, int64_t nrows, int64_t hq, int64_t hkv, int64_t h, float scale, T* out,
               float* lse) {
  const int64_t rep = hq / hkv;
  const int64_t nv = nrows * rep;  // query vectors: (row, head of the group)
  float* qs = static_cast<float*>(malloc(sizeof(float) * nv * D));
  float* acc = static_cast<float*>(calloc(nv * D, sizeof(float)));
  float* m = static_cast<float*>(malloc(sizeof(float) * nv));
  float* l = static_cast<float*>(calloc(nv, sizeof(float)));
  int64_t* lim = static_cast<int64_t*>(malloc(sizeof(int64_t) * nv));
  int64_t kend = 0;
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t t = row0 + i;
    if (kv_limit[t] > kend) kend = kv_limit[t];
    for (int64_t g = 0; g < rep; ++g) {
      const int64_t qv = i * rep + g;
      const T* src = q + (t * hq + h * rep + g) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) qs[qv * D + d] = load(src, d) * scale;
      m[qv] = kNegBig;
      lim[qv] = kv_limit[t];
    }
  }
  KeyBlock<T, D> blk;
  float s[kBlock];
  for (int64_t kb = 0; kb < kend; kb += kBlock) {
    const int64_t n = kend - kb < kBlock ? kend - kb : kBlock;
    blk.fill(kc, vc, slots + kb, n, hkv, h);
    for (int64_t qv = 0; qv < nv; ++qv) {
      int64_t nvis = lim[qv] - kb;
      if (nvis <= 0) continue;
      if (nvis > n) nvis = n;
      const float* qq = qs + qv * D;
      float bmax = kNegBig;
      for (int64_t j = 0; j < nvis; ++j) {
        const float* kk = blk.kp[j];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qq[d] * kk[d];
        s[j] = dot;
        bmax = dot > bmax ? dot : bmax;
      }
      float* a = acc + qv * D;
      if (bmax > m[qv]) {
        const float alpha = expf(m[qv] - bmax);
        l[qv] *= alpha;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        m[qv] = bmax;
      }
      const float mx = m[qv];
      float lsum = 0.f;
#pragma omp simd reduction(+ : lsum)
      for (int64_t j = 0; j < nvis; ++j) {
        s[j] = expf(s[j] - mx);
        lsum += s[j];
      }
      l[qv] += lsum;
      for (int64_t j = 0; j < nvis; ++j) {
        const float p = s[j];
        const float* vv = blk.vp[j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * vv[d];
      }
    }
  }
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t t = row0 + i;
    for (int64_t g = 0; g < rep; ++g) {
      const int64_t qv = i * rep + g, head = h * rep + g;
      const float inv = l[qv] > 0.f ? 1.f / l[qv] : 0.f;
      T* dst = out + (t * hq + head) * D;
      for (int64_t d = 0; d < D; ++d) store(dst, d, acc[qv * D + d] * inv);
      if (lse) lse[t * hq + head] = l[qv] > 0.f ? m[qv] + logf(l[qv]) : kNegBig;
    }
  }
  free(qs);
  free(acc);
  free(m);
  free(l);
  free(lim);
}

template <typename T, int64_t D>
void run(const T* q, const T* kc, const T* vc, const int64_t* slots, int64_t kmax, const int64_t* q_start,
         const int64_t* q_len, const int64_t* kv_limit, int64_t nseq, int64_t hq, int64_t hkv, float scale,
         T* out, float* lse, int nthreads) {
  // Work items in order (sequence, tile, kv head); first_item[r] is sequence r's first item.
  int64_t* first_item = static_cast<int64_t*>(malloc(sizeof(int64_t) * (nseq + 1)));
  first_item[0] = 0;
  for (int64_t r = 0; r < nseq; ++r) first_item[r + 1] = first_item[r] + (q_len[r] + kTile - 1) / kTile * hkv;
  const int64_t items = first_item[nseq];
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t it = 0; it < items; ++it) {
    int64_t lo = 0, hi = nseq;  // the sequence r with first_item[r] <= it < first_item[r + 1]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (first_item[mid] <= it) lo = mid; else hi = mid;
    }
    const int64_t r = lo, local = it - first_item[r];
    const int64_t tile = local / hkv, h = local % hkv;
    const int64_t row0 = q_start[r] + tile * kTile;
    const int64_t rows_left = q_len[r] - tile * kTile;
    work_item<T, D>(q, kc, vc, slots + r * kmax, kv_limit, row0, rows_left < kTile ? rows_left : kTile, hq,
                    hkv, h, scale, out, lse);
  }
  free(first_item);
}

template <typename T>
int dispatch(int64_t d, const T* q, const T* kc, const T* vc, const int64_t* slots, int64_t kmax,
             const int64_t* q_start, const int64_t* q_len, const int64_t* kv_limit, int64_t nseq, int64_t hq,
             int64_t hkv, float scale, T* out, float* lse, int nthreads) {
#define DSPARK_CASE(N)                                                                                   \
  case N:                                                                                                \
    run<T, N>(q, kc, vc, slots, kmax, q_start, q_len, kv_limit, nseq, hq, hkv, scale, out, lse, nthreads); \
    return 0;
  switch (d) {
    DSPARK_CASE(16)
    DSPARK_CASE(32)
    DSPARK_CASE(64)
    DSPARK_CASE(80)
    DSPARK_CASE(96)
    DSPARK_CASE(128)
    DSPARK_CASE(256)
    default:
      return 1;
  }
#undef DSPARK_CASE
}

}  // namespace

extern "C" {

// dtype 0: float32, 1: bfloat16 (q, caches and out share it). Returns 0, or 1 for an unsupported
// head_dim (the caller then uses the PyTorch path). lse may be null.
int dspark_paged_attention(int dtype, const void* q, const void* kc, const void* vc, const int64_t* slots,
                           int64_t kmax, const int64_t* q_start, const int64_t* q_len, const int64_t* kv_limit,
                           int64_t nseq, int64_t hq, int64_t hkv, int64_t d, float scale, void* out, float* lse,
                           int nthreads) {
  if (hkv <= 0 || hq % hkv != 0) return 2;
  if (dtype == 0)
    return dispatch<float>(d, static_cast<const float*>(q), static_cast<const float*>(kc),
                           static_cast<const float*>(vc), slots, kmax, q_start, q_len, kv_limit, nseq, hq, hkv,
                           scale, static_cast<float*>(out), lse, nthreads);
  if (dtype == 1)
    return dispatch<uint16_t>(d, static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(kc),
                              static_cast<const uint16_t*>(vc), slots, kmax, q_start, q_len, kv_limit, nseq, hq,
                              hkv, scale, static_cast<uint16_t*>(out), lse, nthreads);
  return 3;
}

int dspark_abi_version() { return 1; }
}
