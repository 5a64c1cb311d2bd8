// The blocked regimes of the GEMM: fp32 with more rows than the streaming regime takes, compute bound. On
// AVX-512 (linear_blocked_f32) and on the portable tier (linear_blocked_generic, 4-lane vectors).
#include <omp.h>

#include <algorithm>
#include <vector>

#include "cpu/gemm/linear_impl.h"

namespace bertfast {
namespace cpu {
namespace linear_detail {

// ---- portable blocked regime (fp32, more than kPackPasses passes) ----
//
// The same items as the AVX-512 regime (BlockedItems), in code any compiler vectorizes to its 4-lane
// registers (SSE2 on x86-64, NEON on aarch64): per k block of kPortableK steps, x's rows are packed into
// tiles of kPortableRows rows with each value already broadcast to 4 lanes (so a tile step is plain
// loads, no shuffles); then for each panel of the run, each tile runs over the block's weights a slice of
// kPortableCols * 4 columns at a time: 3 x 16 columns in 12 accumulators, which with the 4 weight vectors
// fill the 16 registers of SSE2. Each output element is one running sum over k in order, continued from
// block to block through `sums`, then the streaming regime's epilogue (store_tile): every row's result is
// bit for bit that of linear_stream_generic, whatever M. It runs as fast as MKL's SSE2 sgemm
// (benchmarks/results/2026-12-06-native-notes): what it adds is what it fuses (bias, activation, residual) and the
// row independence.
namespace {

using f4 = float __attribute__((vector_size(16)));
constexpr int kPortableRows = 3;
constexpr int kPortableCols = 4;  // f4 vectors
constexpr int64_t kPortableK = 128;
static_assert(kPanel % (4 * kPortableCols) == 0, "a panel is whole slices");

BF_INLINE f4 load4(const float* p) {
  f4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
BF_INLINE void store4(float* p, f4 v) { std::memcpy(p, &v, sizeof(v)); }

// x rows [0, rows) x k steps [k0, k0 + kc) as [tiles][kc][kPortableRows] broadcast values, rows past
// `rows` zero.
void pack_x_broadcast(const float* x, int64_t ldx, int64_t rows, int64_t k0, int64_t kc, f4* xt) {
  for (int64_t m0 = 0; m0 < rows; m0 += kPortableRows, xt += kc * kPortableRows) {
    for (int r = 0; r < kPortableRows; ++r) {
      if (m0 + r < rows) {
        const float* src = x + (m0 + r) * ldx + k0;
        for (int64_t k = 0; k < kc; ++k) xt[k * kPortableRows + r] = f4{} + src[k];
      } else {
        for (int64_t k = 0; k < kc; ++k) xt[k * kPortableRows + r] = f4{};
      }
    }
  }
}

// One tile's slice over one k block: the running sums `c` (rows kPanel apart; zero when `first`) plus
// x tile [kc][kPortableRows] times weights [kc][kPanel] (the slice's columns from w on).
BF_INLINE void slice_generic(const f4* xt, const float* w, int64_t kc, float* c, bool first) {
  f4 acc[kPortableRows][kPortableCols];
#pragma GCC unroll 4
  for (int r = 0; r < kPortableRows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kPortableCols; ++v) acc[r][v] = first ? f4{} : load4(c + r * kPanel + 4 * v);
  for (int64_t k = 0; k < kc; ++k, w += kPanel, xt += kPortableRows) {
    f4 wv[kPortableCols];
#pragma GCC unroll 4
    for (int v = 0; v < kPortableCols; ++v) wv[v] = load4(w + 4 * v);
#pragma GCC unroll 4
    for (int r = 0; r < kPortableRows; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < kPortableCols; ++v) acc[r][v] += xt[r] * wv[v];
  }
#pragma GCC unroll 4
  for (int r = 0; r < kPortableRows; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kPortableCols; ++v) store4(c + r * kPanel + 4 * v, acc[r][v]);
}

}  // namespace

void linear_blocked_generic(const float* x, int64_t ldx, const float* packed, int64_t N, int64_t K, const Epilogue& ep,
                            int64_t r0, int64_t rows, int64_t p0, int64_t p1) {
  DenormalGuard ftz;
  const int64_t tiles = (rows + kPortableRows - 1) / kPortableRows, tile_elems = kPortableRows * kPanel;
  thread_local std::vector<f4> xbuf;
  thread_local std::vector<float> sums;  // [panels][tiles][kPortableRows][kPanel]
  xbuf.resize(size_t(tiles * kPortableRows * kPortableK + 4));
  // x's tiles start 16 bytes past a cache line: at a line boundary, with the packed weights' rows at line boundaries
  // too, the same loop ran slower (benchmarks/results/2026-11-26-cpu-gemm).
  f4* xt = xbuf.data() + (4 - reinterpret_cast<uintptr_t>(xbuf.data()) / sizeof(f4) % 4) % 4 + 1;
  sums.resize(size_t((p1 - p0) * tiles * tile_elems));
  for (int64_t k0 = 0; k0 < K; k0 += kPortableK) {
    const int64_t kc = std::min(kPortableK, K - k0);
    pack_x_broadcast(x + r0 * ldx, ldx, rows, k0, kc, xt);
    for (int64_t p = p0; p < p1; ++p) {
      const float* w = packed + (p * K + k0) * kPanel;
      float* c = sums.data() + (p - p0) * tiles * tile_elems;
      for (int64_t t = 0; t < tiles; ++t) {
        float* ct = c + t * tile_elems;
        for (int64_t s = 0; s < kPanel; s += 4 * kPortableCols)
          slice_generic(xt + t * kc * kPortableRows, w + s, kc, ct + s, k0 == 0);
        if (k0 + kc == K) {
          const int64_t m0 = t * kPortableRows, n0 = p * kPanel;
          store_tile<float>(ct, int(std::min<int64_t>(kPortableRows, rows - m0)), r0 + m0, n0,
                            std::min<int64_t>(kPanel, N - n0), ep);
        }
      }
    }
  }
}

#if BF_X86
namespace {

// ---- blocked regime (fp32, more than kPackPasses passes): compute bound ----
//
// Goto-style blocking. The output is cut into items: row blocks of up to kBlockRows rows times one
// run of panels per thread (BlockedItems), claimed one at a time. An item runs K in blocks of kBlockK steps:
// for each panel of the run its kBlockK x 48 block of weights (36 KB) comes from memory once and stays in
// L1 while every tile of 8 rows runs over it, reading its rows of x's block in place (from L2). A tile sums
// each k block from zero and adds that to the sums of the earlier blocks, which wait in a per-thread buffer
// (a tile's 1.5 KB in one place); the weight block the item runs next is pulled into L2 a share per tile, a line
// every 4 k steps. The last k block keeps the sums in registers for the epilogue (bias, activation,
// residual): nothing runs over the output a second time. Two more streams are requested ahead, as the hardware
// does not follow them: as a tile's last k block starts, the lines of the residual and output it will read and
// write (prefetch_epilogue); and with each tile a share of the x this item reads next (XLines: its next k block, or
// the next row block's first). Its times against MKL's sgemm: benchmarks/results/2026-11-26-cpu-gemm. Summing by
// blocks also makes it more accurate than one running sum over K (docs/cpu-gemm.md).
constexpr int64_t kBlockK = kBlockSteps<float>;

// One tile of MR rows over one k block: x's rows (ldx floats apart, from the block's first k step), weights
// [kc][48]. Each k step broadcasts one value from each of the MR rows, read where they are: packing x first into
// tiles (a k step's 8 rows in 32 contiguous bytes) cost more than it saved. The block is
// summed from zero and then added to the earlier blocks' sums in `c` unless `first` (a sum of K/kBlockK partial
// sums of kBlockK terms each, whose rounding error grows with kBlockK + K/kBlockK rather than with
// K); with RUNNING (bf16, linear_blocked_bf16) it continues one running sum over K from `c` instead, as
// the bf16 streaming tiles do. The total goes to `to`. Every 4 k steps one cache line from `pf` on is
// pulled into L2 (the weight block the item runs next; prefetches never fault, so running past its end
// is harmless); without it the tiles wait on memory.
template <int MR, bool RUNNING>
BF_TARGET_AVX512 BF_INLINE void tile_blocked(const float* x, int64_t ldx, const float* w, int64_t kc, const float* c,
                                             bool first, const char* pf, const TileOut& to) {
  __m512 acc[MR][3];
  load_acc<MR>(acc, c, RUNNING ? first : true);
  const auto x_at = [&](int r) { return x[r * ldx]; };
  int64_t k = 0;
  for (; k + 4 <= kc; k += 4, pf += 64) {
    _mm_prefetch(pf, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u, w += kPanel, ++x) fma_step<MR>(acc, w, x_at);
  }
  for (; k < kc; ++k, w += kPanel, ++x) fma_step<MR>(acc, w, x_at);
  if (!RUNNING && !first) add_earlier<MR>(acc, c);
  if (to.ep == nullptr)
    store_acc<MR>(acc, to.sums);
  else if (to.ep->act == Activation::Gelu)
    finish_tile<MR, Activation::Gelu>(acc, to);
  else if (to.ep->act == Activation::Relu)
    finish_tile<MR, Activation::Relu>(acc, to);
  else
    finish_tile<MR, Activation::None>(acc, to);
}

template <bool RUNNING = false>
BF_TARGET_AVX512 void tile_blocked_rows(int mr, const float* x, int64_t ldx, const float* w, int64_t kc, const float* c,
                                        bool first, const char* pf, const TileOut& to) {
  switch (mr) {
    case 1: tile_blocked<1, RUNNING>(x, ldx, w, kc, c, first, pf, to); break;
    case 2: tile_blocked<2, RUNNING>(x, ldx, w, kc, c, first, pf, to); break;
    case 3: tile_blocked<3, RUNNING>(x, ldx, w, kc, c, first, pf, to); break;
    case 4: tile_blocked<4, RUNNING>(x, ldx, w, kc, c, first, pf, to); break;
    case 5: tile_blocked<5, RUNNING>(x, ldx, w, kc, c, first, pf, to); break;
    case 6: tile_blocked<6, RUNNING>(x, ldx, w, kc, c, first, pf, to); break;
    case 7: tile_blocked<7, RUNNING>(x, ldx, w, kc, c, first, pf, to); break;
    default: tile_blocked<8, RUNNING>(x, ldx, w, kc, c, first, pf, to); break;
  }
}

// bf16 x rows [0, rows) x k steps [k0, k0 + kc) widened to fp32, 16 values at a time, into `xw` ([rows][kc],
// row-major, as the tiles read it); steps at or past K (an odd K's pad) zero.
BF_TARGET_AVX512 void widen_x_rows(const bf16* x, int64_t ldx, int64_t rows, int64_t K, int64_t k0, int64_t kc,
                                   float* xw) {
  const int64_t kn = std::min(kc, K - k0);
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* src = x + r * ldx + k0;
    float* dst = xw + r * kc;
    for (int64_t j = 0; j < kc; j += 16)
      _mm512_mask_storeu_ps(dst + j, tail_mask(kc - j), load16(src + j, tail_mask(kn - j)));
  }
}

// A packed bf16 weight block of kc (even) k steps, [kc / 2][kPanel][2], as fp32 [kc][kPanel]: a 32-bit lane
// holding a pair becomes its even element (shifted up 16 bits) and its odd one (the high half).
BF_TARGET_AVX512 void widen_weight_block(const bf16* w, int64_t kc, float* wt) {
  const __m512i hi_mask = _mm512_set1_epi32(int(0xffff0000u));
  for (int64_t q = 0; q < kc / 2; ++q, w += 2 * kPanel, wt += 2 * kPanel) {
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) {
      const __m512i pairs = _mm512_loadu_si512(w + 32 * v);
      _mm512_storeu_ps(wt + 16 * v, _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)));
      _mm512_storeu_ps(wt + kPanel + 16 * v, _mm512_castsi512_ps(_mm512_and_si512(pairs, hi_mask)));
    }
  }
}

// The cache lines of `rows` rows (ld floats apart) x `cols` floats of x, pulled into L2 a few at a time.
struct XLines {
  const char* base;
  int64_t ld_bytes, per_row, rows, next = 0;
  XLines(const float* x, int64_t ld, int64_t rows_, int64_t cols)
      : base(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(x) & ~uintptr_t(63))),
        ld_bytes(ld * 4),
        per_row(rows_ > 0 ? (reinterpret_cast<uintptr_t>(x + cols) - reinterpret_cast<uintptr_t>(base) + 63) / 64 : 0),
        rows(std::max<int64_t>(rows_, 0)) {}
  int64_t count() const { return rows * per_row; }
  BF_INLINE void pull(int64_t n) {
    for (const int64_t end = std::min(count(), next + n); next < end; ++next)
      __builtin_prefetch(base + (next / per_row) * ld_bytes + (next % per_row) * 64, 0, 2);
  }
};

}  // namespace

