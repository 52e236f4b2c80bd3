// Attention that reads keys and values in place from a slot-addressed KV pool.
//
// The pool of one layer is [num_slots, Hkv, D] (slot = page * page_size + offset). Sequence r's
// query rows are q[q_start[r] .. q_start[r] + q_len[r]) of the packed [T, Hq, D] queries; its key
// position j lives in slot slots[r * kmax + j]; query row t sees key positions 0 .. kv_limit[t] - 1
// (position + 1 for causal decoding, verification blocks and prefill chunks; the context length
// for the drafter's block). One work item is (sequence, kv head, tile of query rows): every query
// head of the GQA group and every row of the tile are scored against a block of keys at a time,
// with an online softmax, so no per-sequence copy of the history is ever made. Accumulation is in
// float32 for both float32 and bfloat16 pools. With kx / vx (the drafter's block), each query of
// sequence r also sees, unmasked, the new keys kx/vx rows q_start[r] .. q_start[r] + q_len[r]: its
// own block, bidirectionally. Built once (g++ -O3 -march=native -fopenmp) and called through
// ctypes; see paged_kernel.py.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scalar.h"
#ifdef __AVX512F__
#include <immintrin.h>
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc libmvec's 16-lane expf
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
extern "C" __m256 _ZGVdN8v_expf(__m256);  // glibc libmvec's 8-lane expf (AVX2)
#define DSPARK_ATTENTION_AVX2 1
#endif

namespace {

constexpr int64_t kTile = 16;   // query rows per work item
constexpr int64_t kBlock = 16;  // keys per online-softmax update (one AVX-512 vector of scores)
constexpr float kNegBig = -1e30f;

// TQ: the queries' (and output's, extra keys') storage type; TC: the pool's (TQ, or bfloat16
// under float32 queries: a bfloat16 KV cache read by float32 activations).
template <typename TQ, typename TC>
struct Args {
  const TQ* q;            // [T, hq, D]
  const TC* kc;           // [S, hkv, D] the layer's pool
  const TC* vc;
  const int64_t* slots;   // [nseq, kmax]
  int64_t kmax;
  const int64_t* q_start;  // [nseq]
  const int64_t* q_len;    // [nseq]
  const int64_t* kv_limit;  // [T]
  const TQ* kx;           // [T, hkv, D] or null: extra keys / values, see above
  const TQ* vx;
  int64_t nseq, hq, hkv;
  float scale;
  TQ* out;                // [T, hq, D]
  float* lse;             // [T, hq] or null
};

using dspark::load;
using dspark::store;

// One work item's state: the scaled queries, running max / sum and output accumulators of its
// nv = rows x (query heads per kv head) query vectors, row-major (row, head of the group).
struct Item {
  int64_t nv;
  float* q;    // [nv, D], already multiplied by the softmax scale
  float* acc;  // [nv, D]
  float* m;    // [nv]
  float* l;    // [nv]
  int64_t* lim;  // [nv] visible keys
  float* p;    // [nv, kBlock] probabilities of the current key block
};

// Key / value rows of one kv head for key positions kb .. kb + n, as float32 row pointers (into
// the pool for float32, into converted buffers for bfloat16); rows n .. kBlock point at zeros.
template <int64_t D>
struct KeyBlock {
  alignas(64) float k[kBlock * D];
  alignas(64) float v[kBlock * D];
  alignas(64) float zeros[D] = {};
  const float* kp[kBlock];
  const float* vp[kBlock];
  // Rows slots[j] (or first + j when slots is null) of kc / vc, for j < n.
  template <typename T>
  void fill(const T* kc, const T* vc, const int64_t* slots, int64_t first, int64_t n, int64_t hkv, int64_t h) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t off = ((slots ? slots[j] : first + j) * hkv + h) * D;
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
    for (int64_t j = n; j < kBlock; ++j) kp[j] = vp[j] = zeros;
  }
};

