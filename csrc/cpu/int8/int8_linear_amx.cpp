// The int8 GEMM on AMX-INT8 tiles (tdpbssd): the Amx tier with K a multiple of 64, any M; a streaming kernel and a
// blocked one, with the same exact int32 sums and epilogue, chosen by M (amx_gemm.h). Compiled a second time, the
// tiles emulated, with -DBF_AMX_EMULATED=1 (setup.py; the amx_emulated tier: amx_tiles.h).
#include <omp.h>

#include <algorithm>

#include "cpu/common/amx_tiles.h"
#include "cpu/int8/int8_linear_impl.h"

#define BF_AMX_BLOCKED_TARGET BF_TARGET_TILES_INT8
#include "cpu/gemm/amx_blocked.h"

namespace bertfast {
namespace cpu {
namespace int8_detail {

#if BF_X86
// ---- AMX-int8: tdpbssd on signed codes (no flip: the epilogue subtracts zp * colsum) ----
// B tiles come straight from the packed layout: 16 groups of 4 along K for 16 columns are 16 rows of 64
// bytes, contiguous. Used when K is a multiple of 64 (one A tile row per 64 codes).
namespace {

// A stored C block's sums, rows of 48 int32.
struct StoredSums {
  const int32_t* c;
  BF_TARGET_VNNI BF_INLINE __m512i operator()(int r, int j) const { return _mm512_loadu_si512(c + r * 48 + 16 * j); }
};
// The streaming kernel's epilogue of one stored C block: rows [m0, m0 + mr), columns [n0, n0 + 16 * np) (signed
// codes), with the rows' LoRA terms from the tiles (lora_expand_amx) where the factors hold B in tile form; the tiles
// configured as amx_load_tile_config(mr).
BF_TARGET_VNNI void amx_store(const int32_t* c, int mr, int np, int64_t m0, int64_t n0, const Int8Args& a) {
  if (!lora_on_tiles(a.lora)) return finish_rows<16>(a, mr, m0, n0, np, 0, StoredSums{c});
  alignas(64) float terms[16][64];
  const float* term[16] = {};
  BF_TILES(lora_expand_amx)(*a.lora, m0, mr, n0, std::min<int64_t>(16 * np, a.N - n0), terms, term);
  const LoraBlock block{m0, term};
  Int8Args with = a;
  with.terms = &block;
  finish_rows<16>(with, mr, m0, n0, np, 0, StoredSums{c});
}

}  // namespace

// One K step of panels_amx, its A tile in register A (a literal: the tile intrinsics take register numbers).
#define BF_AMX_INT8_STEP(A)                              \
  do {                                                   \
    BF_TILE_LOADD(A, xa + k0, a.ldx);                    \
    BF_TILE_LOADD(4, b, 64);                             \
    BF_TILE_DPBSSD(0, A, 4);                             \
    if (np > 1) {                                        \
      BF_TILE_LOADD(5, b + panel_bytes, 64);             \
      BF_TILE_DPBSSD(1, A, 5);                           \
    }                                                    \
    if (np > 2) {                                        \
      BF_TILE_LOADD(6, b + 2 * panel_bytes, 64);         \
      BF_TILE_DPBSSD(2, A, 6);                           \
    }                                                    \
  } while (0)

BF_TARGET_TILES_INT8 void BF_TILES(panels_amx)(const Int8Args& a, int64_t p0, int64_t p1) {
  DenormalGuard ftz;
  const int64_t k4 = a.K / 4;
  alignas(64) int32_t c[16 * 48];
  int configured = -1;
  for (int64_t p = p0; p < p1; p += 3) {
    const int np = int(std::min<int64_t>(3, p1 - p));
    for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
      const int mr = int(std::min<int64_t>(16, a.M - m0));
      amx_begin_block(mr, &configured);
      const int8_t* xa = a.x + m0 * a.ldx;
      for (int64_t k0 = 0; k0 < a.K; k0 += 64) {
        const int8_t* b = a.packed + (p * k4 + k0 / 4) * 64;  // panel p, groups k0/4 .. k0/4 + 15
        const int64_t panel_bytes = k4 * 64;
        if (m0 == 0) {  // first sweep streams the weights: fetch the next step's ahead
          for (int j = 0; j < np; ++j)
            for (int l = 0; l < 1024; l += 64) _mm_prefetch(reinterpret_cast<const char*>(b + j * panel_bytes + 2048 + l), _MM_HINT_T0);
        }
        // A in tmm3 and tmm7 by turns: the next step's A load need not wait for this step's multiply-adds.
        if ((k0 / 64) % 2 == 0) {
          BF_AMX_INT8_STEP(3);
        } else {
          BF_AMX_INT8_STEP(7);
        }
      }
      BF_TILE_STORED(0, c, 48 * 4);
      if (np > 1) BF_TILE_STORED(1, c + 16, 48 * 4);
      if (np > 2) BF_TILE_STORED(2, c + 32, 48 * 4);
      amx_store(c, mr, np, m0, p * 16, a);
    }
  }
  if (configured >= 0) BF_TILE_RELEASE();
}

// ---- AMX-int8, blocked (amx_blocked.h): a unit is three panels of 16 columns, steps of 64 codes ----
namespace {

struct Int8Tiles {
  using Acc = int32_t;
  const Int8Args& a;
  int64_t panels;

