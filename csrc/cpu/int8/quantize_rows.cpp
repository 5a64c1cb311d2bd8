// quantize_rows: per-token asymmetric int8 quantization of fp32 activations (bertfast/backends/cpu/quant.py), before the
// int8 GEMM (int8_linear*.cpp).
//
// One read of each row for min/max (it is then in L1/L2), one more to write the codes; the math is the fp32
// sequence of quant.quantize_rows_reference, so the codes are bitwise equal to it. With flip the codes are written
// in their unsigned form (q ^ 0x80), the operand of int8_linear's vpdpbusd kernels (int8_unsigned_codes).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/common/simd.h"

namespace bertfast {
namespace cpu {
namespace {

// Per-row parameters from the row's min and max (shared by both ISAs so they agree bit for bit).
struct RowQuant {
  float scale, inv;
  int32_t zero_point;
  bool finite;
};

BF_INLINE RowQuant row_params(float lo, float hi, bool has_nan) {
  lo = lo < 0.f ? lo : 0.f;
  hi = hi > 0.f ? hi : 0.f;
  const float span = hi - lo;
  RowQuant r;
  r.scale = has_nan ? std::numeric_limits<float>::quiet_NaN() : (span == 0.f ? 1.0f : span / 255.0f);
  r.inv = 1.0f / r.scale;
  r.finite = std::isfinite(r.scale);
  float zp = r.finite ? -128.0f - std::nearbyint(lo * r.inv) : 0.0f;  // nearbyint: half to even
  zp = zp < -128.f ? -128.f : (zp > 127.f ? 127.f : zp);
  r.zero_point = int32_t(zp);
  return r;
}

BF_INLINE int8_t code(float x, const RowQuant& r) {
  float v = std::nearbyint(x * r.inv) + float(r.zero_point);
  v = v < -128.f ? -128.f : (v > 127.f ? 127.f : v);
  return r.finite ? int8_t(v) : int8_t(0);
}
constexpr uint8_t kFlip = 0x80;  // a code's unsigned form: q ^ 0x80 = q + 128

// Inlined into each ISA's wrapper: a plain call from the AVX2 one ran the baseline (SSE2) build of these loops.
BF_INLINE void quantize_rows_loops(const float* x, int64_t ldx, int64_t lo_row, int64_t hi_row, int64_t K, int8_t* q,
                                   float* scale, int32_t* zp, bool flip) {
  const uint8_t mask = flip ? kFlip : 0;
  for (int64_t m = lo_row; m < hi_row; ++m) {
    const float* row = x + m * ldx;
    float lo = 0.f, hi = 0.f;
    int nan = 0;
    // As reductions the loop vectorizes (a bool flag kept it scalar); the order of min/max does not matter
    // to the result, and a row with NaN is flagged whatever its lo and hi.
#pragma omp simd reduction(min : lo) reduction(max : hi) reduction(| : nan)
    for (int64_t k = 0; k < K; ++k) {
      const float v = row[k];
      nan |= v != v;
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    const RowQuant r = row_params(lo, hi, nan != 0);
    int8_t* qr = q + m * K;
    for (int64_t k = 0; k < K; ++k) qr[k] = int8_t(uint8_t(code(row[k], r)) ^ mask);
    scale[m] = r.scale;
    zp[m] = r.zero_point;
  }
}

void quantize_rows_range_generic(const float* x, int64_t ldx, int64_t lo_row, int64_t hi_row, int64_t K, int8_t* q,
                                 float* scale, int32_t* zp, bool flip) {
  quantize_rows_loops(x, ldx, lo_row, hi_row, K, q, scale, zp, flip);
}

#if BF_X86
BF_TARGET_AVX2 void quantize_rows_range_avx2(const float* x, int64_t ldx, int64_t lo_row, int64_t hi_row, int64_t K,
                                             int8_t* q, float* scale, int32_t* zp, bool flip) {
  quantize_rows_loops(x, ldx, lo_row, hi_row, K, q, scale, zp, flip);
}

// The codes of 16 floats (lanes outside mk: of 0) as int32: round(x * inv) + zp, rounding to nearest even as nearbyint.
BF_TARGET_AVX512 BF_INLINE __m512i codes512(const float* p, __mmask16 mk, __m512 inv, __m512i zp) {
  const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, p), inv);
  return _mm512_add_epi32(_mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), zp);
}

BF_TARGET_AVX512 void quantize_rows_range_avx512(const float* x, int64_t ldx, int64_t lo_row, int64_t hi_row,
                                                 int64_t K, int8_t* q, float* scale, int32_t* zp, bool flip) {
  const __m512i mask = _mm512_set1_epi8(char(flip ? kFlip : 0));
  // packs_epi32 then packs_epi16 leave 128-bit lane l holding dwords (c0, c1, c2, c3)[4l .. 4l + 3]; this puts them
  // back in order (c0's 16 codes, then c1's, ...). Saturating twice (to int16, then int8) clamps as once.
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  for (int64_t m = lo_row; m < hi_row; ++m) {
    const float* row = x + m * ldx;
    // min / max in two accumulators each (exact, so in any order); masked lanes read 0: harmless.
    __m512 lo0 = _mm512_setzero_ps(), lo1 = lo0, hi0 = lo0, hi1 = lo0;
    __mmask16 nan = 0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512 a = _mm512_loadu_ps(row + k), b = _mm512_loadu_ps(row + k + 16);
      nan |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);  // either lane NaN
      lo0 = _mm512_min_ps(lo0, a), hi0 = _mm512_max_ps(hi0, a);
      lo1 = _mm512_min_ps(lo1, b), hi1 = _mm512_max_ps(hi1, b);
    }
    for (; k < K; k += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(tail_mask(K - k), row + k);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      lo0 = _mm512_min_ps(lo0, v), hi0 = _mm512_max_ps(hi0, v);
    }
    const __m512 lo = _mm512_min_ps(lo0, lo1), hi = _mm512_max_ps(hi0, hi1);
    const RowQuant r = row_params(_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi), nan != 0);
    int8_t* qr = q + m * K;
    if (!r.finite) {
      std::memset(qr, flip ? kFlip : 0, size_t(K));
    } else {
      const __m512 inv = _mm512_set1_ps(r.inv);
      const __m512i z = _mm512_set1_epi32(r.zero_point);
      // |x * inv| <= 255 after the row's own min/max, so the int32 conversion is exact; the add and the signed
      // saturation to int8 give clamp(round(x * inv) + zp, -128, 127).
      k = 0;
      for (; k + 64 <= K; k += 64) {
        const __m512i c0 = codes512(row + k, 0xffff, inv, z), c1 = codes512(row + k + 16, 0xffff, inv, z);
        const __m512i c2 = codes512(row + k + 32, 0xffff, inv, z), c3 = codes512(row + k + 48, 0xffff, inv, z);
        const __m512i b = _mm512_packs_epi16(_mm512_packs_epi32(c0, c1), _mm512_packs_epi32(c2, c3));
        _mm512_storeu_si512(qr + k, _mm512_xor_si512(_mm512_permutexvar_epi32(order, b), mask));
      }
      for (; k < K; k += 16) {
        const __mmask16 mk = tail_mask(K - k);
        _mm_mask_storeu_epi8(qr + k, mk, _mm_xor_si128(_mm512_cvtsepi32_epi8(codes512(row + k, mk, inv, z)),
                                                       _mm512_castsi512_si128(mask)));
      }
    }
    scale[m] = r.scale;
    zp[m] = r.zero_point;
  }
}
#endif

}  // namespace

void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* scale, int32_t* zp, bool flip) {
  // Threads from 64k elements: below, a second thread gains nothing (benchmarks/results/2026-12-06-native-notes).
  const int nt = M * K >= (int64_t(1) << 16) ? num_threads() : 1;
  parallel_for(nt, nt, [&](int64_t part) {
    int64_t lo, hi;
    split_range(M, int(part), nt, &lo, &hi);
    quantize_rows_here(x, ldx, lo, hi, K, q, scale, zp, flip);
  });
}

void quantize_rows_here(const float* x, int64_t ldx, int64_t lo, int64_t hi, int64_t K, int8_t* q, float* scale,
                        int32_t* zp, bool flip) {
  DenormalGuard ftz;  // as quantize_rows
  BF_DISPATCH(quantize_rows_range, x, ldx, lo, hi, K, q, scale, zp, flip);
}

}  // namespace cpu
}  // namespace bertfast