// Online-softmax update of query vector qv with this block's raw scores s[0 .. kBlock) of which
// the first nvis are visible: rescales its accumulator, leaves probabilities in it.p[qv].
template <int64_t D>
inline void softmax_update(Item& it, int64_t qv, float* s, int64_t nvis) {
  float* p = it.p + qv * kBlock;
  float bmax = kNegBig;
  for (int64_t j = 0; j < nvis; ++j) bmax = s[j] > bmax ? s[j] : bmax;
  for (int64_t j = nvis; j < kBlock; ++j) s[j] = kNegBig;
  if (bmax > it.m[qv]) {
    const float alpha = expf(it.m[qv] - bmax);
    it.l[qv] *= alpha;
    float* a = it.acc + qv * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
    it.m[qv] = bmax;
  }
  const float mx = it.m[qv];
  float lsum = 0.f;
#pragma omp simd reduction(+ : lsum)
  for (int64_t j = 0; j < kBlock; ++j) {
    p[j] = expf(s[j] - mx);
    lsum += p[j];
  }
  it.l[qv] += lsum;
}

#ifdef __AVX512F__
// s[j] = sum over lanes of t[j], for 16 vectors (a transpose-and-add tree, 45 instructions).
inline __m512 hsum16(const __m512* t) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xdd));
}

template <int64_t D>
inline void scores(const float* q, const float* const* kp, float* s) {
  constexpr int64_t C = D / 16;
  __m512 qc[C], t[kBlock];
  for (int64_t c = 0; c < C; ++c) qc[c] = _mm512_loadu_ps(q + 16 * c);
  for (int64_t j = 0; j < kBlock; ++j) {
    __m512 a = _mm512_mul_ps(qc[0], _mm512_loadu_ps(kp[j]));
    for (int64_t c = 1; c < C; ++c) a = _mm512_fmadd_ps(qc[c], _mm512_loadu_ps(kp[j] + 16 * c), a);
    t[j] = a;
  }
  _mm512_storeu_ps(s, hsum16(t));
}

// softmax_update for the AVX-512 path: the block's scores in one vector, libmvec's vector expf.
template <int64_t D>
inline void softmax_update_avx512(Item& it, int64_t qv, const float* s, int64_t nvis) {
  const __mmask16 vis = static_cast<__mmask16>((1u << nvis) - 1u);
  const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegBig), vis, s);
  const float bmax = _mm512_reduce_max_ps(sv);
  if (bmax > it.m[qv]) {
    const __m512 alpha = _mm512_set1_ps(expf(it.m[qv] - bmax));
    it.l[qv] *= _mm512_cvtss_f32(alpha);
    float* a = it.acc + qv * D;
    for (int64_t c = 0; c < D / 16; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_mul_ps(alpha, _mm512_loadu_ps(a + 16 * c)));
    it.m[qv] = bmax;
  }
  const __m512 p = _ZGVeN16v_expf(_mm512_sub_ps(sv, _mm512_set1_ps(it.m[qv])));
  _mm512_storeu_ps(it.p + qv * kBlock, p);
  it.l[qv] += _mm512_reduce_add_ps(p);
}

// acc[qv0 + u] += sum_j p[qv0 + u][j] * v[j] for U query vectors, accumulators in registers.
template <int64_t D, int U>
inline void pv(Item& it, int64_t qv0, const float* const* vp, int64_t n) {
  constexpr int64_t C = D / 16;
  __m512 a[U][C];
  for (int u = 0; u < U; ++u)
    for (int64_t c = 0; c < C; ++c) a[u][c] = _mm512_loadu_ps(it.acc + (qv0 + u) * D + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vc[C];
    for (int64_t c = 0; c < C; ++c) vc[c] = _mm512_loadu_ps(vp[j] + 16 * c);
    for (int u = 0; u < U; ++u) {
      const __m512 pu = _mm512_set1_ps(it.p[(qv0 + u) * kBlock + j]);
      for (int64_t c = 0; c < C; ++c) a[u][c] = _mm512_fmadd_ps(pu, vc[c], a[u][c]);
    }
  }
  for (int u = 0; u < U; ++u)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(it.acc + (qv0 + u) * D + 16 * c, a[u][c]);
}
#endif

#ifdef DSPARK_ATTENTION_AVX2
// The AVX2 path (CPUs without AVX-512): on the 2-core AMD EPYC of session 26 the portable loops
// (a horizontal sum per key, a scalar expf per score) were a fifth of a drafting step's time.

