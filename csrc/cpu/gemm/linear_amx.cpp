// The GEMM on AMX tiles: bf16 with K a multiple of kAmxK on the Amx tier, any M; a streaming kernel and a blocked
// one, bit-identical, chosen by M (amx_gemm.h). Compiled a second time, the tiles emulated, with
// -DBF_AMX_EMULATED=1 (setup.py; the amx_emulated tier: amx_tiles.h).
#include <omp.h>

#include <algorithm>

#include "cpu/common/amx_tiles.h"
#include "cpu/gemm/linear_impl.h"

#define BF_AMX_BLOCKED_TARGET BF_TARGET_TILES_BF16
#include "cpu/gemm/amx_blocked.h"

namespace bertfast {
namespace cpu {
namespace linear_detail {

#if BF_X86
// ---- AMX (bf16, K a multiple of 32): 16 rows x 48 columns per sweep in three tile accumulators ----
//
// At small M the GEMM is bound by streaming the weights, and AMX leaves the cores nearly idle while the
// stream runs (one TDPBF16PS does 16 x 16 x 32 multiply-adds). The packed bf16 panel is already AMX's B
// layout: 16 consecutive k pairs of 16 columns are 16 rows of 64 bytes, kPanel * 4 bytes apart. K steps of
// kAmxK (linear_impl.h).
constexpr int kAmxRows = 16;
constexpr int64_t kAmxPrefetch = 2 * 16 * kPanel * 4;  // bytes ahead in the weight stream: two steps

// store_tile of a 16-row block leaving the tiles, whose C tiles took the rows' LoRA terms already (BF_LORA_FOLD)
// where the factors hold B in tile form.
BF_TARGET_TILES_BF16 BF_INLINE void store_amx(const float* tile, int mr, int64_t m0, int64_t n0, int64_t nvalid,
                                              const Epilogue& ep) {
  if (!lora_on_tiles(ep.lora)) return store_tile<bf16, true>(tile, mr, m0, n0, nvalid, ep);
  Epilogue folded = ep;
  folded.lora = nullptr;
  store_tile<bf16, true>(tile, mr, m0, n0, nvalid, folded);
}

// The streaming kernel's fold (BF_LORA_FOLD into C tiles 0-2) where the 16-row block from m0 is on one factor and the
// panel's groups from n0 in one segment: per step the three B tiles (4-6) loaded once, then [s_hi | s_hi] (tile 3)
// and [s_lo | s_lo] (tile 7) against all three, the same multiply-adds in the same order for each C tile. False
// (nothing done) otherwise.
BF_TARGET_TILES_BF16 BF_INLINE bool fold_panel(const LoraTerm& t, int64_t m0, int64_t n0, int64_t nvalid) {
  const int64_t b = m0 / 16, e = t.block_at[b];
  if (t.block_at[b + 1] - e != 1) return t.block_at[b + 1] == e;  // no factor: nothing to add; several: the macro's
  const int groups = int((nvalid + 15) / 16);
  const LoraFoldGroup g0 = lora_fold_group(t, t.fold[e], n0);
  const LoraFoldGroup g2 = lora_fold_group(t, t.fold[e], n0 + 16 * (groups - 1));
  if (g0.a != g2.a) return false;  // the panel crosses into another segment
  const bf16* b1 = groups > 1 ? lora_fold_group(t, t.fold[e], n0 + 16).b : nullptr;
  const int64_t ld = t.lda * 2;
  for (int64_t st = 0; st < g0.steps; ++st) {
    BF_TILE_LOADD(3, g0.a + st * 32, ld);
    BF_TILE_LOADD(7, g0.a + t.seg_ld + st * 32, ld);
    BF_TILE_LOADD(4, g0.b + st * 512, 64);
    BF_TILE_DPBF16PS(0, 3, 4);
    if (groups > 1) {
      BF_TILE_LOADD(5, b1 + st * 512, 64);
      BF_TILE_DPBF16PS(1, 3, 5);
    }
    if (groups > 2) {
      BF_TILE_LOADD(6, g2.b + st * 512, 64);
      BF_TILE_DPBF16PS(2, 3, 6);
    }
    BF_TILE_DPBF16PS(0, 7, 4);
    if (groups > 1) BF_TILE_DPBF16PS(1, 7, 5);
    if (groups > 2) BF_TILE_DPBF16PS(2, 7, 6);
  }
  return true;
}

// One K step of linear_amx, its A tile in register A (a literal: the tile intrinsics take register numbers).
#define BF_AMX_STREAM_STEP(A)             \
  do {                                    \
    BF_TILE_LOADD(A, xa + k0, ldx * 2);   \
    BF_TILE_LOADD(4, b, kPanel * 4);      \
    BF_TILE_DPBF16PS(0, A, 4);            \
    BF_TILE_LOADD(5, b + 32, kPanel * 4); \
    BF_TILE_DPBF16PS(1, A, 5);            \
    BF_TILE_LOADD(6, b + 64, kPanel * 4); \
    BF_TILE_DPBF16PS(2, A, 6);            \
  } while (0)

BF_TARGET_TILES_BF16 void BF_TILES(linear_amx)(const bf16* x, int64_t ldx, const bf16* packed, int64_t M,
                                                int64_t N, int64_t K, const Epilogue& ep,
                                                MeetInTheMiddle::Walker& panels) {
  static_assert(kPanel == 48, "the AMX kernel holds a panel in three 16-column tiles");
  DenormalGuard ftz;
  const int64_t panel_bytes = K * kPanel * 2;  // K is even here
  alignas(64) float tile[kAmxRows * kPanel];
  int configured = -1;
  for (int64_t p = panels.claim(); p >= 0; p = panels.claim()) {
    const int64_t nvalid = std::min<int64_t>(kPanel, N - p * kPanel);
    const bf16* wp = packed + p * (panel_bytes / 2);
    const int64_t p_next = panels.peek();
    const char* here = reinterpret_cast<const char*>(wp);
    const char* next = p_next >= 0 ? reinterpret_cast<const char*>(packed) + p_next * panel_bytes : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
      const int mr = int(std::min<int64_t>(kAmxRows, M - m0));
      amx_begin_block(mr, &configured);
      const bf16* xa = x + m0 * ldx;
      for (int64_t k0 = 0; k0 < K; k0 += kAmxK) {
        const bf16* b = wp + (k0 / 2) * kPanel * 2;  // 16 k pairs x kPanel columns x 2
        // Two steps ahead along the thread's stream.
        const char* pf = stream_at(here, next, panel_bytes, k0 * kPanel * 2 + kAmxPrefetch);
        if (pf != nullptr)
          for (int l = 0; l < 16 * kPanel * 4; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
        // A in tmm3 and tmm7 by turns and each B load just before its reader: a load into a register that
        // multiply-adds still read may wait for them.
        if ((k0 / kAmxK) % 2 == 0) {
          BF_AMX_STREAM_STEP(3);
        } else {
          BF_AMX_STREAM_STEP(7);
        }
      }
      if (lora_on_tiles(ep.lora) && !fold_panel(*ep.lora, m0, p * kPanel, nvalid)) {
        const int64_t n0 = p * kPanel;
        BF_LORA_FOLD(0, 3, 4, *ep.lora, m0, n0);
        if (nvalid > 16) BF_LORA_FOLD(1, 3, 5, *ep.lora, m0, n0 + 16);
        if (nvalid > 32) BF_LORA_FOLD(2, 3, 6, *ep.lora, m0, n0 + 32);
      }
      BF_TILE_STORED(0, tile, kPanel * 4);
      BF_TILE_STORED(1, tile + 16, kPanel * 4);
      BF_TILE_STORED(2, tile + 32, kPanel * 4);
      store_amx(tile, mr, m0, p * kPanel, nvalid, ep);
    }
  }
  if (configured >= 0) BF_TILE_RELEASE();
}

// ---- AMX, blocked (amx_blocked.h): the same tile steps and epilogue as above, per 32-row pair ----
namespace {

// The bf16 GEMM as amx_blocked_item reads it (AmxBf16Operands), ending in the streaming kernel's epilogue call, on
// the same fp32 sums.
struct Bf16Tiles : AmxBf16Operands {
  int64_t N;
  const Epilogue& ep;

