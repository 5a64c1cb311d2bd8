// The blocked regime of the GEMM: fp32 on AVX-512 with more rows than the streaming regime takes, compute
// bound.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "linear_impl.h"

namespace bertfast {
namespace cpu {
namespace linear_detail {

#if BF_X86
namespace {

// ---- blocked regime (fp32, more than kPackPasses passes): compute bound ----
//
// Goto-style blocking. The output is cut into items: row blocks of up to kBlockRows rows times one
// run of panels per thread (BlockedItems), claimed one at a time (at 576 rows 10 items for 2 threads;
// blocks of 192 rows, 6 items, took x1.00-1.03 the time). An item runs K in blocks of kBlockK steps:
// the block of x is packed as the tiles read it (pack_x_tiles: a k step's 8 rows in 32 contiguous
// bytes) into L2, then for each panel of the run its kBlockK x 48 block of weights (36 KB) comes from
// memory once and stays in L1 while every tile of 8 rows runs over it. A tile sums each k block from
// zero and adds that to the sums of the earlier blocks, which wait in a per-thread buffer (a tile's
// 1.5 KB in one place); the weight block the item runs next is pulled into L2 a share per tile, a line
// every 4 k steps. The last k block keeps the sums in registers for the epilogue (bias, activation,
// residual): nothing runs over the output a second time.
// Measured on Sapphire Rapids (2 threads, the four BERT-base GEMM shapes, paired in one process with
// torch.addmm = MKL's sgemm, interleaved): at M = 576 time x0.95-0.97 of MKL's when the host runs fast
// (~320 GFLOP/s for MKL), x0.98-1.0 when it runs slow (~210); at M = 48-256 x0.65-0.90, as the
// register-tile sweep it replaced (which reached only x0.98-1.06 of MKL at 576). Summing by blocks also
// makes it more accurate than one running sum over K: max error 1.6e-6 against 1.0e-5 (MKL 2.2e-6) for
// 576 x 3072 by 3072 x 768 against float64.
constexpr int64_t kBlockK = kBlockSteps<float>;

// dst[k][r] = src[r][k] for an 8 x 8 block (rows of src `ld` apart).
BF_TARGET_AVX512 BF_INLINE void transpose_8x8(const float* src, int64_t ld, float* dst) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // r_i[0] r_i+1[0] r_i[1] r_i+1[1] | same for 4..5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // columns 2, 3 | 6, 7
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);      // column 0 of rows i..i+3 | column 4
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);  // column 1 | 5
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + 8 * j, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
    _mm256_storeu_ps(dst + 8 * (j + 4), _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
  }
}

// x rows [0, rows) x k steps [k0, k0 + kc) as tiles of 8 rows: [tiles][kc][8], rows past `rows` zero.
BF_TARGET_AVX512 void pack_x_tiles(const float* x, int64_t ldx, int64_t rows, int64_t k0, int64_t kc, float* xt) {
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows, xt += kc * kMaxRows) {
    const float* src = x + m0 * ldx + k0;
    int64_t k = 0;
    if (m0 + kMaxRows <= rows)
      for (; k + 8 <= kc; k += 8) transpose_8x8(src + k, ldx, xt + k * kMaxRows);
    for (; k < kc; ++k)
      for (int r = 0; r < kMaxRows; ++r) xt[k * kMaxRows + r] = m0 + r < rows ? src[r * ldx + k] : 0.f;
  }
}

// One tile of MR rows over one k block: x tile [kc][8], weights [kc][48]. The block is summed from
// zero and then added to the earlier blocks' sums in `c` unless `first` (a sum of K/kBlockK partial
// sums of kBlockK terms each, whose rounding error grows with kBlockK + K/kBlockK rather than with
// K); the total goes to `to`. Every 4 k steps one cache line from `pf` on is pulled into L2 (the weight
// block the item runs next; prefetches never fault, so running past its end is harmless). Paired with
// the previous schedule (a prefetch credit counted every k step, plus the next tile's sums pulled into
// L1): x0.96-0.98 the time at 128-1024 rows; without any prefetch x1.09-1.16.
template <int MR>
BF_TARGET_AVX512 BF_INLINE void tile_blocked(const float* xt, const float* w, int64_t kc, const float* c, bool first,
                                             const char* pf, const TileOut& to) {
  __m512 acc[MR][3];
  load_acc<MR>(acc, c, true);
  const auto x_at = [&](int r) { return xt[r]; };
  int64_t k = 0;
  for (; k + 4 <= kc; k += 4, pf += 64) {
    _mm_prefetch(pf, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u, w += kPanel, xt += kMaxRows) fma_step<MR>(acc, w, x_at);
  }
  for (; k < kc; ++k, w += kPanel, xt += kMaxRows) fma_step<MR>(acc, w, x_at);
  if (!first) add_earlier<MR>(acc, c);
  if (to.ep == nullptr)
    store_acc<MR>(acc, to.sums);
  else if (to.ep->act == Activation::Gelu)
    finish_tile<MR, Activation::Gelu>(acc, to);
  else if (to.ep->act == Activation::Relu)
    finish_tile<MR, Activation::Relu>(acc, to);
  else
    finish_tile<MR, Activation::None>(acc, to);
}