// [sum of t0, t1, t2, t3]
inline __m128 hsum4(__m256 t0, __m256 t1, __m256 t2, __m256 t3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// s[j] = q . k_j for the block's keys, four at a time.
template <int64_t D>
inline void scores_avx2(const float* q, const float* const* kp, float* s) {
  for (int64_t j = 0; j < kBlock; j += 4) {
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 qc = _mm256_loadu_ps(q + c);
      t0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kp[j] + c), t0);
      t1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kp[j + 1] + c), t1);
      t2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kp[j + 2] + c), t2);
      t3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kp[j + 3] + c), t3);
    }
    _mm_storeu_ps(s + j, hsum4(t0, t1, t2, t3));
  }
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

// softmax_update for the AVX2 path: the block's 16 scores in two vectors, libmvec's vector expf.
template <int64_t D>
inline void softmax_update_avx2(Item& it, int64_t qv, const float* s, int64_t nvis) {
  static_assert(kBlock == 16, "two vectors of scores");
  const __m256i lim = _mm256_set1_epi32(static_cast<int>(nvis));
  const __m256i lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), hi = _mm256_add_epi32(lo, _mm256_set1_epi32(8));
  const __m256 neg = _mm256_set1_ps(kNegBig);
  const __m256 s0 = _mm256_blendv_ps(neg, _mm256_loadu_ps(s), _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, lo)));
  const __m256 s1 = _mm256_blendv_ps(neg, _mm256_loadu_ps(s + 8), _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim, hi)));
  const float bmax = hmax(_mm256_max_ps(s0, s1));
  if (bmax > it.m[qv]) {
    const float alpha = expf(it.m[qv] - bmax);
    it.l[qv] *= alpha;
    float* a = it.acc + qv * D;
    const __m256 av = _mm256_set1_ps(alpha);
    for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(a + c, _mm256_mul_ps(av, _mm256_loadu_ps(a + c)));
    it.m[qv] = bmax;
  }
  const __m256 mv = _mm256_set1_ps(it.m[qv]);
  const __m256 p0 = _ZGVdN8v_expf(_mm256_sub_ps(s0, mv)), p1 = _ZGVdN8v_expf(_mm256_sub_ps(s1, mv));
  _mm256_storeu_ps(it.p + qv * kBlock, p0);
  _mm256_storeu_ps(it.p + qv * kBlock + 8, p1);
  it.l[qv] += hsum(_mm256_add_ps(p0, p1));
}

// Accumulator vectors per pass of pv_avx2 (up to 64 floats in 8 registers); 0: D does not split.
template <int64_t D>
constexpr int64_t kPvVectors = D % 8 ? 0 : (D <= 64 ? D / 8 : (D % 64 ? 0 : 8));

// acc[qv] += sum_j p[qv][j] * v[j], a pass of kPvVectors accumulators in registers at a time.
template <int64_t D>
inline void pv_avx2(Item& it, int64_t qv, const float* const* vp, int64_t n) {
  constexpr int64_t C = kPvVectors<D>;
  float* acc = it.acc + qv * D;
  const float* p = it.p + qv * kBlock;
  for (int64_t c0 = 0; c0 < D; c0 += 8 * C) {
    __m256 a[C];
    for (int64_t c = 0; c < C; ++c) a[c] = _mm256_loadu_ps(acc + c0 + 8 * c);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      for (int64_t c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vp[j] + c0 + 8 * c), a[c]);
    }
    for (int64_t c = 0; c < C; ++c) _mm256_storeu_ps(acc + c0 + 8 * c, a[c]);
  }
}
#endif

// One block of n keys: query vector qv sees its first min(lim[qv] - kb, n) (all n when kb < 0).
// (Inlined into key_loop: as a call it runs about 30% slower for verification blocks.)
template <int64_t D>
__attribute__((always_inline)) inline void process_block(Item& it, const KeyBlock<D>& blk, int64_t n,
                                                         int64_t kb) {
  alignas(64) float s[kBlock];
  for (int64_t qv = 0; qv < it.nv; ++qv) {
    int64_t nvis = kb < 0 ? n : it.lim[qv] - kb;
    nvis = nvis < 0 ? 0 : (nvis > n ? n : nvis);
    if (nvis == 0) {  // nothing visible in this block (a causal row of a prefill tile)
      for (int64_t j = 0; j < kBlock; ++j) it.p[qv * kBlock + j] = 0.f;
      continue;
    }
#ifdef __AVX512F__
    if constexpr (D % 16 == 0) {
      scores<D>(it.q + qv * D, blk.kp, s);
      softmax_update_avx512<D>(it, qv, s, nvis);
      continue;
    }
#elif defined(DSPARK_ATTENTION_AVX2)
    if constexpr (D % 8 == 0) {
      scores_avx2<D>(it.q + qv * D, blk.kp, s);
      softmax_update_avx2<D>(it, qv, s, nvis);
      continue;
    }
#endif
    const float* qq = it.q + qv * D;
    for (int64_t j = 0; j < kBlock; ++j) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qq[d] * blk.kp[j][d];
      s[j] = dot;
    }
    softmax_update<D>(it, qv, s, nvis);
  }
