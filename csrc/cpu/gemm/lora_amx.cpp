// The LoRA shrink (lora.cpp) and expand (the GEMM epilogues' terms, lora.h) on AMX tiles, for a bf16 or int8 engine's
// factors packed in tile form (bertfast/backends/cpu/lora.py), each operand as two bf16 halves, hi = bf16(v) and lo =
// bf16(v - hi): 16 significant bits, ~2^-16 relative, where the fp32 fma chains round at 2^-24 (the engines this
// serves round their GEMMs' operands to bf16, 2^-8, or int8).
// - Shrink: s = x A^T for up to 16 rows on one factor, A^T's 16-rank groups as B tiles; per 32-value K step, into
//   one fp32 C tile per rank group, x_hi A_hi + x_lo A_hi + x_hi A_lo (x_lo A_lo, under 2^-16 of a value, is left
//   out; bf16 x is its own hi, read in place where K is a multiple of 32); a lone rank group takes three C tiles by
//   turns, summed at the end.
// - Expand (the int8 streaming kernel's epilogue; the other AMX kernels take the same products with BF_LORA_FOLD):
//   a 16-row block's terms at a 48-column panel, per factor among its rows and 16-column group: A tiles
//   [s_hi | s_hi] and [s_lo | s_lo] over the group's segment's ranks times the B tile [B_hi; B_lo], (s_hi + s_lo)
//   (B_hi + B_lo) in one fp32 C tile.
//
// Batch invariance: a tile row's sums read that row of x (of s) alone, so a row's values do not depend on the block
// it is in. Compiled a second time, the tiles emulated, with -DBF_AMX_EMULATED=1 (setup.py; amx_tiles.h).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu/common/amx_tiles.h"
#include "cpu/common/kernels.h"
#include "cpu/gemm/lora.h"

namespace bertfast {
namespace cpu {
namespace lora_detail {

#if BF_X86
namespace {

// Rows [0, rows) of x as bf16 tile rows of `steps` x 32 values (zero past K), `ld` values apart: hi = bf16(x) and,
// for fp32 x, lo = bf16(x - hi).
BF_TARGET_TILES_BF16 void split_rows(const float* x, int64_t ldx, int64_t K, int rows, int64_t ld, uint16_t* hi,
                                     uint16_t* lo) {
  for (int r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < ld; k += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(tail_mask(K - k), x + r * ldx + k);
      const __m256i h = BF_CVTNEPS_BF16(v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + r * ld + k), h);
      const __m512 rest = _mm512_sub_ps(v, widen_bf16(h));  // exact: v minus its leading 8 bits
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + r * ld + k), BF_CVTNEPS_BF16(rest));
    }
  }
}

BF_TARGET_TILES_BF16 void split_rows(const bf16* x, int64_t ldx, int64_t K, int rows, int64_t ld, uint16_t* hi,
                                     uint16_t*) {
  for (int r = 0; r < rows; ++r)
    for (int64_t k = 0; k < ld; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + r * ld + k),
                          _mm256_maskz_loadu_epi16(tail_mask(K - k), x + r * ldx + k));
}

// Tile steps of x split at a time (lora_shrink_amx).
constexpr int64_t kShrinkChunkSteps = 8;

}  // namespace

// One K step of rank group J (its C tile in register C): A_hi into tmm4, A_lo into tmm5; x_hi in tmm3, x_lo in tmm7.
#define BF_LORA_SHRINK_GROUP(C, J)                                 \
  do {                                                             \
    if ((J) < groups) {                                            \
      const bf16* b = tiles + ((g0 + (J)) * steps + st) * 1024;    \
      BF_TILE_LOADD(4, b, 64);                                     \
      BF_TILE_DPBF16PS(C, 3, 4);                                   \
      if (split) BF_TILE_DPBF16PS(C, 7, 4);                        \
      BF_TILE_LOADD(5, b + 512, 64);                               \
      BF_TILE_DPBF16PS(C, 3, 5);                                   \
    }                                                              \
  } while (0)

