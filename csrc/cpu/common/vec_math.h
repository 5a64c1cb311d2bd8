// Vector forms of scalar_math.h: exp on 16 and 8 lanes (the same numbers); erf-GELU on 16 lanes (its own
// piecewise fit, gelu_erf512) and act512.
//
// erf-GELU and the epilogue activations with a 16-lane form are AVX-512 only.
#pragma once

#include "cpu/common/activation.h"
#include "cpu/common/isa.h"
#include "cpu/common/scalar_math.h"

#if BF_X86
namespace bertfast {
namespace cpu {

// exp_f's steps on 16 lanes of x already clamped: x = n ln 2 + r (Cody-Waite), the Taylor polynomial of e^r; n
// returned for the scale by 2^n.
BF_TARGET_AVX512 BF_INLINE __m512 exp512_reduced(__m512 x, __m512* n) {
  *n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(*n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(*n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  return p;
}

// exp_f on 16 lanes (the same numbers, scalar_math.h).
BF_TARGET_AVX512 BF_INLINE __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  x = _mm512_min_ps(x, _mm512_set1_ps(kExpMax));
  __m512 n;
  const __m512 p = exp512_reduced(x, &n);
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// exp512 for x <= 0 (a softmax's x - max), the same numbers: no upper clamp, and the scale by 2^n in one vscalefps
// instead of building 2^n's bits and multiplying (4 of exp512's ~19 vector instructions, on the ports the softmax's
// FMAs need). The results are the same products p * 2^n, flushed to zero where exp512's are (below 2^-126, FTZ).
BF_TARGET_AVX512 BF_INLINE __m512 exp512_nonpositive(__m512 x) {
  __m512 n;
  const __m512 p = exp512_reduced(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), &n);
  return _mm512_scalef_ps(p, n);
}

// 2^x for softmax probabilities (x <= 0 there): 2^n * 2^f with f in [-0.5, 0.5] and 2^f by its degree-5 Taylor
// polynomial (relative error < 3e-6: the AMX attention's P carried in two bf16 parts, 2^-17 = 7.6e-6, and the
// AVX-512 BF16 attention's P rounded to bf16 once).
BF_TARGET_AVX512 BF_INLINE __m512 exp2_512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
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

// erfc(z) for z in [0, 4) on 16 intervals of width 1/4: on interval i, z = (i + 1/2 + u) / 4 with u in [-1/2, 1/2),
// erfc(z) ~ sum_k kErfcPieces[5 - k][i] u^k, a degree-5 fit at the Chebyshev nodes of each interval (fitted in fp64,
// then rounded to fp32): |error| < 6.6e-8 on [0, 4) evaluated in fp32, under one ulp of erfc's values near 1.
alignas(64) inline constexpr float kErfcPieces[6][16] = {
    {-1.0119249e-04f, -4.428463e-05f, 2.6453992e-05f, 6.521619e-05f, 5.9666672e-05f, 2.9920497e-05f,
     2.2258673e-06f, -1.1081273e-05f, -1.21597195e-05f, -8.164202e-06f, -4.1345465e-06f, -1.6852001e-06f,
     -5.6954843e-07f, -1.622829e-07f, -3.9389743e-08f, -8.201717e-09f},
    {-2.6632124e-04f, -6.46147e-04f, -6.855218e-04f, -4.3809693e-04f, -1.1068345e-04f, 1.1712094e-04f,
     1.9289553e-04f, 1.6469952e-04f, 1.0313652e-04f, 5.158576e-05f, 2.1355232e-05f, 7.4552195e-06f, 2.219613e-06f,
     5.677426e-07f, 1.2540374e-07f, 2.4009232e-08f},
    {0.0056050015f, 0.0036699288f, 8.699022e-04f, -0.0014518915f, -0.002538297f, -0.0024677797f, -0.0017943978f,
     -0.0010537776f, -5.162135e-04f, -2.1453934e-04f, -7.641146e-05f, -2.3475992e-05f, -6.249736e-06f,
     -1.4463883e-06f, -2.9170914e-07f, -5.136524e-08f},
    {0.008678597f, 0.02297659f, 0.029823847f, 0.028696906f, 0.02237877f, 0.014640482f, 0.008173088f, 0.003931187f,
     0.0016389999f, 5.9468497e-04f, 1.8830398e-04f, 5.2140582e-05f, 1.26442765e-05f, 2.688553e-06f, 5.0170127e-07f,
     8.2222165e-08f},
    {-0.27772132f, -0.2450882f, -0.19087489f, -0.13118626f, -0.07956849f, -0.042589944f, -0.020118065f,
     -0.008386457f, -0.003085205f, -0.0010016195f, -2.869688e-04f, -7.2557086e-05f, -1.6189679e-05f,
     -3.1879383e-06f, -5.53981e-07f, -8.4955836e-08f},
    {0.8596838f, 0.5958831f, 0.3767591f, 0.21592493f, 0.11161177f, 0.051829923f, 0.021556266f, 0.008009942f,
     0.0026540295f, 7.829386e-04f, 2.0537601e-04f, 4.7854977e-05f, 9.8967885e-06f, 1.815299e-06f, 2.9514496e-07f,
     4.2515037e-08f}};

// Exact GELU, 0.5 x erfc(-x / sqrt 2), on 16 lanes: erfc(|x| / sqrt 2) from kErfcPieces (the interval's six
// coefficients picked from their tables by vpermps: no division, no exp), then x - 0.5 x erfc for x >= 0 and
// 0.5 x erfc for x < 0 (no cancellation in the negative tail). Past |x| / sqrt 2 = 4 erfc < 1.6e-8 is taken as 0: x
// for x >= 0 (within half an ulp), -0 for x < 0 (|GELU| < 4.4e-8 there). Max |error| 2.4e-7 on [-10, 10] (at x =
// 4.2, under one ulp of GELU there), where torch's fp32 GELU measures 1.3e-6. ~21 operations where the erfc fit of
// Numerical Recipes that scalar_math.h's gelu_erf keeps took ~37 (a reciprocal and an exp). The other tiers keep
// gelu_erf; their bits differ in the last place, as their sums' order does.
BF_TARGET_AVX512 BF_INLINE __m512 gelu_erf512(__m512 x) {
  const __m512 s = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(4.f * 0.70710678118654752f));  // 4 |x| / sqrt 2
  const __mmask16 near = _mm512_cmp_ps_mask(s, _mm512_set1_ps(16.f), _CMP_LT_OQ);  // NaN: not near
  const __m512i i = _mm512_cvttps_epi32(_mm512_maskz_mov_ps(near, s));  // the interval, 0 past the table
  const __m512 u = _mm512_sub_ps(_mm512_sub_ps(s, _mm512_cvtepi32_ps(i)), _mm512_set1_ps(0.5f));  // exact
  __m512 p = _mm512_permutexvar_ps(i, _mm512_load_ps(kErfcPieces[0]));
#pragma GCC unroll 5
  for (int k = 1; k < 6; ++k) p = _mm512_fmadd_ps(p, u, _mm512_permutexvar_ps(i, _mm512_load_ps(kErfcPieces[k])));
  const __m512 erfc = _mm512_maskz_mov_ps(near, p);
  const __m512 neg = _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), erfc);  // x < 0: 0.5 x erfc
  const __m512 pos = _mm512_mask_sub_ps(x, near, x, neg);                           // x >= 0: x - 0.5 x erfc
  const __mmask16 nonneg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
  // NaN lanes compare false and take `neg`, which is NaN as well.
  return _mm512_mask_blend_ps(nonneg, neg, pos);
}

