// DeBERTa-v2's per-token position terms (`bertfast.disentangled`): for each token t and head h, the row
// out[t, h, :] = scale * x[t, h, :] . pos[r, h, :] over the rows r of the layer's position projections (c2p: x = q,
// pos = pos_key; p2c: x = k, pos = pos_query). The attention adds them per (query, key) from these (T, heads, rows)
// tables (attention_impl.h), so nothing here is quadratic in the length.
//
// pos is widened once per call to fp32 and transposed per head to [d][rows rounded up to 16] (zero columns), so a
// token's row is d broadcast multiply-adds over whole vectors: each entry is one dot product over e in order, with no
// tail loop whose rounding could differ, the same for every token count (batch invariance by construction). Threads
// split the tokens.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace bertfast {
namespace cpu {
namespace {

struct ScoreArgs {
  int64_t ld_row, ld_head, heads, d, rows, rows_pad;
  float scale;
  const float* pos_t;  // [heads][d][rows_pad] fp32
  float* out;          // [tokens][heads][rows]
};

template <typename T>
BF_INLINE void score_rows(const T* x, const ScoreArgs& a, int64_t lo, int64_t hi) {
  std::vector<float> acc(a.rows_pad);
  float* ac = acc.data();
  for (int64_t t = lo; t < hi; ++t) {
    for (int64_t h = 0; h < a.heads; ++h) {
      const T* xr = x + t * a.ld_row + h * a.ld_head;
      const float* pt = a.pos_t + h * a.d * a.rows_pad;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t e = 0; e < a.d; ++e) {
        const float xe = to_float(xr[e]);
        const float* col = pt + e * a.rows_pad;
#pragma omp simd
        for (int64_t r = 0; r < a.rows_pad; ++r) ac[r] += xe * col[r];
      }
      float* o = a.out + (t * a.heads + h) * a.rows;
#pragma omp simd
      for (int64_t r = 0; r < a.rows; ++r) o[r] = ac[r] * a.scale;
    }
  }
}

#if BF_X86
template <typename T>
BF_TARGET_AVX2 void score_avx2(const T* x, const ScoreArgs& a, int64_t lo, int64_t hi) {
  score_rows(x, a, lo, hi);
}

template <typename T>
BF_TARGET_AVX512 void score_avx512(const T* x, const ScoreArgs& a, int64_t lo, int64_t hi) {
  score_rows(x, a, lo, hi);
}
#endif

template <typename T>
void score_generic(const T* x, const ScoreArgs& a, int64_t lo, int64_t hi) {
  score_rows(x, a, lo, hi);
}

}  // namespace

template <typename T>
void position_scores(const T* x, int64_t ld_row, int64_t ld_head, int64_t tokens, int64_t heads, int64_t head_dim,
                     const T* pos, int64_t rows, float scale, float* out) {
  const int64_t rows_pad = (rows + 15) / 16 * 16;
  std::vector<float> pos_t(heads * head_dim * rows_pad, 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t e = 0; e < head_dim; ++e)
        pos_t[(h * head_dim + e) * rows_pad + r] = to_float(pos[r * heads * head_dim + h * head_dim + e]);
  const ScoreArgs a{ld_row, ld_head, heads, head_dim, rows, rows_pad, scale, pos_t.data(), out};
  const int nt = threads_for(tokens * heads * head_dim * rows_pad);
  parallel_for(nt, nt, [&](int64_t part) {
    int64_t lo, hi;
    split_range(tokens, int(part), nt, &lo, &hi);
    BF_DISPATCH(score, x, a, lo, hi);
  });
}

template void position_scores<float>(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, int64_t,
                                     float, float*);
template void position_scores<bf16>(const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t, const bf16*, int64_t,
                                    float, float*);

}  // namespace cpu
}  // namespace bertfast