// One K step of a lone rank group into C tile C, B_hi into tile H and B_lo into tile L (three C tiles and the three
// B tiles by turns: no multiply-add waits for the one before it, nor a load for a reader of its tile).
#define BF_LORA_SHRINK_TURN(C, H, L)               \
  do {                                             \
    const bf16* b = tiles + st * 1024;             \
    BF_TILE_LOADD(3, a_hi + (st - a0) * 32, ld);   \
    BF_TILE_LOADD(H, b, 64);                       \
    BF_TILE_DPBF16PS(C, 3, H);                     \
    if (split) {                                   \
      BF_TILE_LOADD(7, a_lo + (st - a0) * 32, ld); \
      BF_TILE_DPBF16PS(C, 7, H);                   \
    }                                              \
    BF_TILE_LOADD(L, b + 512, 64);                 \
    BF_TILE_DPBF16PS(C, 3, L);                     \
  } while (0)

template <typename T>
BF_TARGET_TILES_BF16 void BF_TILES(lora_shrink_amx)(const T* x, int64_t ldx, int64_t K, const bf16* tiles, int64_t R,
                                                     float* s, int64_t lds, int rows) {
  DenormalGuard ftz;
  constexpr bool split = sizeof(T) == 4;
  const int64_t steps = (K + 31) / 32;
  // bf16 rows with K a multiple of 32 are already A tile rows; others are split a chunk of steps at a time, into
  // rows that stay in L1 (hi and lo of 16 rows: 16 KB) until the chunk's steps have read them.
  const bool direct = !split && K % 32 == 0;
  const int64_t chunk = direct ? steps : kShrinkChunkSteps;
  alignas(64) static thread_local uint16_t hi[16 * kShrinkChunkSteps * 32], lo[16 * kShrinkChunkSteps * 32];
  const int64_t ld = direct ? ldx * 2 : chunk * 64;  // bytes between A tile rows
  const uint16_t *a_hi = direct ? reinterpret_cast<const uint16_t*>(x) : hi, *a_lo = lo;
  int64_t a0 = 0;  // step st's A tile rows at a_hi (a_lo) + (st - a0) * 32
  // Steps [c0, c1) of x's rows as A tile rows.
  const auto stage = [&](int64_t c0, int64_t c1) {
    if (direct) return;
    a0 = c0;
    split_rows(x + c0 * 32, ldx, std::min(K, c1 * 32) - c0 * 32, rows, chunk * 32, hi, lo);
  };
  amx_load_tile_config(rows);
  if (R == 16) {  // one rank group: three C tiles by turns over the steps, summed ((c0 + c1) + c2) at the end
    BF_TILE_ZERO(0);
    BF_TILE_ZERO(1);
    BF_TILE_ZERO(2);
    for (int64_t c0 = 0; c0 < steps; c0 += chunk) {
      const int64_t c1 = std::min(steps, c0 + chunk);
      stage(c0, c1);
      for (int64_t st = c0; st < c1; ++st) {
        switch (st % 3) {
          case 0: BF_LORA_SHRINK_TURN(0, 4, 5); break;
          case 1: BF_LORA_SHRINK_TURN(1, 6, 4); break;
          default: BF_LORA_SHRINK_TURN(2, 5, 6); break;
        }
      }
    }
    alignas(64) float c[3][16 * 16];
    BF_TILE_STORED(0, c[0], 64);
    BF_TILE_STORED(1, c[1], 64);
    BF_TILE_STORED(2, c[2], 64);
    asm volatile("" ::: "memory");  // the tile stores are asm without a memory clobber
    for (int r = 0; r < rows; ++r)
      _mm512_storeu_ps(s + r * lds, _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(c[0] + 16 * r),
                                                                _mm512_load_ps(c[1] + 16 * r)),
                                                  _mm512_load_ps(c[2] + 16 * r)));
    BF_TILE_RELEASE();
    return;
  }
  for (int64_t g0 = 0; g0 < R / 16; g0 += 3) {  // past three rank groups each chunk is split again
    const int64_t groups = std::min<int64_t>(3, R / 16 - g0);
    BF_TILE_ZERO(0);
    BF_TILE_ZERO(1);
    BF_TILE_ZERO(2);
    for (int64_t c0 = 0; c0 < steps; c0 += chunk) {
      const int64_t c1 = std::min(steps, c0 + chunk);
      stage(c0, c1);
      for (int64_t st = c0; st < c1; ++st) {
        BF_TILE_LOADD(3, a_hi + (st - a0) * 32, ld);
        if (split) BF_TILE_LOADD(7, a_lo + (st - a0) * 32, ld);
        BF_LORA_SHRINK_GROUP(0, 0);
        BF_LORA_SHRINK_GROUP(1, 1);
        BF_LORA_SHRINK_GROUP(2, 2);
      }
    }
    BF_TILE_STORED(0, s + 16 * g0, lds * 4);
    if (groups > 1) BF_TILE_STORED(1, s + 16 * (g0 + 1), lds * 4);
    if (groups > 2) BF_TILE_STORED(2, s + 16 * (g0 + 2), lds * 4);
    asm volatile("" ::: "memory");  // the tile stores are asm without a memory clobber
  }
  BF_TILE_RELEASE();
}

