// The LoRA shrink (lora.cpp) on AMX tiles, for a bf16 or int8 engine's factors packed with their tile form
// (bertfast/backends/cpu/lora.py): s = x A^T for up to 16 rows on one factor, A^T's 16-rank groups as B tiles of
// bf16 halves, hi = bf16(A^T) and lo = bf16(A^T - hi); fp32 x split alike (bf16 x is its own hi). Per 32-value K
// step, into one fp32 C tile per rank group: x_hi A_hi, x_lo A_hi, x_hi A_lo (x_lo A_lo, under 2^-16 of a value,
// is left out). A value carries 16 significant bits of x and A, ~2^-16 relative, where the fp32 shrink's fma chain
// rounds at 2^-24: the engines this serves round their GEMMs' operands to bf16 (2^-8) or int8.
//
// Batch invariance: a tile row's sums read that row of x alone, so a row's s does not depend on the block it is in.
// Compiled a second time, the tiles emulated, with -DBF_AMX_EMULATED=1 (setup.py; amx_tiles.h).
#include <algorithm>
#include <vector>

#include "cpu/common/amx_tiles.h"
#include "cpu/common/kernels.h"

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

template <typename T>
BF_TARGET_TILES_BF16 void BF_TILES(lora_shrink_amx)(const T* x, int64_t ldx, int64_t K, const bf16* tiles, int64_t R,
                                                     float* s, int64_t lds, int rows) {
  DenormalGuard ftz;
  constexpr bool split = sizeof(T) == 4;
  const int64_t steps = (K + 31) / 32, ld = steps * 32;
  thread_local std::vector<uint16_t> hi, lo;
  hi.resize(rows * ld);
  lo.resize(split ? rows * ld : 0);
  split_rows(x, ldx, K, rows, ld, hi.data(), lo.data());
  amx_load_tile_config(rows);
  for (int64_t g0 = 0; g0 < R / 16; g0 += 3) {
    const int64_t groups = std::min<int64_t>(3, R / 16 - g0);
    BF_TILE_ZERO(0);
    BF_TILE_ZERO(1);
    BF_TILE_ZERO(2);
    for (int64_t st = 0; st < steps; ++st) {
      BF_TILE_LOADD(3, hi.data() + st * 32, ld * 2);
      if (split) BF_TILE_LOADD(7, lo.data() + st * 32, ld * 2);
      BF_LORA_SHRINK_GROUP(0, 0);
      BF_LORA_SHRINK_GROUP(1, 1);
      BF_LORA_SHRINK_GROUP(2, 2);
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
}  // namespace cpu
}  // namespace bertfast
