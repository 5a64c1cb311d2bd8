// Bias + activation (exact-erf GELU, tanh GELU, ReLU, tanh) in place on a [T, N] GEMM output, in fp32.
#include <omp.h>

#include "common.h"
#include "parallel.h"

namespace bertfast {
namespace cpu {
namespace {

template <typename T, Act ACT>
BF_INLINE void bias_act_rows(T* x, const T* bias, int64_t lo, int64_t hi, int64_t N) {
  for (int64_t t = lo; t < hi; ++t) {
    T* r = x + t * N;
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t i = 0; i < N; ++i) r[i] = from_float<T>(apply_act(to_float(r[i]) + to_float(bias[i]), ACT));
    } else {
#pragma omp simd
      for (int64_t i = 0; i < N; ++i) r[i] = from_float<T>(apply_act(to_float(r[i]), ACT));
    }
  }
}

template <typename T>
BF_INLINE void bias_act_thread(T* x, const T* bias, int64_t tokens, int64_t N, Act act, int part, int parts) {
  DenormalGuard ftz;
  int64_t lo, hi;
  split_range(tokens, part, parts, &lo, &hi);
  // One loop per activation so each inner loop is a straight vectorizable body.
  switch (act) {
    case Act::Gelu:
      bias_act_rows<T, Act::Gelu>(x, bias, lo, hi, N);
      break;
    case Act::GeluTanh:
      bias_act_rows<T, Act::GeluTanh>(x, bias, lo, hi, N);
      break;
    case Act::Relu:
      bias_act_rows<T, Act::Relu>(x, bias, lo, hi, N);
      break;
    case Act::Tanh:
      bias_act_rows<T, Act::Tanh>(x, bias, lo, hi, N);
      break;
    default:
      bias_act_rows<T, Act::None>(x, bias, lo, hi, N);
  }
}

#if BF_X86
// Exact GELU with intrinsics (gelu_erf512): the hot activation of BERT's FFN after a large GEMM.
template <typename T>
BF_TARGET_AVX512 BF_INLINE void bias_gelu_thread_avx512(T* x, const T* bias, int64_t tokens, int64_t N, int part,
                                                        int parts) {
  DenormalGuard ftz;
  int64_t lo, hi;
  split_range(tokens, part, parts, &lo, &hi);
  for (int64_t t = lo; t < hi; ++t) {
    T* r = x + t * N;
    for (int64_t i = 0; i < N; i += 16) {
      const __mmask16 m = N - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (N - i)) - 1u);
      __m512 v = load16(r + i, m);
      if (bias != nullptr) v = _mm512_add_ps(v, load16(bias + i, m));
      store16(r + i, gelu_erf512(v), m);
    }
  }
}

template <typename T>
BF_TARGET_AVX512 void bias_act_avx512(T* x, const T* bias, int64_t tokens, int64_t N, Act act, int part, int parts) {
  if (act == Act::Gelu) {
    bias_gelu_thread_avx512(x, bias, tokens, N, part, parts);
    return;
  }
  bias_act_thread(x, bias, tokens, N, act, part, parts);
}

template <typename T>
BF_TARGET_AVX2 void bias_act_avx2(T* x, const T* bias, int64_t tokens, int64_t N, Act act, int part, int parts) {
  bias_act_thread(x, bias, tokens, N, act, part, parts);
}
#endif

template <typename T>
void bias_act_generic(T* x, const T* bias, int64_t tokens, int64_t N, Act act, int part, int parts) {
  bias_act_thread(x, bias, tokens, N, act, part, parts);
}

}  // namespace

template <typename T>
void bias_act(T* x, const T* bias, int64_t tokens, int64_t features, Act act) {
  const int nt = threads_for(tokens * features * 8);
  parallel_for(nt, nt, [&](int64_t part) {
    BF_DISPATCH(bias_act, x, bias, tokens, features, act, int(part), nt);
  });
}

template void bias_act<float>(float*, const float*, int64_t, int64_t, Act);
template void bias_act<bf16>(bf16*, const bf16*, int64_t, int64_t, Act);

}  // namespace cpu
}  // namespace bertfast
