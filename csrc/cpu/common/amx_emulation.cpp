// The amx_emulated tier's tiles: the AMX instructions the kernels use (amx_tiles.h), carried out on a per-thread
// copy of the tile state (palette 1: eight tiles of up to 16 rows x 64 bytes) as the Intel SDM's pseudo-code
// defines them, shapes and faults included.
//
// Where its bits may differ from the hardware's (docs/tiers.md#amx_emulated): the integer products (TDPBSSD)
// are exact in int32 (wrapping) as on the hardware, so int8 GEMMs match bit for bit. TDPBF16PS follows the
// SDM's current pseudo-code: per row, the even and the odd bf16 products each accumulated over k in its own fp32
// chain (one RNE rounding per FMA, from zero), the two chains added, then added to C; inputs DAZ, outputs FTZ,
// MXCSR neither consulted nor updated. Older texts (the Intrinsics Guide) describe a sequential order into C
// instead, and whether a given CPU rounds exactly as the pseudo-code says is not documented: bf16 outputs of the
// amx tier are checked on AMX hardware against tolerances, not against this emulation's bits. NaN payloads
// (which NaN wins) are not modelled.
#include <cstdio>
#include <cstdlib>

#include "cpu/common/amx_tiles.h"

#if BF_X86
namespace bertfast {
namespace cpu {
namespace amx_emulation {
namespace {

constexpr int kTiles = 8, kMaxRows = 16, kRowBytes = 64;

struct TileState {
  bool configured = false;
  AmxTileConfig cfg{};
  alignas(64) uint8_t data[kTiles][kMaxRows][kRowBytes]{};
};
thread_local TileState state;

[[noreturn]] void fault(const char* insn, const char* why, int tile) {
  std::fprintf(stderr, "bertfast amx_emulated: %s on tmm%d: %s (the hardware faults here)\n", insn, tile, why);
  std::abort();
}

// A configured tile's shape, or a fault (#UD: tiles not configured; a tile the configuration leaves empty,
// which the kernels never use, is refused too).
struct Shape {
  int rows, colsb;
};
Shape shape(const char* insn, int t) {
  if (t < 0 || t >= kTiles) fault(insn, "no such tile", t);
  if (!state.configured) fault(insn, "tiles not configured (LDTILECFG)", t);
  const Shape s{state.cfg.rows[t], state.cfg.colsb[t]};
  if (s.rows == 0 || s.colsb == 0) fault(insn, "tile not configured", t);
  return s;
}

// The TMUL instructions' shape rules (#UD otherwise): C is M x N dwords, A M x K dwords, B K x N dwords.
void check_tmul(const char* insn, int c, int a, int b, Shape& sc, Shape& sa, Shape& sb) {
  if (c == a || c == b || a == b) fault(insn, "operands must be three different tiles", c);
  sc = shape(insn, c), sa = shape(insn, a), sb = shape(insn, b);
  if (sc.colsb % 4 || sa.colsb % 4 || sb.colsb % 4) fault(insn, "colsb not a multiple of 4", c);
  if (sa.colsb / 4 != sb.rows) fault(insn, "A's colsb / 4 differs from B's rows", a);
  if (sc.colsb != sb.colsb) fault(insn, "C's colsb differs from B's", c);
  if (sc.rows != sa.rows) fault(insn, "C's rows differ from A's", c);
}

// write_row_and_zero / zero_upper_rows: bytes past colsb and rows past `rows` read as zero after a write.
void zero_outside(int t, Shape s) {
  for (int r = 0; r < kMaxRows; ++r)
    std::memset(state.data[t][r] + (r < s.rows ? s.colsb : 0), 0, kRowBytes - (r < s.rows ? s.colsb : 0));
}

// RNE, FTZ and DAZ, exceptions masked, for the scope; the caller's MXCSR (flags included) restored after.
struct TmulMxcsr {
  unsigned int saved;
  TmulMxcsr() : saved(_mm_getcsr()) { _mm_setcsr(0x1f80u | 0x8040u); }
  ~TmulMxcsr() { _mm_setcsr(saved); }
};

// make_fp32 of the even (low) and the odd (high) bf16 of each 32-bit pair.
BF_TARGET_AVX512 BF_INLINE __m512 make_fp32_even(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}
BF_TARGET_AVX512 BF_INLINE __m512 make_fp32_odd(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int(0xffff0000u))));
}

}  // namespace

