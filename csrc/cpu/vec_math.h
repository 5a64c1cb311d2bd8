// Vector forms of scalar_math.h (same algorithms, same numbers): exp on 16 and 8 lanes, GELU and act512.
//
// erf-GELU and the epilogue activations with a 16-lane form are AVX-512 only.
#pragma once

#include "activation.h"
#include "isa.h"
#include "scalar_math.h"

#if BF_X86
namespace bertfast {
namespace cpu {

// exp_f on 16 lanes (the same numbers, scalar_math.h).
BF_TARGET_AVX512 BF_INLINE __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  x = _mm512_min_ps(x, _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// exp_f on 8 lanes.
BF_TARGET_AVX2 BF_INLINE __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  x = _mm256_min_ps(x, _mm256_set1_ps(kExpMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// gelu_erf on 16 lanes; the division becomes rcp14 + one Newton step (relative error ~1e-8), which
// makes it ~2x faster than the auto-vectorized scalar version.
BF_TARGET_AVX512 BF_INLINE __m512 gelu_erf512(__m512 x) {
  const __m512 z_abs = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.70710678118654752f));
  const __m512 z = _mm512_min_ps(z_abs, _mm512_set1_ps(9.0f));
  const __m512 den = _mm512_fmadd_ps(z, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.0f));
  __m512 t = _mm512_rcp14_ps(den);
  t = _mm512_mul_ps(t, _mm512_fnmadd_ps(den, t, _mm512_set1_ps(2.0f)));
  __m512 p = _mm512_set1_ps(0.17087277f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.82215223f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.48851587f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.13520398f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.27886807f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.18628806f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.09678418f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.37409196f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.00002368f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.26551223f));
  __m512 erfc_z = _mm512_mul_ps(t, exp512(_mm512_fnmadd_ps(z, z, p)));
  erfc_z = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(z_abs, _mm512_set1_ps(9.0f), _CMP_LE_OQ), erfc_z);
  const __m512 half_x = _mm512_mul_ps(x, _mm512_set1_ps(0.5f));
  const __m512 neg = _mm512_mul_ps(half_x, erfc_z);                      // x < 0: 0.5 x erfc
  const __m512 pos = _mm512_sub_ps(x, neg);                               // x >= 0: x (1 - 0.5 erfc)
  const __mmask16 nonneg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
  // NaN lanes compare false and take `neg`, which is NaN as well.
  return _mm512_mask_blend_ps(nonneg, neg, pos);
}

// activate() for the epilogues of the AVX-512 kernels (store_tile<T, true>): erf-GELU on 16 lanes (gelu_erf512), the
// other activations as activate(). Every bf16 GEMM of the AVX-512 tiers (streaming, blocked, AMX tiles) ends here
// whatever M, so a row's bits do not depend on its batch; the 4-lane gelu_erf16 cost the FFN-in GEMM ~x1.8 its
// time in bf16 (MiniLM, Zen 5).
BF_TARGET_AVX512 inline void activate512(float* v, int64_t n, Activation act) {  // a call: store_tile has no target
  if (act != Activation::Gelu) {
    activate(v, n, act);
    return;
  }
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(v + j, gelu_erf512(_mm512_loadu_ps(v + j)));
  if (j < n) {
    const __mmask16 m = __mmask16((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(v + j, m, gelu_erf512(_mm512_maskz_loadu_ps(m, v + j)));
  }
}

// Whether an activation has a 16-lane form (act512): the others (tanh, tanh-GELU) go through the scalar
// functions.
constexpr bool has_act512(Activation act) {
  return act == Activation::None || act == Activation::Gelu || act == Activation::Relu;
}

// The activations with a 16-lane form (the epilogues of the int8 and blocked fp32 GEMMs).
template <Activation ACT>
BF_TARGET_AVX512 BF_INLINE __m512 act512(__m512 v) {
  static_assert(has_act512(ACT), "no 16-lane form");
  if constexpr (ACT == Activation::Gelu) {
    return gelu_erf512(v);
  } else if constexpr (ACT == Activation::Relu) {
    return _mm512_max_ps(v, _mm512_setzero_ps());
  } else {
    return v;
  }
}

}  // namespace cpu
}  // namespace bertfast
#endif