// One item: output rows [r0, r0 + rows) x panels [p0, p1) of an M-row output.
BF_TARGET_AVX512 void linear_blocked_f32(const float* x, int64_t ldx, const float* packed, int64_t M, int64_t N,
                                         int64_t K, const Epilogue& ep, int64_t r0, int64_t rows, int64_t p0,
                                         int64_t p1) {
  DenormalGuard ftz;
  thread_local std::vector<float> sums;
  const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
  // The sums between k blocks: [panels][tiles][8][kPanel], a tile's in 1.5 KB at one place.
  sums.resize((p1 - p0) * tiles * kMaxRows * kPanel);
  alignas(64) float tile[kMaxRows * kPanel];
  const bool in_registers = has_act512(ep.act);
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t kc = std::min(kBlockK, K - k0);
    const bool first = k0 == 0, last = k0 + kc == K;
    // The x this item reads next (its next k block; after the last one, the next row block's first, which the
    // thread most likely runs next) into L2, a share per tile.
    XLines next_x = !last ? XLines(x + r0 * ldx + k0 + kc, ldx, rows, std::min(kBlockK, K - k0 - kc))
                          : XLines(x + (r0 + rows) * ldx, ldx, std::min(rows, M - r0 - rows), std::min(kBlockK, K));
    const int64_t x_share = next_x.count() / ((p1 - p0) * tiles) + 1;
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
        const float* xs = x + (r0 + m0) * ldx + k0;
        if (last) prefetch_epilogue<float>(ep, r0 + m0, mr, n0, nvalid);
        next_x.pull(x_share);
        if (!last) {
          tile_blocked_rows(mr, xs, ldx, w, kc, ct, first, pf, TileOut{ct, nullptr, 0, 0, 0});
        } else if (in_registers) {
          tile_blocked_rows(mr, xs, ldx, w, kc, ct, first, pf, TileOut{nullptr, &ep, r0 + m0, n0, nvalid});
        } else {
          tile_blocked_rows(mr, xs, ldx, w, kc, ct, first, pf, TileOut{tile, nullptr, 0, 0, 0});
          store_tile<float>(tile, mr, r0 + m0, n0, nvalid, ep);
        }
      }
    }
  }
}