BF_TARGET_AVX512 void tile_blocked_rows(int mr, const float* xt, const float* w, int64_t kc, const float* c, bool first,
                                        const char* pf, const TileOut& to) {
  switch (mr) {
    case 1: tile_blocked<1>(xt, w, kc, c, first, pf, to); break;
    case 2: tile_blocked<2>(xt, w, kc, c, first, pf, to); break;
    case 3: tile_blocked<3>(xt, w, kc, c, first, pf, to); break;
    case 4: tile_blocked<4>(xt, w, kc, c, first, pf, to); break;
    case 5: tile_blocked<5>(xt, w, kc, c, first, pf, to); break;
    case 6: tile_blocked<6>(xt, w, kc, c, first, pf, to); break;
    case 7: tile_blocked<7>(xt, w, kc, c, first, pf, to); break;
    default: tile_blocked<8>(xt, w, kc, c, first, pf, to); break;
  }
}

}  // namespace

// One item: output rows [r0, r0 + rows) x panels [p0, p1).
BF_TARGET_AVX512 void linear_blocked_f32(const float* x, int64_t ldx, const float* packed, int64_t N, int64_t K,
                                         const Epilogue& ep, int64_t r0, int64_t rows, int64_t p0, int64_t p1) {
  DenormalGuard ftz;
  thread_local std::vector<float> xt, sums;
  xt.resize(((kBlockRows + kMaxRows - 1) / kMaxRows) * kMaxRows * kBlockK);
  const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
  // The sums between k blocks: [panels][tiles][8][kPanel], a tile's in 1.5 KB at one place.
  sums.resize((p1 - p0) * tiles * kMaxRows * kPanel);
  alignas(64) float tile[kMaxRows * kPanel];
  const bool in_registers = has_act512(ep.act);
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t kc = std::min(kBlockK, K - k0);
    const bool first = k0 == 0, last = k0 + kc == K;
    pack_x_tiles(x + r0 * ldx, ldx, rows, k0, kc, xt.data());
    for (int64_t p = p0; p < p1; ++p) {
      const float* w = packed + (p * K + k0) * kPanel;
      // The weight block this item runs next: the next panel's, or its first panel's next k block.
      const float* w_after = p + 1 < p1 ? w + K * kPanel : (last ? nullptr : packed + (p0 * K + k0 + kc) * kPanel);
      const int64_t lines = kc * kStepBytes / 64;  // of a weight block
      const int64_t n0 = p * kPanel, nvalid = std::min<int64_t>(kPanel, N - n0);
      float* c = sums.data() + (p - p0) * tiles * kMaxRows * kPanel;
      for (int64_t t = 0; t < tiles; ++t) {
        // The next weight block into L2 from this tile's share of its lines on (the current block, already
        // in L1, when there is no next one).
        const char* pf = w_after != nullptr ? reinterpret_cast<const char*>(w_after) + (lines * t / tiles) * 64
                                            : reinterpret_cast<const char*>(w);
        const int64_t m0 = t * kMaxRows;
        const int mr = int(std::min<int64_t>(kMaxRows, rows - m0));
        float* ct = c + m0 * kPanel;
        const float* xs = xt.data() + t * kc * kMaxRows;
        if (!last) {
          tile_blocked_rows(mr, xs, w, kc, ct, first, pf, TileOut{ct, nullptr, 0, 0, 0});
        } else if (in_registers) {
          tile_blocked_rows(mr, xs, w, kc, ct, first, pf, TileOut{nullptr, &ep, r0 + m0, n0, nvalid});
        } else {
          tile_blocked_rows(mr, xs, w, kc, ct, first, pf, TileOut{tile, nullptr, 0, 0, 0});
          store_tile<float>(tile, mr, r0 + m0, n0, nvalid, ep);
        }
      }
    }
  }
}
#endif

}  // namespace linear_detail
}  // namespace cpu
}  // namespace bertfast
