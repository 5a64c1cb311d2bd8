// Int8 dynamic quantization around the int8 GEMM (bertfast/quant.py): per-token asymmetric quantization of
// fp32 activations, and the epilogue that turns the GEMM's fp32 output back into the layer's result.
//
// quantize_rows: one read of each row for min/max (it is then in L1/L2), one more to write the codes; the
// math is the fp32 sequence of quant.quantize_rows_reference, so the codes are bitwise equal to it.
// int8_epilogue: out = act(xs[m] * (out - zp[m] * colsum[n]) + bias[n]) + residual, in place, one pass
// (after oneDNN's int8 GEMM, which the AMX tier uses for large token counts).
// The int8 GEMM with its epilogue fused is int8_linear.cpp.
#include <omp.h>

#include <cmath>
#include <algorithm>
#include <limits>

#include "common.h"
#include "parallel.h"

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

// Inlined into each ISA's wrapper: a plain call from the AVX2 one ran the baseline (SSE2) build of these loops.
BF_INLINE void quantize_rows_loops(const float* x, int64_t ldx, int64_t lo_row, int64_t hi_row, int64_t K, int8_t* q,
                                   float* scale, int32_t* zp) {
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
    for (int64_t k = 0; k < K; ++k) qr[k] = code(row[k], r);
    scale[m] = r.scale;
    zp[m] = r.zero_point;
  }
}

void quantize_rows_range_generic(const float* x, int64_t ldx, int64_t lo_row, int64_t hi_row, int64_t K, int8_t* q,
                                 float* scale, int32_t* zp) {
  quantize_rows_loops(x, ldx, lo_row, hi_row, K, q, scale, zp);
}

template <Act ACT>
BF_INLINE void epilogue_rows_generic(float* out, int64_t lo_row, int64_t hi_row, int64_t N, const float* xs,
                                     const int32_t* zp, const float* colsum, const float* bias,
                                     const float* residual, int64_t ldr) {
  for (int64_t m = lo_row; m < hi_row; ++m) {
    float* o = out + m * N;
    const float s = xs[m], z = float(zp[m]);
    const float* r = residual != nullptr ? residual + m * ldr : nullptr;
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) {
      float v = s * (o[n] - z * colsum[n]) + (bias != nullptr ? bias[n] : 0.f);
      v = apply_act(v, ACT);
      o[n] = r != nullptr ? v + r[n] : v;
    }
  }
}

void epilogue_range_generic(float* out, int64_t lo_row, int64_t hi_row, int64_t N, const float* xs, const int32_t* zp,
                            const float* colsum, const float* bias, Act act, const float* residual, int64_t ldr) {
  switch (act) {
    case Act::Gelu:
      return epilogue_rows_generic<Act::Gelu>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    case Act::GeluTanh:
      return epilogue_rows_generic<Act::GeluTanh>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    case Act::Relu:
      return epilogue_rows_generic<Act::Relu>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    case Act::Tanh:
      return epilogue_rows_generic<Act::Tanh>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    default:
      return epilogue_rows_generic<Act::None>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
  }
}

#if BF_X86
BF_TARGET_AVX2 void quantize_rows_range_avx2(const float* x, int64_t ldx, int64_t lo_row, int64_t hi_row, int64_t K,
                                             int8_t* q, float* scale, int32_t* zp) {
  quantize_rows_loops(x, ldx, lo_row, hi_row, K, q, scale, zp);
}

BF_TARGET_AVX2 void epilogue_range_avx2(float* out, int64_t lo_row, int64_t hi_row, int64_t N, const float* xs,
                                        const int32_t* zp, const float* colsum, const float* bias, Act act,
                                        const float* residual, int64_t ldr) {
  epilogue_range_generic(out, lo_row, hi_row, N, xs, zp, colsum, bias, act, residual, ldr);
}