// Coefficient k of kErfcPieces for the intervals i (0-15): two 8-entry vpermps and a blend on bit 3 of i (`upper`).
BF_TARGET_AVX2 BF_INLINE __m256 erfc_piece256(int k, __m256i i, __m256 upper) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(kErfcPieces[k]), i),
                          _mm256_permutevar8x32_ps(_mm256_load_ps(kErfcPieces[k] + 8), i), upper);
}

// gelu_erf512 on 8 lanes (the avx2 tier's GEMM epilogues): the same operations in the same order, so the same bits.
BF_TARGET_AVX2 BF_INLINE __m256 gelu_erf256(__m256 x) {
  const __m256 s = _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), x), _mm256_set1_ps(4.f * 0.70710678118654752f));
  const __m256 near = _mm256_cmp_ps(s, _mm256_set1_ps(16.f), _CMP_LT_OQ);  // NaN: not near
  const __m256i i = _mm256_cvttps_epi32(_mm256_and_ps(near, s));
  const __m256 u = _mm256_sub_ps(_mm256_sub_ps(s, _mm256_cvtepi32_ps(i)), _mm256_set1_ps(0.5f));
  const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(i, 28));  // sign bit set: interval >= 8
  __m256 p = erfc_piece256(0, i, upper);
#pragma GCC unroll 5
  for (int k = 1; k < 6; ++k) p = _mm256_fmadd_ps(p, u, erfc_piece256(k, i, upper));
  const __m256 erfc = _mm256_and_ps(near, p);
  const __m256 neg = _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.5f)), erfc);
  const __m256 pos = _mm256_blendv_ps(x, _mm256_sub_ps(x, neg), near);
  return _mm256_blendv_ps(neg, pos, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}

// activate() for the epilogues of the avx2 tier's GEMMs (store_tile<T, false, true>, the int8 kernels' finish_cols):
// erf-GELU on 8 lanes (gelu_erf256), the other activations as activate(): the 4-lane gelu_erf16 held back the FFN-in
// GEMM.
BF_TARGET_AVX2 inline void activate256(float* v, int64_t n, Activation act) {  // a call: its callers' targets vary
  if (act != Activation::Gelu) {
    activate(v, n, act);
    return;
  }
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(v + j, gelu_erf256(_mm256_loadu_ps(v + j)));
  if (j < n) {
    alignas(32) float t[8] = {};
    std::memcpy(t, v + j, size_t(n - j) * sizeof(float));
    _mm256_store_ps(t, gelu_erf256(_mm256_load_ps(t)));
    std::memcpy(v + j, t, size_t(n - j) * sizeof(float));
  }
}

// activate() for the epilogues of the AVX-512 kernels (store_tile<T, true>): erf-GELU on 16 lanes (gelu_erf512), the
// other activations as activate(). Every bf16 GEMM of the AVX-512 tiers (streaming, blocked, AMX tiles) ends here
// whatever M, so a row's bits do not depend on its batch; the 4-lane gelu_erf16 held back the FFN-in GEMM.
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

namespace bertfast {
namespace cpu {

// Which activate() an epilogue's caller runs: its tier's vector width (activate512 / activate256, erf-GELU from the
// piecewise fit) or activate (scalar_math.h, the portable tier and non-x86 builds).
enum class Lanes { Generic, Avx2, Avx512 };

template <Lanes kLanes>
BF_INLINE void activate_lanes(float* v, int64_t n, Activation act) {
#if BF_X86
  if constexpr (kLanes == Lanes::Avx512) {
    activate512(v, n, act);
  } else if constexpr (kLanes == Lanes::Avx2) {
    activate256(v, n, act);
  } else {
    activate(v, n, act);
  }
#else
  activate(v, n, act);
#endif
}

}  // namespace cpu
}  // namespace bertfast