  BF_INLINE bool fold_terms() const { return lora_on_tiles(ep.lora); }
  // C tiles 0-3 += the LoRA terms of row blocks m, m + 16 at groups j, j + 1 of unit u, the groups past N (the last
  // panel's padding) left out.
  BF_TARGET_TILES_BF16 BF_INLINE void fold(int64_t m, int64_t u, int j, bool two_rows, bool two_cols) const {
    const int64_t n = u * kPanel + 16 * j;
    if (n < N) amx_blocked_detail::fold_pair(*ep.lora, m, n, two_rows, two_cols && n + 16 < N);
  }
  BF_TARGET_TILES_BF16 BF_INLINE void store(const float* c, int mr, int64_t m0, int64_t u, int) const {
    store_amx(c, mr, m0, u * kPanel, std::min<int64_t>(kPanel, N - u * kPanel), ep);
  }
};

}  // namespace

BF_TARGET_TILES_BF16 void BF_TILES(linear_amx_blocked)(const bf16* x, int64_t ldx, const bf16* packed, int64_t N,
                                                        int64_t K, const Epilogue& ep, int64_t r0, int64_t rows,
                                                        int64_t p0, int64_t p1) {
  DenormalGuard ftz;
  amx_blocked_item(Bf16Tiles{{x, ldx, packed, K}, N, ep}, r0, rows, p0, p1);
}

#endif

}  // namespace linear_detail
}  // namespace cpu
}  // namespace bertfast
