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
//
// bf16 operands (x and the packed weight; bias and out fp32): on the AMX tiers, K a multiple of kAmxK, the tiles
// (sparse_pool_amx.cpp): each thread takes a contiguous run of panels, in groups whose weights stay in L2, and for
// each group runs the whole x in row blocks, in order, through the blocked AMX GEMM, whose epilogue folds the
// logits into `out` (the running values). Elsewhere x is widened to fp32 once and each panel as a thread takes it,
// then the fp32 kernel above runs on the same bf16 values. choose_sparse_pool holds the rule.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/gemm/amx_gemm.h"
#include "cpu/gemm/sparse_pool_impl.h"

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

}  // namespace

const char* sparse_pool_path_name(SparsePoolPath path) {
  switch (path) {
    case SparsePoolPath::Portable: return "Portable";
    case SparsePoolPath::Avx512: return "Avx512";
    case SparsePoolPath::WidePortable: return "WidePortable";
    case SparsePoolPath::WideAvx512: return "WideAvx512";
    case SparsePoolPath::Amx: return "Amx";
    case SparsePoolPath::AmxEmulated: return "AmxEmulated";
  }
  return "?";
}

// The one rule. Batch invariance: nothing here reads T or the batch. Thresholds: bf16 on AMX tiles where K % kAmxK
// == 0 on the AMX tiers; AVX-512 register tiles from the avx512_vnni tier up (avx2 runs the plain loops).
SparsePoolPath choose_sparse_pool(const SparsePoolCall& c) {
  if (c.bf16 && amx_kernels(c.isa) && c.k % kAmxK == 0)
    return c.isa == Isa::AmxEmulated ? SparsePoolPath::AmxEmulated : SparsePoolPath::Amx;
  const bool avx512 = BF_X86 && c.isa >= Isa::Avx512Vnni;
  if (c.bf16) return avx512 ? SparsePoolPath::WideAvx512 : SparsePoolPath::WidePortable;
  return avx512 ? SparsePoolPath::Avx512 : SparsePoolPath::Portable;
}

namespace {

// One panel p of fp32 weights w ([K][kPanel]) against every sequence: out[:, p * kPanel + j] for j < nvalid.
void pool_panel(TileFn tile_fn, const float* x, int64_t ldx, const int32_t* cu_seqlens, int64_t batch, const float* w,
                const float* bias, int64_t p, int64_t V, int64_t K, SparsePooling pooling, bool twice, float* out) {
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
}

TileFn tile_for(SparsePoolPath path) {
#if BF_X86
  if (path == SparsePoolPath::Avx512 || path == SparsePoolPath::WideAvx512) return tile_avx512;
#endif
  return tile_generic;
}

int pool_threads(int64_t tokens, int64_t V, int64_t K) { return threads_for(std::max<int64_t>(tokens, 1) * V * K / 4); }

#if BF_X86
// Weights of the panels one AMX group runs every row block against: they stay in L2 (SPR: 2 MB a core) beside the
// row block's x, so the weights are read from memory once and x once per group.
constexpr int64_t kAmxGroupBytes = 1 << 20;

void pool_amx(const bf16* x, int64_t ldx, const int32_t* cu_seqlens, int64_t batch, const bf16* packed,
              const float* bias, int64_t V, int64_t K, SparsePooling pooling, bool twice, float* out, bool emulated) {
  const int64_t T = cu_seqlens[batch], units = (V + kPanel - 1) / kPanel;
  std::vector<int32_t> seq(T);
  for (int64_t s = 0; s < batch; ++s)
    std::fill(seq.begin() + cu_seqlens[s], seq.begin() + cu_seqlens[s + 1], int32_t(s));
  const sparse_detail::PoolArgs args{seq.data(), V, pooling, bias, twice, out};
  const int64_t group = std::max<int64_t>(1, kAmxGroupBytes / (K * kPanel * 2)), rows = amx_blocking().rows;
  const int nt = int(std::min<int64_t>(units, pool_threads(T, V, K)));
  parallel_for(nt, nt, [&](int64_t part) {
    // The part's panels, one contiguous run: its columns' running values are this thread's alone.
    const int64_t u0 = units * part / nt, u1 = units * (part + 1) / nt;
    const int64_t n0 = u0 * kPanel, n1 = std::min(V, u1 * kPanel);
    const float init = pooling == SparsePooling::Max ? -std::numeric_limits<float>::infinity() : 0.f;
    for (int64_t s = 0; s < batch; ++s) std::fill(out + s * V + n0, out + s * V + n1, init);
    for (int64_t g0 = u0; g0 < u1; g0 += group) {
      const int64_t g1 = std::min(u1, g0 + group);
      for (int64_t r0 = 0; r0 < T; r0 += rows) {
        const int64_t mr = std::min(rows, T - r0);
        emulated ? sparse_detail::sparse_pool_amx_emulated(x, ldx, packed, K, args, r0, mr, g0, g1)
                 : sparse_detail::sparse_pool_amx(x, ldx, packed, K, args, r0, mr, g0, g1);
      }
    }
    if (pooling == SparsePooling::Max)
      for (int64_t s = 0; s < batch; ++s)
        for (int64_t n = n0; n < n1; ++n)
          out[s * V + n] = splade_act(out[s * V + n] + (bias != nullptr ? bias[n] : 0.f), twice);
  });
}
#endif

}  // namespace

void sparse_pool(const float* x, int64_t ldx, const int32_t* cu_seqlens, int64_t batch, const float* packed,
                 const float* bias, int64_t V, int64_t K, SparsePooling pooling, bool twice, float* out) {
  if (V == 0) return;
  const TileFn tile_fn = tile_for(choose_sparse_pool({false, K, active_isa()}));
  const int64_t panels = (V + kPanel - 1) / kPanel;
  parallel_for(pool_threads(cu_seqlens[batch], V, K), panels, [&](int64_t p) {
    pool_panel(tile_fn, x, ldx, cu_seqlens, batch, packed + p * K * kPanel, bias, p, V, K, pooling, twice, out);
  });
}

void sparse_pool(const bf16* x, int64_t ldx, const int32_t* cu_seqlens, int64_t batch, const bf16* packed,
                 const float* bias, int64_t V, int64_t K, SparsePooling pooling, bool twice, float* out) {
  if (V == 0) return;
  const SparsePoolPath path = choose_sparse_pool({true, K, active_isa()});
#if BF_X86
  if (path == SparsePoolPath::Amx || path == SparsePoolPath::AmxEmulated)
    return pool_amx(x, ldx, cu_seqlens, batch, packed, bias, V, K, pooling, twice, out,
                    path == SparsePoolPath::AmxEmulated);
#endif
  const TileFn tile_fn = tile_for(path);
  const int64_t T = cu_seqlens[batch], panels = (V + kPanel - 1) / kPanel, kp = (K + 1) / 2;
  std::vector<float> x32(T * K);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) x32[t * K + k] = to_float(x[t * ldx + k]);
  parallel_for(pool_threads(T, V, K), panels, [&](int64_t p) {
    // The panel [kp][kPanel][2] (pairs along K) as the fp32 kernels read it, [K][kPanel].
    thread_local std::vector<float> w32;
    w32.resize(K * kPanel);
    const bf16* w = packed + p * kp * kPanel * 2;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < kPanel; ++j) w32[k * kPanel + j] = to_float(w[((k / 2) * kPanel + j) * 2 + k % 2]);
    pool_panel(tile_fn, x32.data(), K, cu_seqlens, batch, w32.data(), bias, p, V, K, pooling, twice, out);
  });
}

}  // namespace cpu
}  // namespace bertfast
