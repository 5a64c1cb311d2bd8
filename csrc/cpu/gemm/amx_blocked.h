// The blocked AMX GEMM's loop nest (amx_gemm.h), written once for the bf16 (linear_amx.cpp) and the int8
// (int8_linear_amx.cpp) kernels, each compiled twice (AMX tiles, emulated tiles: amx_tiles.h). The including file
// defines BF_AMX_BLOCKED_TARGET as its kernels' target attribute (the template is force-inlined into them: GCC
// inlines a targeted function only into one with the same target) and supplies a `Gemm` with:
//   Acc                                the C tiles' element (float, int32_t)
//   steps()                            tile steps along K
//   groups(u)                          16-column groups of unit u (3, fewer in int8's last unit)
//   a_tile(m, s), a_ld()               row m's A tile row at step s (64 bytes on from step s - 1), and the bytes
//                                      between rows
//   b_tile(u, j, s), b_ld()            group j of unit u at step s: 16 rows of 64 bytes, b_ld apart
//   dp0(), dp1(), dp2(), dp3()         the step's multiply-adds: tmm0 += tmm4 tmm6, tmm1 += tmm4 tmm7,
//                                      tmm2 += tmm5 tmm6, tmm3 += tmm5 tmm7
//   store(c, mr, m0, u, groups)        the epilogue of rows [m0, m0 + mr) of unit u from c (rows 48 apart)
//   fold_terms(), fold(m, u, j, two_rows, two_cols)
//                                      whether the C tiles of a pair take LoRA terms after their last K step, and
//                                      that step (BF_LORA_FOLD: pair rows m, unit u, groups j and j + 1)
//   pair_terms(), terms(m, u, j, two_rows, two_cols)
//                                      whether the pair's LoRA terms are computed on the tiles once its C tiles are
//                                      saved (for its store; the int8 kernels, whose C tiles hold int32 sums), and
//                                      that step
// The bf16 kernels (the GEMM's, linear_amx.cpp; SPLADE's pooling, sparse_pool_amx.cpp) share all but the store:
// AmxBf16Operands below.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu/common/amx_tiles.h"
#include "cpu/common/kernels.h"
#include "cpu/gemm/amx_gemm.h"
#include "cpu/gemm/lora.h"

#ifndef BF_AMX_BLOCKED_TARGET
#error "define BF_AMX_BLOCKED_TARGET (the kernels' BF_TARGET_TILES_*) before including amx_blocked.h"
#endif

#if BF_X86
namespace bertfast {
namespace cpu {
namespace amx_blocked_detail {

// tmm0-3: C of [row block 0, 1] x [column group 0, 1] of the pair; tmm4-5: A of row block 0, 1; tmm6-7: B of column
// group 0, 1. Row block 0 has rows0 rows, block 1 rows1 (0: none; its tiles then take rows0 and stay unused).
// Reconfigured (which zeroes the tiles) only when the pair's rows change: at the item's last pair.
static BF_TARGET_TILES BF_INLINE void configure_pair(int rows0, int rows1, int* configured) {
  const int key = rows0 * 32 + rows1;
  if (key == *configured) return;
  *configured = key;
  if (rows1 == 0) rows1 = rows0;
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = uint8_t(rows[t]);
    cfg.colsb[t] = 64;
  }
  BF_TILE_LOADCONFIG(&cfg);
}

// The next weight sub-panel (the next K block, or the next unit's first) pulled into L2 while this one is
// computed, a few lines per tile step: `lines` lines, in (step, group, tile row) order, over `calls` calls of step().
// No divisions: a step is ~64 cycles of multiply-adds.
template <typename Gemm>
struct NextBlock {
  const Gemm& g;
  int64_t u, s, groups, lines, calls, credit = 0;
  int j = 0, r = 0;