void loadconfig(const AmxTileConfig* cfg) {
  if (cfg->palette_id == 0) return release();
  if (cfg->palette_id != 1) fault("ldtilecfg", "palette not supported", 0);
  for (uint8_t b : cfg->reserved)
    if (b != 0) fault("ldtilecfg", "reserved bytes not zero", 0);
  for (int t = 0; t < 16; ++t) {
    const int rows = cfg->rows[t], colsb = cfg->colsb[t];
    if (t >= kTiles && (rows || colsb)) fault("ldtilecfg", "palette 1 has 8 tiles", t);
    if (rows > kMaxRows || colsb > kRowBytes) fault("ldtilecfg", "more than 16 rows or 64 bytes a row", t);
    if ((rows == 0) != (colsb == 0)) fault("ldtilecfg", "rows and colsb must be both zero or both set", t);
  }
  if (cfg->start_row >= kMaxRows) fault("ldtilecfg", "start_row past the rows", 0);
  state.cfg = *cfg;
  std::memset(state.data, 0, sizeof(state.data));
  state.configured = true;
}

void release() {
  std::memset(&state.cfg, 0, sizeof(state.cfg));
  std::memset(state.data, 0, sizeof(state.data));
  state.configured = false;
}

void zero(int t) {
  shape("tilezero", t);
  std::memset(state.data[t], 0, sizeof(state.data[t]));
}

void loadd(int t, const void* base, int64_t stride) {
  const Shape s = shape("tileloadd", t);
  const auto* src = static_cast<const uint8_t*>(base);
  for (int r = state.cfg.start_row; r < s.rows; ++r) std::memcpy(state.data[t][r], src + r * stride, s.colsb);
  zero_outside(t, s);
  state.cfg.start_row = 0;
}

void stored(int t, void* base, int64_t stride) {
  const Shape s = shape("tilestored", t);
  auto* dst = static_cast<uint8_t*>(base);
  for (int r = state.cfg.start_row; r < s.rows; ++r) std::memcpy(dst + r * stride, state.data[t][r], s.colsb);
  state.cfg.start_row = 0;
}

BF_TARGET_AVX512 void dpbf16ps(int c, int a, int b) {
  Shape sc, sa, sb;
  check_tmul("tdpbf16ps", c, a, b, sc, sa, sb);
  const TmulMxcsr mxcsr;
  const __mmask16 cols = __mmask16((1u << (sc.colsb / 4)) - 1u);
  for (int m = 0; m < sc.rows; ++m) {
    const uint32_t* arow = reinterpret_cast<const uint32_t*>(state.data[a][m]);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();  // temp1.fp32[2n], temp1.fp32[2n + 1]
    for (int k = 0; k < sa.colsb / 4; ++k) {
      const __m512i apair = _mm512_set1_epi32(int(arow[k]));
      const __m512i bpairs = _mm512_maskz_loadu_epi32(cols, state.data[b][k]);
      even = _mm512_fmadd_ps(make_fp32_even(apair), make_fp32_even(bpairs), even);
      odd = _mm512_fmadd_ps(make_fp32_odd(apair), make_fp32_odd(bpairs), odd);
    }
    float* crow = reinterpret_cast<float*>(state.data[c][m]);
    _mm512_mask_storeu_ps(crow, cols, _mm512_add_ps(_mm512_maskz_loadu_ps(cols, crow), _mm512_add_ps(even, odd)));
  }
  zero_outside(c, sc);
  state.cfg.start_row = 0;
}

BF_TARGET_AVX512 void dpbssd(int c, int a, int b) {
  Shape sc, sa, sb;
  check_tmul("tdpbssd", c, a, b, sc, sa, sb);
  const int n_dwords = sc.colsb / 4;
  for (int m = 0; m < sc.rows; ++m) {
    const int8_t* arow = reinterpret_cast<const int8_t*>(state.data[a][m]);
    uint32_t* crow = reinterpret_cast<uint32_t*>(state.data[c][m]);  // unsigned: int32 sums wrap, as the hardware's
    for (int k = 0; k < sa.colsb / 4; ++k) {
      const int8_t* brow = reinterpret_cast<const int8_t*>(state.data[b][k]);
      for (int n = 0; n < n_dwords; ++n) {
        int32_t dot = 0;  // four int8 x int8 products: |dot| <= 4 * 2^14, exact
        for (int j = 0; j < 4; ++j) dot += int32_t(arow[4 * k + j]) * int32_t(brow[4 * n + j]);
        crow[n] += uint32_t(dot);
      }
    }
  }
  zero_outside(c, sc);
  state.cfg.start_row = 0;
}

BF_TARGET_AVX512 void cvtneps_bf16_emulated(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1u);
    _mm256_mask_storeu_epi16(out + i, m, cvtneps_bf16(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

namespace {
BF_TARGET_AVX512BF16 void cvtneps_bf16_native(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1u);
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i)));
  }
}
}  // namespace

bool cvtneps_bf16_instruction(const float* x, int64_t n, uint16_t* out) {
  if (!__builtin_cpu_supports("avx512bf16")) return false;
  cvtneps_bf16_native(x, n, out);
  return true;
}

}  // namespace amx_emulation
}  // namespace cpu
}  // namespace bertfast
#endif