  BF_INLINE int64_t steps() const { return a.K / 64; }
  BF_INLINE int groups(int64_t u) const { return int(std::min<int64_t>(3, panels - 3 * u)); }
  BF_INLINE const int8_t* a_tile(int64_t m, int64_t s) const { return a.x + m * a.ldx + s * 64; }
  BF_INLINE int64_t a_ld() const { return a.ldx; }
  BF_INLINE const int8_t* b_tile(int64_t u, int j, int64_t s) const {
    return a.packed + ((3 * u + j) * (a.K / 4) + s * 16) * 64;
  }
  BF_INLINE int64_t b_ld() const { return 64; }
  BF_TARGET_TILES_INT8 BF_INLINE void dp0() const { BF_TILE_DPBSSD(0, 4, 6); }
  BF_TARGET_TILES_INT8 BF_INLINE void dp1() const { BF_TILE_DPBSSD(1, 4, 7); }
  BF_TARGET_TILES_INT8 BF_INLINE void dp2() const { BF_TILE_DPBSSD(2, 5, 6); }
  BF_TARGET_TILES_INT8 BF_INLINE void dp3() const { BF_TILE_DPBSSD(3, 5, 7); }
  BF_INLINE bool fold_terms() const { return false; }  // int32 sums: the terms join in the epilogue
  BF_INLINE void fold(int64_t, int64_t, int, bool, bool) const {}
  BF_INLINE bool pair_terms() const { return lora_on_tiles(a.lora); }
  // This thread's LoRA terms of an item's rows (row m's at m mod kAmxMaxItemRows: an item's rows are consecutive),
  // 48 columns of a unit each.
  static float* term_rows() {
    alignas(64) static thread_local float rows[kAmxMaxItemRows * 48];
    return rows;
  }
  // The LoRA terms of row blocks m, m + 16 at groups j, j + 1 of unit u on the tiles, their sums saved: C tiles 0-3
  // from zero (amx_blocked_detail::fold_pair), as lora_expand_amx computes them (each row's own products in the same
  // order, the other factors' zero), into term_rows.
  BF_TARGET_TILES_INT8 BF_INLINE void terms(int64_t m, int64_t u, int j, bool two_rows, bool two_cols) const {
    const int64_t n = u * 48 + 16 * j;
    BF_TILE_ZERO(0);
    BF_TILE_ZERO(1);
    BF_TILE_ZERO(2);
    BF_TILE_ZERO(3);
    amx_blocked_detail::fold_pair(*a.lora, m, n, two_rows, two_cols);
    float* t = term_rows() + (m % kAmxMaxItemRows) * 48 + 16 * j;
    BF_TILE_STORED(0, t, 48 * 4);
    if (two_cols) BF_TILE_STORED(1, t + 16, 48 * 4);
    if (two_rows) BF_TILE_STORED(2, t + 16 * 48, 48 * 4);
    if (two_rows && two_cols) BF_TILE_STORED(3, t + 16 * 48 + 16, 48 * 4);
    asm volatile("" ::: "memory");  // the tile stores are asm without a memory clobber
  }
  BF_TARGET_TILES_INT8 BF_INLINE void store(const int32_t* c, int mr, int64_t m0, int64_t u, int np) const {
    if (!pair_terms()) return finish_rows<16>(a, mr, m0, 3 * u * 16, np, 0, StoredSums{c});
    const float* term[16] = {};
    for (int r = 0; r < mr; ++r)
      if (a.lora->index[m0 + r] >= 0) term[r] = term_rows() + ((m0 + r) % kAmxMaxItemRows) * 48;
    const LoraBlock block{m0, term};
    Int8Args with = a;
    with.terms = &block;
    finish_rows<16>(with, mr, m0, 3 * u * 16, np, 0, StoredSums{c});
  }
};

}  // namespace

BF_TARGET_TILES_INT8 void BF_TILES(panels_amx_blocked)(const Int8Args& a, int64_t r0, int64_t rows, int64_t u0,
                                                        int64_t u1) {
  DenormalGuard ftz;
  amx_blocked_item(Int8Tiles{a, (a.N + 15) / 16}, r0, rows, u0, u1);
}
#endif

}  // namespace int8_detail
}  // namespace cpu
}  // namespace bertfast