template BF_TARGET_TILES_BF16 void BF_TILES(lora_shrink_amx)<float>(const float*, int64_t, int64_t, const bf16*,
                                                                     int64_t, float*, int64_t, int);
template BF_TARGET_TILES_BF16 void BF_TILES(lora_shrink_amx)<bf16>(const bf16*, int64_t, int64_t, const bf16*,
                                                                    int64_t, float*, int64_t, int);

#endif

}  // namespace lora_detail

#if BF_X86
namespace {

// A 16-column group of the panel: its segment's B tiles (null: the segment has no ranks, its terms are zero) and A
// tiles (LoraTerm::sa), `steps` steps; reload: its A tiles are not the previous group's.
struct ExpandGroup {
  const bf16* b;
  const bf16 *a1, *a2;
  int64_t steps;
  bool reload;
};

}  // namespace

// Group J of the panel in C tile C and B tile B, its A tiles in tmm3 and tmm7, into c's columns 16 J on.
#define BF_LORA_EXPAND_GROUP(C, B, J)                                          \
  do {                                                                         \
    BF_TILE_ZERO(C);                                                           \
    for (int64_t st = 0; st < g[J].steps; ++st) {                              \
      if (g[J].reload || g[J].steps > 1) {                                     \
        BF_TILE_LOADD(3, g[J].a1 + st * 32, ld * 2);                           \
        BF_TILE_LOADD(7, g[J].a2 + st * 32, ld * 2);                           \
      }                                                                        \
      BF_TILE_LOADD(B, g[J].b + st * 512, 64);                                 \
      BF_TILE_DPBF16PS(C, 3, B);                                               \
      BF_TILE_DPBF16PS(C, 7, B);                                               \
    }                                                                          \
    BF_TILE_STORED(C, c + 16 * (J), 48 * 4);                                   \
  } while (0)

BF_TARGET_TILES_BF16 void BF_TILES(lora_expand_amx)(const LoraTerm& t, int64_t m0, int mr, int64_t n, int64_t cols,
                                                     float (*out)[64], const float** term) {
  if (t.sa == nullptr) std::abort();  // the GEMMs' dispatch writes the A tile rows first (lora_tile_rows)
  alignas(64) float c[16 * 48];
  const int groups = int((cols + 15) / 16);
  const int64_t ld = t.lda;  // values between the A tiles' rows
  int32_t seen[16];
  int nseen = 0;
  for (int i0 = 0; i0 < mr; ++i0) {
    const int32_t f = t.index[m0 + i0];
    if (f < 0 || std::find(seen, seen + nseen, f) != seen + nseen) continue;
    seen[nseen++] = f;
    ExpandGroup g[3];
    const bf16* prev = nullptr;
    for (int j = 0; j < groups; ++j) {  // each group's run of the slot's outputs (segment) and its tiles
      const LoraFoldGroup fg = lora_fold_group(t, LoraFold{f, t.sa + m0 * t.lda}, n + 16 * j);
      g[j] = {fg.steps > 0 ? fg.b : nullptr, fg.a, fg.a + t.seg_ld, fg.steps, fg.a != prev};
      prev = fg.a;
      if (g[j].b == nullptr)
        for (int i = 0; i < mr; ++i) std::memset(c + i * 48 + 16 * j, 0, 64);
    }
    if (g[0].b != nullptr) BF_LORA_EXPAND_GROUP(0, 4, 0);
    if (groups > 1 && g[1].b != nullptr) BF_LORA_EXPAND_GROUP(1, 5, 1);
    if (groups > 2 && g[2].b != nullptr) BF_LORA_EXPAND_GROUP(2, 6, 2);
    asm volatile("" ::: "memory");  // the tile stores are asm without a memory clobber
    for (int i = 0; i < mr; ++i) {
      if (t.index[m0 + i] != f) continue;
      std::memcpy(out[i], c + i * 48, groups * 64);
      term[i] = out[i];
    }
  }
}
#endif

}  // namespace cpu
}  // namespace bertfast