// One item of bf16 without AVX-512 BF16 dot products: output rows [r0, r0 + rows) x panels [p0, p1). The
// fp32 regime's tiles on operands widened per k block (x's rows; each panel's weight block into a thread
// buffer that the item's up to 16 tiles then read from L1/L2, so the widening costs 1/128 of the block's
// multiply-adds). Each output is one running sum over K in order, odd K's zero pad included, then
// store_tile: every row's result is bit for bit the streaming regime's (tile_avx512_bf16 without dot
// products), whatever M. Measured on AMD EPYC (Zen 4) under avx512_vnni-nobf16, BERT-base b8 x s128:
// docs/cpu-gemm.md#bf16-without-native-dot-products.
BF_TARGET_AVX512 void linear_blocked_bf16(const bf16* x, int64_t ldx, const bf16* packed, int64_t N, int64_t K,
                                          const Epilogue& ep, int64_t r0, int64_t rows, int64_t p0, int64_t p1) {
  DenormalGuard ftz;
  const int64_t K2 = (K + 1) / 2 * 2;  // k steps of a packed panel, the pad included
  static_assert(kBlockK % 2 == 0, "k blocks hold whole pairs");
  thread_local std::vector<float> xw, wt, sums;
  xw.resize(rows * kBlockK);
  wt.resize(kBlockK * kPanel);
  const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
  sums.resize((p1 - p0) * tiles * kMaxRows * kPanel);
  alignas(64) float tile[kMaxRows * kPanel];
  for (int64_t k0 = 0; k0 < K2; k0 += kBlockK) {
    const int64_t kc = std::min(kBlockK, K2 - k0);
    const bool first = k0 == 0, last = k0 + kc == K2;
    widen_x_rows(x + r0 * ldx, ldx, rows, K, k0, kc, xw.data());
    for (int64_t p = p0; p < p1; ++p) {
      const bf16* w = packed + (p * K2 + k0) * kPanel;
      widen_weight_block(w, kc, wt.data());
      // The next panel's block into L2 while this one is computed.
      const char* pf = reinterpret_cast<const char*>(p + 1 < p1 ? w + K2 * kPanel : w);
      const int64_t n0 = p * kPanel, nvalid = std::min<int64_t>(kPanel, N - n0);
      float* c = sums.data() + (p - p0) * tiles * kMaxRows * kPanel;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * kMaxRows;
        const int mr = int(std::min<int64_t>(kMaxRows, rows - m0));
        float* ct = c + m0 * kPanel;
        const char* pf_tile = pf + (kc * kPanel * 2 * t / tiles) / 64 * 64;
        tile_blocked_rows<true>(mr, xw.data() + m0 * kc, kc, wt.data(), kc, ct, first, pf_tile,
                                TileOut{last ? tile : ct, nullptr, 0, 0, 0});
        if (last) store_tile<bf16, true>(tile, mr, r0 + m0, n0, nvalid, ep);
      }
    }
  }
}
#endif

}  // namespace linear_detail
}  // namespace cpu
}  // namespace bertfast
