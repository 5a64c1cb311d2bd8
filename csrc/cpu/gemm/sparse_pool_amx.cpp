// SPLADE's vocabulary GEMM and pooling (sparse_pool.cpp) on AMX tiles: bf16 x and weights (pack_linear's bf16
// panels), K a multiple of kAmxK. It is the blocked AMX GEMM's loop nest (amx_blocked.h) on the bf16 GEMM's operands
// (AmxBf16Operands) with the pooling as its store: each 16-row block of logits, as it leaves the tiles, is folded
// row by row into the running value of that row's own sequence, so a tile whose rows belong to two sequences never
// mixes them. Compiled a second time, the tiles emulated, with -DBF_AMX_EMULATED=1 (setup.py; amx_tiles.h).
//
// Batch invariance: a logit is the same tile steps over K from zero whichever rows share its tile (amx_gemm.h), and
// sparse_pool.cpp hands each panel to one thread that runs its row blocks in token order, so every column of a
// sequence folds its tokens in order; a max is exact in any order, a sum is this one order.
#include <algorithm>

#include "cpu/common/amx_tiles.h"
#include "cpu/gemm/sparse_pool_impl.h"

#define BF_AMX_BLOCKED_TARGET BF_TARGET_TILES_BF16
#include "cpu/gemm/amx_blocked.h"

namespace bertfast {
namespace cpu {
namespace sparse_detail {

#if BF_X86
namespace {

struct PoolTiles : AmxBf16Operands {
  const PoolArgs& a;

  // Rows [m0, m0 + mr) of the logits of panel u (c: rows 48 floats apart) into their sequences' running values.
  BF_TARGET_TILES_BF16 BF_INLINE void store(const float* c, int mr, int64_t m0, int64_t u, int) const {
    const int64_t n0 = u * kPanel, nvalid = std::min<int64_t>(kPanel, a.V - n0);
    if (a.pooling == SparsePooling::Sum) {
      for (int r = 0; r < mr; ++r) {
        float* o = a.out + a.seq[m0 + r] * a.V + n0;
        for (int64_t j = 0; j < nvalid; ++j)
          o[j] += splade_act(c[r * kPanel + j] + (a.bias != nullptr ? a.bias[n0 + j] : 0.f), a.twice);
      }
      return;
    }
    const __mmask16 mk[3] = {tail_mask(nvalid), tail_mask(nvalid - 16), tail_mask(nvalid - 32)};
    for (int r = 0; r < mr;) {  // a run of rows of one sequence reduced in registers, then into its running max
      const int32_t s = a.seq[m0 + r];
      float* o = a.out + s * a.V + n0;
      __m512 run[3];
      for (int v = 0; v < 3; ++v) run[v] = _mm512_maskz_loadu_ps(mk[v], o + 16 * v);
      for (; r < mr && a.seq[m0 + r] == s; ++r)
        for (int v = 0; v < 3; ++v) run[v] = _mm512_max_ps(run[v], _mm512_load_ps(c + r * kPanel + 16 * v));
      for (int v = 0; v < 3; ++v) _mm512_mask_storeu_ps(o + 16 * v, mk[v], run[v]);
    }
  }
};

}  // namespace

BF_TARGET_TILES_BF16 void BF_TILES(sparse_pool_amx)(const bf16* x, int64_t ldx, const bf16* packed, int64_t K,
                                                     const PoolArgs& a, int64_t r0, int64_t rows, int64_t u0,
                                                     int64_t u1) {
  DenormalGuard ftz;
  amx_blocked_item(PoolTiles{{x, ldx, packed, K}, a}, r0, rows, u0, u1);
}
#endif

}  // namespace sparse_detail
}  // namespace cpu
}  // namespace bertfast