#ifdef __AVX512F__
  if constexpr (D % 16 == 0) {
    constexpr int U = D <= 64 ? 4 : 2;
    int64_t qv = 0;
    for (; qv + U <= it.nv; qv += U) pv<D, U>(it, qv, blk.vp, n);
    for (; qv < it.nv; ++qv) pv<D, 1>(it, qv, blk.vp, n);
    return;
  }
#elif defined(DSPARK_ATTENTION_AVX2)
  if constexpr (kPvVectors<D> > 0) {
    for (int64_t qv = 0; qv < it.nv; ++qv) pv_avx2<D>(it, qv, blk.vp, n);
    return;
  }
#endif
  for (int64_t qv = 0; qv < it.nv; ++qv) {
    float* a = it.acc + qv * D;
    for (int64_t j = 0; j < n; ++j) {
      const float pj = it.p[qv * kBlock + j];
      const float* vv = blk.vp[j];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += pj * vv[d];
    }
  }
}

// The pool keys 0 .. kend of sequence r (slots), then its extra keys if any, for kv head h.
template <typename TQ, typename TC, int64_t D>
void key_loop(Item& it, const Args<TQ, TC>& a, int64_t r, int64_t kend, int64_t h) {
  KeyBlock<D> blk;
  const int64_t* slots = a.slots + r * a.kmax;
  for (int64_t kb = 0; kb < kend; kb += kBlock) {
    const int64_t n = kend - kb < kBlock ? kend - kb : kBlock;
    blk.fill(a.kc, a.vc, slots + kb, 0, n, a.hkv, h);
    process_block<D>(it, blk, n, kb);
  }
  if (a.kx == nullptr) return;
  for (int64_t e = 0; e < a.q_len[r]; e += kBlock) {
    const int64_t n = a.q_len[r] - e < kBlock ? a.q_len[r] - e : kBlock;
    blk.fill(a.kx, a.vx, nullptr, a.q_start[r] + e, n, a.hkv, h);
    process_block<D>(it, blk, n, -1);
  }
}

template <typename TQ, typename TC, int64_t D>
void work_item(const Args<TQ, TC>& a, int64_t r, int64_t row0, int64_t nrows, int64_t h) {
  const int64_t rep = a.hq / a.hkv;
  Item it;
  it.nv = nrows * rep;
  float* buf = static_cast<float*>(calloc(it.nv * (2 * D + 2 + kBlock), sizeof(float)));
  it.q = buf;
  it.acc = it.q + it.nv * D;
  it.m = it.acc + it.nv * D;
  it.l = it.m + it.nv;
  it.p = it.l + it.nv;
  it.lim = static_cast<int64_t*>(malloc(sizeof(int64_t) * it.nv));
  int64_t kend = 0;
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t t = row0 + i;
    if (a.kv_limit[t] > kend) kend = a.kv_limit[t];
    for (int64_t g = 0; g < rep; ++g) {
      const int64_t qv = i * rep + g;
      const TQ* src = a.q + (t * a.hq + h * rep + g) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) it.q[qv * D + d] = load(src, d) * a.scale;
      it.m[qv] = kNegBig;
      it.lim[qv] = a.kv_limit[t];
    }
  }
  key_loop<TQ, TC, D>(it, a, r, kend, h);
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t t = row0 + i;
    for (int64_t g = 0; g < rep; ++g) {
      const int64_t qv = i * rep + g, head = h * rep + g;
      const float inv = it.l[qv] > 0.f ? 1.f / it.l[qv] : 0.f;
      TQ* dst = a.out + (t * a.hq + head) * D;
      for (int64_t d = 0; d < D; ++d) store(dst, d, it.acc[qv * D + d] * inv);
      if (a.lse) a.lse[t * a.hq + head] = it.l[qv] > 0.f ? it.m[qv] + logf(it.l[qv]) : kNegBig;
    }
  }
  free(buf);
  free(it.lim);
}

