// Embedding gather (word + token type + position) fused with the embedding LayerNorm: one pass per token,
// the sum kept in fp32 (the reference rounds each partial sum in bf16; this is at least as accurate). The token
// type table and the position table (rotary models have none) may be absent. The word table is of W, the rest (the
// other tables, the LayerNorm, out) of T: both fp32, both bf16, or a bf16 word table with the rest fp32, the start
// of a bf16 forward's fp32 residual stream. Rounding the position and token type rows (the same rows in every
// sequence) and the output to bf16 was most of that stream's error beyond the GEMMs' operands (BERT-base random
// weights: docs/cpu-gemm.md#bf16-accuracy).
#include <omp.h>

#include <cmath>
#include <vector>

#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/scalar_math.h"
#include "cpu/common/parallel.h"

namespace bertfast {
namespace cpu {
namespace {

// LayerNorm(w + y) of one token without a position row (y, the token type row, may be null).
template <typename W, typename T>
BF_INLINE void embed_row_unpositioned(const W* w, const T* y, int64_t H, float eps, const T* gamma, const T* beta,
                                      T* out, float* row) {
  const float shift = to_float(w[0]) + (y != nullptr ? to_float(y[0]) : 0.f);
  float sum = 0.f;
  if (y != nullptr) {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < H; ++i) {
      row[i] = (to_float(w[i]) + to_float(y[i])) - shift;
      sum += row[i];
    }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < H; ++i) {
      row[i] = to_float(w[i]) - shift;
      sum += row[i];
    }
  }
  normalize_row(row, sum, H, eps, gamma, beta, out);
}

template <typename W, typename T>
BF_INLINE void embed_thread(const int64_t* ids, const int64_t* positions, const int64_t* types, const W* word,
                            const T* pos, const T* type, const T* gamma, const T* beta, float eps,
                            int64_t tokens, int64_t H, T* out, int part, int parts) {
  int64_t lo, hi;
  split_range(tokens, part, parts, &lo, &hi);
  std::vector<float> buf(H);
  float* row = buf.data();
  for (int64_t t = lo; t < hi; ++t) {
    const W* w = word + ids[t] * H;
    const T* p = pos != nullptr ? pos + positions[t] * H : nullptr;
    const T* y = types != nullptr ? type + types[t] * H : nullptr;
    if (p == nullptr) {  // no position table (rotary models): word + token type alone
      embed_row_unpositioned(w, y, H, eps, gamma, beta, out + t * H, row);
      continue;
    }
    // Shifted by the first element, as in layernorm.cpp, so the statistics do not cancel.
    const float shift = to_float(w[0]) + (y != nullptr ? to_float(y[0]) : 0.f) + to_float(p[0]);
    float sum = 0.f;
    if (y != nullptr) {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < H; ++i) {
        row[i] = (to_float(w[i]) + to_float(y[i]) + to_float(p[i])) - shift;
        sum += row[i];
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < H; ++i) {
        row[i] = (to_float(w[i]) + to_float(p[i])) - shift;
        sum += row[i];
      }
    }
    normalize_row(row, sum, H, eps, gamma, beta, out + t * H);
  }
}

#if BF_X86
template <typename W, typename T>
BF_TARGET_AVX2 void embed_avx2(const int64_t* ids, const int64_t* positions, const int64_t* types, const W* word,
                               const T* pos, const T* type, const T* gamma, const T* beta, float eps, int64_t tokens,
                               int64_t H, T* out, int part, int parts) {
  embed_thread(ids, positions, types, word, pos, type, gamma, beta, eps, tokens, H, out, part, parts);
}

template <typename W, typename T>
BF_TARGET_AVX512 void embed_avx512(const int64_t* ids, const int64_t* positions, const int64_t* types,
                                   const W* word, const T* pos, const T* type, const T* gamma, const T* beta,
                                   float eps, int64_t tokens, int64_t H, T* out, int part, int parts) {
  embed_thread(ids, positions, types, word, pos, type, gamma, beta, eps, tokens, H, out, part, parts);
}
#endif

template <typename W, typename T>
void embed_generic(const int64_t* ids, const int64_t* positions, const int64_t* types, const W* word,
                   const T* pos, const T* type, const T* gamma, const T* beta, float eps, int64_t tokens,
                   int64_t H, T* out, int part, int parts) {
  embed_thread(ids, positions, types, word, pos, type, gamma, beta, eps, tokens, H, out, part, parts);
}

}  // namespace

template <typename W, typename T>
void embeddings(const int64_t* ids, const int64_t* positions, const int64_t* types, const W* word, const T* pos,
                const T* type, const T* gamma, const T* beta, float eps, int64_t tokens, int64_t hidden, T* out) {
  const int nt = threads_for(tokens * hidden);
  parallel_for(nt, nt, [&](int64_t part) {
    BF_DISPATCH(embed, ids, positions, types, word, pos, type, gamma, beta, eps, tokens, hidden, out, int(part), nt);
  });
}

template void embeddings<float, float>(const int64_t*, const int64_t*, const int64_t*, const float*, const float*,
                                       const float*, const float*, const float*, float, int64_t, int64_t, float*);
template void embeddings<bf16, bf16>(const int64_t*, const int64_t*, const int64_t*, const bf16*, const bf16*,
                                     const bf16*, const bf16*, const bf16*, float, int64_t, int64_t, bf16*);
template void embeddings<bf16, float>(const int64_t*, const int64_t*, const int64_t*, const bf16*, const float*,
                                      const float*, const float*, const float*, float, int64_t, int64_t, float*);

}  // namespace cpu
}  // namespace bertfast