BF_TARGET_AVX512 void quantize_rows_range_avx512(const float* x, int64_t ldx, int64_t lo_row, int64_t hi_row,
                                                 int64_t K, int8_t* q, float* scale, int32_t* zp) {
  for (int64_t m = lo_row; m < hi_row; ++m) {
    const float* row = x + m * ldx;
    __m512 vlo = _mm512_setzero_ps(), vhi = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(tail_mask(K - k), row + k);  // masked lanes read 0: harmless
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vlo = _mm512_min_ps(vlo, v);
      vhi = _mm512_max_ps(vhi, v);
    }
    const RowQuant r = row_params(_mm512_reduce_min_ps(vlo), _mm512_reduce_max_ps(vhi), nan != 0);
    int8_t* qr = q + m * K;
    if (!r.finite) {
      std::memset(qr, 0, size_t(K));
    } else {
      const __m512 inv = _mm512_set1_ps(r.inv);
      const __m512i z = _mm512_set1_epi32(r.zero_point);
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mk = tail_mask(K - k);
        const __m512 v = _mm512_maskz_loadu_ps(mk, row + k);
        const __m512 rounded = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        // |x * inv| <= 255 after the row's own min/max, so the int32 conversion is exact; the add and the
        // signed saturation to int8 give clamp(round(x * inv) + zp, -128, 127).
        const __m512i c = _mm512_add_epi32(_mm512_cvtps_epi32(rounded), z);
        _mm_mask_storeu_epi8(qr + k, mk, _mm512_cvtsepi32_epi8(c));
      }
    }
    scale[m] = r.scale;
    zp[m] = r.zero_point;
  }
}

template <Act ACT>
BF_TARGET_AVX512 void epilogue_rows_avx512(float* out, int64_t lo_row, int64_t hi_row, int64_t N, const float* xs,
                                           const int32_t* zp, const float* colsum, const float* bias,
                                           const float* residual, int64_t ldr) {
  for (int64_t m = lo_row; m < hi_row; ++m) {
    float* o = out + m * N;
    const __m512 s = _mm512_set1_ps(xs[m]), z = _mm512_set1_ps(float(zp[m]));
    const float* r = residual != nullptr ? residual + m * ldr : nullptr;
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 mk = tail_mask(N - n);
      const __m512 centred = _mm512_fnmadd_ps(z, _mm512_maskz_loadu_ps(mk, colsum + n), _mm512_maskz_loadu_ps(mk, o + n));
      const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mk, bias + n) : _mm512_setzero_ps();
      __m512 v = act512<ACT>(_mm512_fmadd_ps(s, centred, b));
      if (r != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, r + n));
      _mm512_mask_storeu_ps(o + n, mk, v);
    }
  }
}

BF_TARGET_AVX512 void epilogue_range_avx512(float* out, int64_t lo_row, int64_t hi_row, int64_t N, const float* xs,
                                            const int32_t* zp, const float* colsum, const float* bias, Act act,
                                            const float* residual, int64_t ldr) {
  switch (act) {
    case Act::None:
      return epilogue_rows_avx512<Act::None>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    case Act::Gelu:
      return epilogue_rows_avx512<Act::Gelu>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    case Act::Relu:
      return epilogue_rows_avx512<Act::Relu>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    default:  // tanh-GELU and tanh: the portable loop (auto-vectorized) is fast enough for them
      return epilogue_range_generic(out, lo_row, hi_row, N, xs, zp, colsum, bias, act, residual, ldr);
  }
}
#endif

}  // namespace

void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* scale, int32_t* zp) {
  // Threads only for large inputs: a short call is not worth waking another thread.
  const int nt = M * K >= (int64_t(1) << 20) ? num_threads() : 1;
  parallel_for(nt, nt, [&](int64_t part) {
    DenormalGuard ftz;
    int64_t lo, hi;
    split_range(M, int(part), nt, &lo, &hi);
    BF_DISPATCH(quantize_rows_range, x, ldx, lo, hi, K, q, scale, zp);
  });
}

void int8_epilogue(float* out, int64_t M, int64_t N, const float* xs, const int32_t* zp, const float* colsum,
                   const float* bias, Act act, const float* residual, int64_t ldr) {
  const int64_t cost = act == Act::None || act == Act::Relu ? 4 : 16;
  const int nt = threads_for(M * N * cost);
  parallel_for(nt, nt, [&](int64_t part) {
    DenormalGuard ftz;
    int64_t lo, hi;
    split_range(M, int(part), nt, &lo, &hi);
    BF_DISPATCH(epilogue_range, out, lo, hi, N, xs, zp, colsum, bias, act, residual, ldr);
  });
}

}  // namespace cpu
}  // namespace bertfast