template <typename TQ, typename TC, int64_t D>
void run(const Args<TQ, TC>& a, int nthreads) {
  // Work items in order (sequence, tile, kv head); first_item[r] is sequence r's first item.
  int64_t* first_item = static_cast<int64_t*>(malloc(sizeof(int64_t) * (a.nseq + 1)));
  first_item[0] = 0;
  for (int64_t r = 0; r < a.nseq; ++r) first_item[r + 1] = first_item[r] + (a.q_len[r] + kTile - 1) / kTile * a.hkv;
  const int64_t items = first_item[a.nseq];
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t it = 0; it < items; ++it) {
    int64_t lo = 0, hi = a.nseq;  // the sequence r with first_item[r] <= it < first_item[r + 1]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (first_item[mid] <= it) lo = mid; else hi = mid;
    }
    const int64_t r = lo, local = it - first_item[r];
    const int64_t tile = local / a.hkv, h = local % a.hkv;
    const int64_t rows_left = a.q_len[r] - tile * kTile;
    work_item<TQ, TC, D>(a, r, a.q_start[r] + tile * kTile, rows_left < kTile ? rows_left : kTile, h);
  }
  free(first_item);
}

template <typename TQ, typename TC>
int dispatch(int64_t d, const Args<TQ, TC>& a, int nthreads) {
  switch (d) {
    case 16: run<TQ, TC, 16>(a, nthreads); return 0;
    case 32: run<TQ, TC, 32>(a, nthreads); return 0;
    case 64: run<TQ, TC, 64>(a, nthreads); return 0;
    case 80: run<TQ, TC, 80>(a, nthreads); return 0;
    case 96: run<TQ, TC, 96>(a, nthreads); return 0;
    case 128: run<TQ, TC, 128>(a, nthreads); return 0;
    case 256: run<TQ, TC, 256>(a, nthreads); return 0;
    default: return 1;
  }
}

template <typename TQ, typename TC = TQ>
int call(int64_t d, const void* q, const void* kc, const void* vc, const int64_t* slots, int64_t kmax,
         const int64_t* q_start, const int64_t* q_len, const int64_t* kv_limit, const void* kx, const void* vx,
         int64_t nseq, int64_t hq, int64_t hkv, float scale, void* out, float* lse, int nthreads) {
  const Args<TQ, TC> a{static_cast<const TQ*>(q), static_cast<const TC*>(kc), static_cast<const TC*>(vc), slots,
                       kmax, q_start, q_len, kv_limit, static_cast<const TQ*>(kx), static_cast<const TQ*>(vx),
                       nseq, hq, hkv, scale, static_cast<TQ*>(out), lse};
  return dispatch<TQ, TC>(d, a, nthreads);
}

}  // namespace

extern "C" {

// dtype 0: float32, 1: bfloat16 (q, caches, kx / vx and out share it), 2: float32 q, kx / vx
// and out over bfloat16 caches. Returns 0, 1 for an unsupported head_dim (the caller then uses
// the PyTorch path), 2 / 3 for bad heads / dtype. kx, vx and lse may be null.
int dspark_paged_attention(int dtype, const void* q, const void* kc, const void* vc, const int64_t* slots,
                           int64_t kmax, const int64_t* q_start, const int64_t* q_len, const int64_t* kv_limit,
                           const void* kx, const void* vx, int64_t nseq, int64_t hq, int64_t hkv, int64_t d,
                           float scale, void* out, float* lse, int nthreads) {
  if (hkv <= 0 || hq % hkv != 0) return 2;
  if (dtype == 0)
    return call<float>(d, q, kc, vc, slots, kmax, q_start, q_len, kv_limit, kx, vx, nseq, hq, hkv, scale, out, lse,
                       nthreads);
  if (dtype == 1)
    return call<uint16_t>(d, q, kc, vc, slots, kmax, q_start, q_len, kv_limit, kx, vx, nseq, hq, hkv, scale, out,
                          lse, nthreads);
  if (dtype == 2)
    return call<float, uint16_t>(d, q, kc, vc, slots, kmax, q_start, q_len, kv_limit, kx, vx, nseq, hq, hkv, scale,
                                 out, lse, nthreads);
  return 3;
}

int dspark_abi_version() { return 2; }
}
