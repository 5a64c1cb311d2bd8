// The tile instructions of the AMX kernels (linear_amx.cpp, int8_linear_amx.cpp, attention_amx.cpp), written once
// as BF_TILE_* macros over which each kernel file is compiled twice (setup.py): as it is, with AMX's intrinsics (the
// amx tier), and with -DBF_AMX_EMULATED=1 into objects of their own, with each instruction a call into
// amx_emulation.cpp (the amx_emulated tier). So the kernels' own tile configuration, packing, tails and epilogues
// run, and are tested, on any CPU with AVX-512 VNNI; only the tile instructions (and, emulated, the attention's
// two bf16 conversions) differ between the two.
//
// Per mode: BF_TARGET_TILES_BF16 / BF_TARGET_TILES_INT8 are the kernels' target attributes (AMX's, or the same
// AVX-512 / VNNI ones without the tiles) and BF_TILES(name) their entry points' names (name, or
// name_emulated: both are declared in the ops' *_impl.h). Tile numbers are literals: the intrinsics are asm
// templates that paste them into the instruction.
#pragma once

#include "cpu/common/simd.h"

#if BF_X86
#if defined(BF_AMX_EMULATED)
#define BF_TARGET_TILES  // the configuration helpers below call out to amx_emulation.cpp
// AVX-512 without AVX-512 BF16: the emulated tier runs on a Cascade Lake or Ice Lake too, its two fp32 -> bf16
// conversions (VCVTNE2PS2BF16, VCVTNEPS2BF16) carried out as the SDM defines them (cvtneps_bf16 below).
#define BF_TARGET_TILES_BF16 BF_TARGET_AVX512
#define BF_TARGET_TILES_INT8 BF_TARGET_VNNI
#define BF_TILES(name) name##_emulated
#define BF_TILE_LOADCONFIG(cfg) ::bertfast::cpu::amx_emulation::loadconfig(cfg)
#define BF_TILE_RELEASE() ::bertfast::cpu::amx_emulation::release()
#define BF_TILE_ZERO(t) ::bertfast::cpu::amx_emulation::zero(t)
#define BF_TILE_LOADD(t, base, stride) ::bertfast::cpu::amx_emulation::loadd(t, base, stride)
#define BF_TILE_STORED(t, base, stride) ::bertfast::cpu::amx_emulation::stored(t, base, stride)
#define BF_TILE_DPBF16PS(c, a, b) ::bertfast::cpu::amx_emulation::dpbf16ps(c, a, b)
#define BF_TILE_DPBSSD(c, a, b) ::bertfast::cpu::amx_emulation::dpbssd(c, a, b)
#else
#define BF_TARGET_TILES __attribute__((target("amx-tile")))
#define BF_TARGET_TILES_BF16 BF_TARGET_AMX
#define BF_TARGET_TILES_INT8 BF_TARGET_AMX_INT8
#define BF_TILES(name) name
// GCC 12 drops the stores of a local config before LDTILECFG (the probe faulted on a half-written one): barrier.
#define BF_TILE_LOADCONFIG(cfg)                    \
  do {                                             \
    asm volatile("" : : "r"(cfg) : "memory");     \
    _tile_loadconfig(cfg);                         \
  } while (0)
#define BF_TILE_RELEASE() _tile_release()
#define BF_TILE_ZERO(t) _tile_zero(t)
#define BF_TILE_LOADD(t, base, stride) _tile_loadd(t, base, stride)
#define BF_TILE_STORED(t, base, stride) _tile_stored(t, base, stride)
#define BF_TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define BF_TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#endif