  BF_INLINE void step() {
    for (credit += lines; credit >= calls; credit -= calls) {
      _mm_prefetch(reinterpret_cast<const char*>(g.b_tile(u, j, s)) + r * g.b_ld(), _MM_HINT_T1);
      if (++r == 16) {
        r = 0;
        if (++j == groups) j = 0, ++s;
      }
    }
  }
};

// C tiles 0-3 += the LoRA terms (BF_LORA_FOLD) of row blocks m (C 0, 1; A tile 4) and m + 16 (C 2, 3; A 5, where
// two_rows) at the 16-column groups from n (C 0, 2; B tile 6) and n + 16 (C 1, 3; B 7, where second). Where the
// blocks are on one factor and the groups in one segment, as GEMM steps, each A tile loaded once for both groups;
// the macro per tile otherwise. Each C tile takes the same multiply-adds in the same order either way: the same bits.
static BF_AMX_BLOCKED_TARGET BF_INLINE void fold_pair(const LoraTerm& t, int64_t m, int64_t n, bool two_rows,
                                                      bool second) {
  const int64_t b = m / 16, e0 = t.block_at[b], e1 = t.block_at[b + 1];
  const bool fast = e1 - e0 == 1 && (!two_rows || (t.block_at[b + 2] - e1 == 1 &&
                                                    t.fold[e1].factor == t.fold[e0].factor));
  const LoraFoldGroup g0 = fast ? lora_fold_group(t, t.fold[e0], n) : LoraFoldGroup{};
  const LoraFoldGroup g1 = fast && second ? lora_fold_group(t, t.fold[e0], n + 16) : g0;
  if (!fast || g0.a != g1.a) {  // g0.a != g1.a: another segment
    BF_LORA_FOLD(0, 4, 6, t, m, n);
    if (second) BF_LORA_FOLD(1, 4, 7, t, m, n + 16);
    if (two_rows) BF_LORA_FOLD(2, 5, 6, t, m + 16, n);
    if (two_rows && second) BF_LORA_FOLD(3, 5, 7, t, m + 16, n + 16);
    return;
  }
  const bf16* a1 = two_rows ? lora_fold_group(t, t.fold[e1], n).a : nullptr;
  const int64_t ld = t.lda * 2;
  for (int64_t st = 0; st < g0.steps; ++st) {
    BF_TILE_LOADD(6, g0.b + st * 512, 64);
    if (second) BF_TILE_LOADD(7, g1.b + st * 512, 64);
    for (int64_t half = 0; half < 2; ++half) {  // [s_hi | s_hi], then [s_lo | s_lo]
      const int64_t off = half * t.seg_ld + st * 32;
      BF_TILE_LOADD(4, g0.a + off, ld);
      BF_TILE_DPBF16PS(0, 4, 6);
      if (second) BF_TILE_DPBF16PS(1, 4, 7);
      if (two_rows) {
        BF_TILE_LOADD(5, a1 + off, ld);
        BF_TILE_DPBF16PS(2, 5, 6);
        if (second) BF_TILE_DPBF16PS(3, 5, 7);
      }
    }
  }
}

// The item's A rows [r0, r0 + rows) in tile order (AmxBlocking::stage): pair p's tile step s is 32 rows of 64 bytes
// at ((p * steps + s) * 32) * 64, its second tile 1 KB on. In a buffer of this thread's, kept between calls.
template <typename Gemm>
static const uint8_t* stage_a(const Gemm& g, int64_t r0, int64_t rows, int64_t steps) {
  struct Buffer {
    uint8_t* p = nullptr;
    size_t bytes = 0;
    ~Buffer() { std::free(p); }
  };
  static thread_local Buffer buf;
  const size_t need = size_t((rows + kAmxPairRows - 1) / kAmxPairRows * steps) * kAmxPairRows * 64;
  if (need > buf.bytes) {
    std::free(buf.p);
    buf.p = static_cast<uint8_t*>(std::aligned_alloc(64, need));
    buf.bytes = buf.p != nullptr ? need : 0;
    if (buf.p == nullptr) return nullptr;  // the caller loads from the rows instead
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(g.a_tile(r0 + r, 0));
    uint8_t* dst = buf.p + ((r / kAmxPairRows) * steps * kAmxPairRows + r % kAmxPairRows) * 64;
    for (int64_t s = 0; s < steps; ++s) std::memcpy(dst + s * kAmxPairRows * 64, src + s * 64, 64);
  }
  return buf.p;
}

}  // namespace amx_blocked_detail

// A bf16 GEMM's operands as amx_blocked_item reads them: x (M, K) rows ldx apart, K a multiple of kAmxK; a unit is
// one panel of pack_linear's bf16 layout, whose 16 k pairs x 16 columns are already AMX's B tile (16 rows of 64
// bytes, kPanel * 4 bytes apart). The including kernel adds its store.
struct AmxBf16Operands {
  using Acc = float;
  const bf16* x;
  int64_t ldx;
  const bf16* packed;
  int64_t K;

