// The vanilla Markov head's left-to-right block draft state, shared by markov_greedy.cpp and
// markov_sample.cpp: per request the previous token x_{k-1} (from the anchors), z = W1[x_{k-1}]
// and position k's corrected logits U_k + W2 . z (one GEMM over every request through gemm.h: the
// float32 kernel on W2^T's packed copy at a few requests, else the BLAS sgemm PyTorch's addmm runs, whose address the
// caller passes).
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"

namespace dspark {

struct MarkovBlock {
  int64_t rows, g, vocab, rank;
  const float* base;  // [rows, g, vocab] U_k per position
  const float* w1;    // [vocab, rank] row-major
  const float* w2t;   // [rank, vocab] W2 transposed, contiguous
  const float* w2p;   // w2t in linear_f32.cpp's packed panels (or null)
  float* z = nullptr;       // [rows, rank]
  float* logits = nullptr;  // [rows, vocab]
  int64_t* prev = nullptr;  // [rows]

  MarkovBlock(int64_t rows_, int64_t g_, int64_t vocab_, int64_t rank_, const float* base_, const float* w1_,
              const float* w2t_, const float* w2p_)
      : rows(rows_), g(g_), vocab(vocab_), rank(rank_), base(base_), w1(w1_), w2t(w2t_), w2p(w2p_) {}
  MarkovBlock(const MarkovBlock&) = delete;
  MarkovBlock& operator=(const MarkovBlock&) = delete;
  ~MarkovBlock() {
    free(z);
    free(prev);
  }

  // Buffers allocated and x_0 = the anchors; false when out of memory.
  bool start(const int64_t* anchors) {
    z = static_cast<float*>(malloc(sizeof(float) * rows * (rank + vocab)));
    prev = static_cast<int64_t*>(malloc(sizeof(int64_t) * rows));
    if (!z || !prev) return false;
    logits = z + rows * rank;
    for (int64_t i = 0; i < rows; ++i) prev[i] = anchors[i];
    return true;
  }

  // z = W1[x_{k-1}] for every request.
  void embed_prev() {
    for (int64_t i = 0; i < rows; ++i) memcpy(z + i * rank, w1 + prev[i] * rank, sizeof(float) * rank);
  }

  // logits = U_k + W2 . z for every request (after embed_prev).
  void corrected_logits(const Gemms& gemms, int64_t k) {
    for (int64_t i = 0; i < rows; ++i) memcpy(logits + i * vocab, base + (i * g + k) * vocab, sizeof(float) * vocab);
    linear(gemms, z, rows, rank, w2t, w2p, vocab, logits, true);  // logits [R, V] += z [R, r] . W2^T [r, V]
  }
};

}  // namespace dspark
