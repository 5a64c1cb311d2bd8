// int8_epilogue: out = act(xs[m] * (out - zp[m] * colsum[n]) + bias[n]) + residual, in place, one pass; what
// turns the fp32 output of oneDNN's int8 GEMM (which the AMX tier uses for large token counts) back into the
// layer's result (bertfast/quant.py). The int8 GEMM with this epilogue fused is int8_linear*.cpp.
#include <omp.h>

#include "isa.h"
#include "kernels.h"
#include "parallel.h"
#include "scalar_math.h"
#include "simd.h"
#include "vec_math.h"

namespace bertfast {
namespace cpu {
namespace {

template <Activation ACT>
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
                            const float* colsum, const float* bias, Activation act, const float* residual,
                            int64_t ldr) {
  with_activation(act, [&](auto a) {
    epilogue_rows_generic<decltype(a)::value>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
  });
}

#if BF_X86
BF_TARGET_AVX2 void epilogue_range_avx2(float* out, int64_t lo_row, int64_t hi_row, int64_t N, const float* xs,
                                        const int32_t* zp, const float* colsum, const float* bias, Activation act,
                                        const float* residual, int64_t ldr) {
  epilogue_range_generic(out, lo_row, hi_row, N, xs, zp, colsum, bias, act, residual, ldr);
}

template <Activation ACT>
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
                                            const int32_t* zp, const float* colsum, const float* bias, Activation act,
                                            const float* residual, int64_t ldr) {
  with_activation(act, [&](auto a) {
    if constexpr (has_act512(decltype(a)::value))
      epilogue_rows_avx512<decltype(a)::value>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    else  // tanh-GELU and tanh: the portable loop (auto-vectorized) is fast enough for them
      epilogue_range_generic(out, lo_row, hi_row, N, xs, zp, colsum, bias, act, residual, ldr);
  });
}
#endif

}  // namespace

void int8_epilogue(float* out, int64_t M, int64_t N, const float* xs, const int32_t* zp, const float* colsum,
                   const float* bias, Activation act, const float* residual, int64_t ldr) {
  const int64_t cost = act == Activation::None || act == Activation::Relu ? 4 : 16;
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