  BF_INLINE int64_t steps() const { return K / kAmxK; }
  BF_INLINE int groups(int64_t) const { return kPanel / 16; }
  BF_INLINE const bf16* a_tile(int64_t m, int64_t s) const { return x + m * ldx + s * kAmxK; }
  BF_INLINE bool fold_terms() const { return false; }
  BF_INLINE void fold(int64_t, int64_t, int, bool, bool) const {}
  BF_INLINE bool pair_terms() const { return false; }
  BF_INLINE void terms(int64_t, int64_t, int, bool, bool) const {}
  BF_INLINE int64_t a_ld() const { return ldx * 2; }
  BF_INLINE const bf16* b_tile(int64_t u, int j, int64_t s) const {
    return packed + u * K * kPanel + s * (kAmxK * kPanel) + 32 * j;
  }
  BF_INLINE int64_t b_ld() const { return kPanel * 4; }
  BF_TARGET_TILES_BF16 BF_INLINE void dp0() const { BF_TILE_DPBF16PS(0, 4, 6); }
  BF_TARGET_TILES_BF16 BF_INLINE void dp1() const { BF_TILE_DPBF16PS(1, 4, 7); }
  BF_TARGET_TILES_BF16 BF_INLINE void dp2() const { BF_TILE_DPBF16PS(2, 5, 6); }
  BF_TARGET_TILES_BF16 BF_INLINE void dp3() const { BF_TILE_DPBF16PS(3, 5, 7); }
};

// Output rows [r0, r0 + rows) (rows <= kAmxMaxItemRows) x units [u0, u1): for each unit, K block by K block, every
// 32-row pair of the rows against the block's weights (in L1 after the first pair), its C tiles resumed from and
// saved to `c`; after the last K block the epilogue per 16-row block.
template <typename Gemm>
BF_AMX_BLOCKED_TARGET BF_INLINE void amx_blocked_item(const Gemm& g, int64_t r0, int64_t rows, int64_t u0,
                                                      int64_t u1) {
  using Acc = typename Gemm::Acc;
  constexpr int64_t ldc = 48 * sizeof(Acc);  // bytes between the scratch's rows
  alignas(64) Acc c[kAmxMaxItemRows * 48];
  const AmxBlocking blocking = amx_blocking();
  const int64_t steps = g.steps(), block_steps = blocking.steps;
  const int64_t blocks = (steps + block_steps - 1) / block_steps;
  const int64_t pairs = (rows + kAmxPairRows - 1) / kAmxPairRows;
  const uint8_t* staged = blocking.stage ? amx_blocked_detail::stage_a(g, r0, rows, steps) : nullptr;
  // A tiles: a pair's step s at a0 + s * a_step, its second tile a1 on, rows a_ld apart.
  const int64_t a_step = staged ? kAmxPairRows * 64 : 64, a_ld = staged ? 64 : g.a_ld();
  const int64_t a1 = staged ? 16 * 64 : 16 * g.a_ld();
  int configured = -1;
  for (int64_t u = u0; u < u1; ++u) {
    const int groups = g.groups(u);
    for (int64_t kb = 0; kb < blocks; ++kb) {
      const int64_t s0 = kb * block_steps, s1 = std::min(steps, s0 + block_steps);
      // The next sub-panel: this unit's next K block, or the next unit's first; none after the run's last.
      const bool last = kb + 1 == blocks;
      const int64_t nu = last ? u + 1 : u, ns0 = last ? 0 : s1;
      const int64_t next_groups = nu < u1 ? g.groups(nu) : 0;
      amx_blocked_detail::NextBlock<Gemm> next{g, nu, ns0, next_groups,
                                               next_groups * 16 * (std::min(steps, ns0 + block_steps) - ns0),
                                               pairs * ((groups + 1) / 2) * (s1 - s0)};
      for (int64_t i = 0; i < rows; i += kAmxPairRows) {
        const int ra = int(std::min<int64_t>(16, rows - i)), rb = int(std::clamp<int64_t>(rows - i - 16, 0, 16));
        amx_blocked_detail::configure_pair(ra, rb, &configured);
        const int64_t m = r0 + i;
        const uint8_t* a0 = staged ? staged + (i / kAmxPairRows) * steps * a_step
                                   : reinterpret_cast<const uint8_t*>(g.a_tile(m, 0));
        for (int j = 0; j < groups; j += 2) {
          const bool two_cols = j + 1 < groups, two_rows = rb > 0;
          Acc* c0 = c + i * 48 + 16 * j;  // row block 0, group j; the other tiles 16 columns and 16 rows on
          if (kb == 0) {
            BF_TILE_ZERO(0);
            BF_TILE_ZERO(1);
            BF_TILE_ZERO(2);
            BF_TILE_ZERO(3);
          } else {
            BF_TILE_LOADD(0, c0, ldc);
            if (two_cols) BF_TILE_LOADD(1, c0 + 16, ldc);
            if (two_rows) BF_TILE_LOADD(2, c0 + 16 * 48, ldc);
            if (two_rows && two_cols) BF_TILE_LOADD(3, c0 + 16 * 48 + 16, ldc);
          }
          // Each load just before its first reader: a load into a register the previous step's multiply-adds
          // still read may wait for them, and this way it waits for one or two of them, not all four.
          for (int64_t s = s0; s < s1; ++s) {
            next.step();
            const uint8_t* a = a0 + s * a_step;
            BF_TILE_LOADD(4, a, a_ld);
            BF_TILE_LOADD(6, g.b_tile(u, j, s), g.b_ld());
            g.dp0();
            if (two_cols) {
              BF_TILE_LOADD(7, g.b_tile(u, j + 1, s), g.b_ld());
              g.dp1();
            }
            if (two_rows) {
              BF_TILE_LOADD(5, a + a1, a_ld);
              g.dp2();
              if (two_cols) g.dp3();
            }
          }
          if (last && g.fold_terms()) g.fold(m, u, j, two_rows, two_cols);
          BF_TILE_STORED(0, c0, ldc);
          if (two_cols) BF_TILE_STORED(1, c0 + 16, ldc);
          if (two_rows) BF_TILE_STORED(2, c0 + 16 * 48, ldc);
          if (two_rows && two_cols) BF_TILE_STORED(3, c0 + 16 * 48 + 16, ldc);
          // The tile intrinsics are asm without a memory clobber: tell the compiler `c` changed before the
          // epilogue reads it.
          asm volatile("" ::: "memory");
          if (last && g.pair_terms()) g.terms(m, u, j, two_rows, two_cols);
        }
      }
    }
    for (int64_t i = 0; i < rows; i += 16) {
      const int mr = int(std::min<int64_t>(16, rows - i));
      g.store(c + i * 48, mr, r0 + i, u, groups);
    }
  }
  if (configured != -1) BF_TILE_RELEASE();
}

}  // namespace cpu
}  // namespace bertfast
#endif
