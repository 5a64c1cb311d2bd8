// DeBERTa-v2's position scores (disentangled.cpp) on AMX tiles: per head, x (the head's q or k, bf16, d a multiple
// of kAmxK) times that head's position rows, packed once per call in pack_linear's bf16 layout, through the blocked
// AMX GEMM's loop nest (amx_blocked.h) on the bf16 GEMM's operands (AmxBf16Operands), its store scaling each 16-row
// block of sums into out (tokens, heads, rows). Compiled a second time, the tiles emulated, with -DBF_AMX_EMULATED=1
// (setup.py; amx_tiles.h).
//
// Batch invariance: an entry is the same tile steps over d from zero whichever tokens and columns share its tiles
// (amx_gemm.h), times scale once: the same bits alone, in any batch and for any window.
#include <algorithm>

#include "cpu/attention/disentangled_impl.h"
#include "cpu/common/amx_tiles.h"

#define BF_AMX_BLOCKED_TARGET BF_TARGET_TILES_BF16
#include "cpu/gemm/amx_blocked.h"

namespace bertfast {
namespace cpu {
namespace disentangled_detail {

#if BF_X86
namespace {

struct ScoreTiles : AmxBf16Operands {
  const ScoreOut& o;

  // Tokens [m0, m0 + mr) of panel u's columns (c: rows 48 floats apart), times scale, into out.
  BF_TARGET_TILES_BF16 BF_INLINE void store(const float* c, int mr, int64_t m0, int64_t u, int) const {
    const int64_t n0 = u * kPanel, nvalid = std::min<int64_t>(kPanel, o.rows - n0);
    const __mmask16 mk[3] = {tail_mask(nvalid), tail_mask(nvalid - 16), tail_mask(nvalid - 32)};
    const __m512 s = _mm512_set1_ps(o.scale);
    for (int r = 0; r < mr; ++r) {
      float* dst = o.out + ((m0 + r) * o.heads + o.h) * o.rows + n0;
      // The row 4 tokens on pulled in ahead of its stores: the scores go to cold lines, and the stores stalled on them
      const char* ahead = reinterpret_cast<const char*>(dst + 4 * o.heads * o.rows);
      for (int l = 0; l < 3; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
      for (int v = 0; v < 3; ++v)
        _mm512_mask_storeu_ps(dst + 16 * v, mk[v], _mm512_mul_ps(_mm512_load_ps(c + r * kPanel + 16 * v), s));
    }
  }
};

}  // namespace

BF_TARGET_TILES_BF16 void BF_TILES(position_scores_amx)(const bf16* x, int64_t ldx, const bf16* packed, int64_t d,
                                                         const ScoreOut& o, int64_t r0, int64_t n, int64_t u0,
                                                         int64_t u1) {
  DenormalGuard ftz;
  amx_blocked_item(ScoreTiles{{x, ldx, packed, d}, o}, r0, n, u0, u1);
}
#endif

}  // namespace disentangled_detail
}  // namespace cpu
}  // namespace bertfast