// VCVTNEPS2BF16 per the SDM's convert_fp32_to_bfloat16: zero and denormal inputs give a zero of their sign (DAZ),
// infinities keep their top half, NaNs their top half made quiet, normal numbers round to nearest even (integer
// add of 0x7fff + bit 16); 16 fp32 lanes to 16 bf16, in AVX-512 F/BW. The amx_emulated tier's conversions
// (tests/test_amx_tiles.py compares it with the instruction where the CPU has AVX-512 BF16).
static BF_TARGET_AVX512 BF_INLINE __m256i cvtneps_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i top = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(top, _mm512_set1_epi32(1)));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __m512i exponent = _mm512_and_si512(u, _mm512_set1_epi32(0x7f800000));
  const __mmask16 tiny = _mm512_cmpeq_epi32_mask(exponent, _mm512_setzero_si512());  // zero or denormal
  const __mmask16 special = _mm512_cmpeq_epi32_mask(exponent, _mm512_set1_epi32(0x7f800000));  // inf or NaN
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, tiny, _mm512_and_si512(top, _mm512_set1_epi32(0x8000)));
  r = _mm512_mask_mov_epi32(r, special, top);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

#if defined(BF_AMX_EMULATED)
// The emulated tier runs on CPUs without AVX-512 BF16: its conversions are cvtneps_bf16.
#define BF_CVTNEPS_BF16(x) cvtneps_bf16(x)
// VCVTNE2PS2BF16: a's 16 lanes above b's.
#define BF_CVTNE2PS_BF16(a, b) _mm512_inserti64x4(_mm512_castsi256_si512(cvtneps_bf16(b)), cvtneps_bf16(a), 1)
#else
#define BF_CVTNEPS_BF16(x) ((__m256i)_mm512_cvtneps_pbh(x))
#define BF_CVTNE2PS_BF16(a, b) ((__m512i)_mm512_cvtne2ps_pbh(a, b))
#endif

namespace bertfast {
namespace cpu {

// The instructions as the Intel SDM's pseudo-code defines them, on this thread's tile state (amx_emulation.cpp).
// Where the hardware would fault (#UD, #GP: tiles not configured, shapes that do not multiply, a bad
// configuration) the emulation prints which instruction and why, and aborts.
namespace amx_emulation {
void loadconfig(const AmxTileConfig* cfg);                      // LDTILECFG
void release();                                                  // TILERELEASE
void zero(int tile);                                             // TILEZERO
void loadd(int tile, const void* base, int64_t stride);          // TILELOADD (stride in bytes)
void stored(int tile, void* base, int64_t stride);               // TILESTORED
void dpbf16ps(int c, int a, int b);                              // TDPBF16PS: C += A B, bf16 pairs, fp32 C
void dpbssd(int c, int a, int b);                                // TDPBSSD: C += A B, int8 quads, int32 C
// n floats to bf16 bits as the emulated tier converts them (cvtneps_bf16), and, where the CPU has AVX-512 BF16, as
// VCVTNEPS2BF16 does (false without it): for tests.
void cvtneps_bf16_emulated(const float* x, int64_t n, uint16_t* out);
bool cvtneps_bf16_instruction(const float* x, int64_t n, uint16_t* out);
}  // namespace amx_emulation

// The tile configuration both AMX GEMMs (bf16 and int8) and the attention use: tmm0-3 and tmm7 `rows` rows of 64
// bytes (accumulators, and the GEMMs' A tiles tmm3 and tmm7, used in turn); tmm4-6 16 rows of 64 bytes. Static:
// each mode's copy is its own.
static BF_TARGET_TILES BF_INLINE void amx_load_tile_config(int rows) {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = uint8_t(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  cfg.rows[7] = uint8_t(rows);
  cfg.colsb[7] = 64;
  BF_TILE_LOADCONFIG(&cfg);
}

// Starts a 16-row block of either AMX GEMM: (re)configures the tiles when its row count differs from
// the one configured (`configured`, -1 at first) and zeroes the three accumulators tmm0-2.
static BF_TARGET_TILES BF_INLINE void amx_begin_block(int rows, int* configured) {
  if (rows != *configured) {
    amx_load_tile_config(rows);
    *configured = rows;
  }
  BF_TILE_ZERO(0);
  BF_TILE_ZERO(1);
  BF_TILE_ZERO(2);
}

}  // namespace cpu
}  // namespace bertfast
#endif
