// SPLADE's pooling fused into the vocabulary GEMM: out[b, v] = reduce over the tokens t of sequence b of
// f(x[t] . w[v] + bias[v]), f(y) = log1p(relu(y)) (log1p applied twice for `log1p_relu`), reduce max or sum.
//
// The (tokens x vocab) logits are never stored: each thread takes whole panels of kPanel vocabulary columns
// (the packed fp32 layout of pack_linear), and for each sequence runs register tiles of up to kTileRows of its
// tokens, in order, over the panel, folding each tile into the sequence's kPanel running values. Memory is the
// output (batch x vocab) and one tile per thread, whatever the token count.
//
// Batch invariance: a logit is one dot product over k in order, the same code whichever rows share its tile; a
// sequence's tokens are folded in order from its first token (a sum's order), and a max is exact in any order.
// So a row's vector does not depend on the other rows of the batch, bit for bit.
//
// Max pooling takes the max of the raw dot products and applies bias and f once per (sequence, column): rounding
// and log1p are monotone, so max_t f(x_t + b) = f(max_t x_t + b), and f runs batch x vocab times instead of
// tokens x vocab times. Sum pooling applies f to every logit (std::log1p, only on the positive ones).
#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/parallel.h"

#if BF_X86
#include "cpu/gemm/linear_impl.h"
#endif

namespace bertfast {
namespace cpu {
namespace {

constexpr int kTileRows = 8;  // tokens per register tile (8 rows x 3 zmm = 24 accumulators on AVX-512)

// One tile of logits without bias: tile[r][c] = x[r] . w[c] for rows r < mr, columns c < kPanel; x rows ldx apart,
// w one panel ([K][kPanel]).
using TileFn = void (*)(const float* x, int64_t ldx, int mr, const float* w, int64_t K, float* tile);

void tile_generic(const float* x, int64_t ldx, int mr, const float* w, int64_t K, float* tile) {
  std::fill(tile, tile + mr * kPanel, 0.f);
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kPanel;
    for (int r = 0; r < mr; ++r) {
      const float a = x[r * ldx + k];
      float* c = tile + r * kPanel;
#pragma omp simd
      for (int j = 0; j < kPanel; ++j) c[j] += a * wk[j];
    }
  }
}

#if BF_X86
using linear_detail::fma_step;
using linear_detail::store_acc;

template <int MR>
BF_TARGET_AVX512 void tile_rows512(const float* x, int64_t ldx, const float* w, int64_t K, float* tile) {
  __m512 c[MR][3];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 3; ++v) c[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) fma_step<MR>(c, w + k * kPanel, [&](int r) { return x[r * ldx + k]; });
  store_acc<MR>(c, tile);
}

void tile_avx512(const float* x, int64_t ldx, int mr, const float* w, int64_t K, float* tile) {
  switch (mr) {
    case 8: return tile_rows512<8>(x, ldx, w, K, tile);
    case 7: return tile_rows512<7>(x, ldx, w, K, tile);
    case 6: return tile_rows512<6>(x, ldx, w, K, tile);
    case 5: return tile_rows512<5>(x, ldx, w, K, tile);
    case 4: return tile_rows512<4>(x, ldx, w, K, tile);
    case 3: return tile_rows512<3>(x, ldx, w, K, tile);
    case 2: return tile_rows512<2>(x, ldx, w, K, tile);
    default: return tile_rows512<1>(x, ldx, w, K, tile);
  }
}
#endif

BF_INLINE float splade_act(float y, bool twice) {
  float z = y > 0.f ? std::log1p(y) : 0.f;
  return twice ? std::log1p(z) : z;
}

}  // namespace

void sparse_pool(const float* x, int64_t ldx, const int32_t* cu_seqlens, int64_t batch, const float* packed,
                 const float* bias, int64_t V, int64_t K, SparsePooling pooling, bool twice, float* out) {
  if (V == 0) return;
  TileFn tile_fn = tile_generic;
#if BF_X86
  if (active_isa() >= Isa::Avx512Vnni) tile_fn = tile_avx512;
#endif
  const int64_t panels = (V + kPanel - 1) / kPanel;
  const int64_t tokens = cu_seqlens[batch];
  const int nt = threads_for(std::max<int64_t>(tokens, 1) * V * K / 4);
  parallel_for(nt, panels, [&](int64_t p) {
    const float* w = packed + p * K * kPanel;
    const int64_t n0 = p * kPanel, nvalid = std::min<int64_t>(kPanel, V - n0);
    float tile[kTileRows * kPanel];
    float b[kPanel];  // the panel's bias (0 without one)
    for (int64_t j = 0; j < kPanel; ++j) b[j] = bias != nullptr && j < nvalid ? bias[n0 + j] : 0.f;
    float run[kPanel];
    for (int64_t s = 0; s < batch; ++s) {
      const float init = pooling == SparsePooling::Max ? -std::numeric_limits<float>::infinity() : 0.f;
      std::fill(run, run + kPanel, init);
      for (int64_t t0 = cu_seqlens[s]; t0 < cu_seqlens[s + 1]; t0 += kTileRows) {
        const int mr = int(std::min<int64_t>(kTileRows, cu_seqlens[s + 1] - t0));
        tile_fn(x + t0 * ldx, ldx, mr, w, K, tile);
        for (int r = 0; r < mr; ++r) {
          const float* c = tile + r * kPanel;
          if (pooling == SparsePooling::Max) {
#pragma omp simd
            for (int j = 0; j < kPanel; ++j) run[j] = std::max(run[j], c[j]);
          } else {
            for (int64_t j = 0; j < nvalid; ++j) run[j] += splade_act(c[j] + b[j], twice);
          }
        }
      }
      float* o = out + s * V + n0;
      for (int64_t j = 0; j < nvalid; ++j)
        o[j] = pooling == SparsePooling::Max ? splade_act(run[j] + b[j], twice) : run[j];
    }
  });
}

}  // namespace cpu
}  // namespace bertfast
