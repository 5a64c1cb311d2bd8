// AVX-512 and AMX helpers: tail masks, 16-lane loads and stores of fp32 or bf16, the AMX tile configuration's layout.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/common/isa.h"
#include "cpu/common/types.h"

#if BF_X86
namespace bertfast {
namespace cpu {

// Lanes [0, left) of a 16-lane vector (all of them if left >= 16, none if left <= 0).
BF_TARGET_AVX512 BF_INLINE __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1u);
}

BF_TARGET_AVX512 BF_INLINE __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
// 16 bf16 (their bits) widened to fp32, exactly: a shift, as vcvtpbh2ps does.
BF_TARGET_AVX512 BF_INLINE __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
BF_TARGET_AVX512 BF_INLINE __m512 load16(const bf16* p, __mmask16 m) {
  return widen_bf16(_mm256_maskz_loadu_epi16(m, p));
}
BF_TARGET_AVX512 BF_INLINE void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
BF_TARGET_AVX512 BF_INLINE void store16(bf16* p, __m512 v, __mmask16 m) {
  // Round to nearest even, NaN kept quiet, as from_float<bf16>.
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

// The 64-byte operand of LDTILECFG (palette 1): what amx_tiles.h loads and amx_emulation.cpp interprets.
struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

}  // namespace cpu
}  // namespace bertfast
#endif
