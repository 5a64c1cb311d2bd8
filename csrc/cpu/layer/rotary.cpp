// Rotary position embeddings (RoPE) on q and k in place, the half-split ("rotate_half") convention of
// backends.Rotary: for token t, each head's row x of d elements, i < d/2:
//   y[i] = x[i] cos[t, i] - x[i + d/2] sin[t, i],   y[i + d/2] = x[i + d/2] cos[t, i] + x[i] sin[t, i].
// Each product and each sum is one fp32 operation rounded on its own, as torch computes reference.rotate:
// no fused multiply-add (this file is compiled with fp-contract off; the compiler would otherwise fuse the
// intrinsics' multiplies into the adds too), so fp32 results equal the reference's bit for bit and bf16 ones
// are rounded once, from the same fp32 values. Threads split the tokens; a token's cos/sin row serves all its
// heads (AVX-512: loaded into registers once per 16 columns).
#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

#include <omp.h>

#include <algorithm>

#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/common/simd.h"

namespace bertfast {
namespace cpu {
namespace {

// Head h of token t at x + t * ld_row + h * ld_head; cos/sin rows of half = d / 2 values.
struct RotaryArgs {
  int64_t ld_row, ld_head, heads, half;
  const float *cos, *sin;
};

// Portable: plain loops over the half row (compiled for the baseline ISA, and as the AVX2 tier's kernel).
template <typename T>
BF_INLINE void rotary_rows(T* x, const RotaryArgs& a, int64_t lo, int64_t hi) {
  for (int64_t t = lo; t < hi; ++t) {
    const float* c = a.cos + t * a.half;
    const float* s = a.sin + t * a.half;
    for (int64_t h = 0; h < a.heads; ++h) {
      T* x1 = x + t * a.ld_row + h * a.ld_head;
      T* x2 = x1 + a.half;
#pragma omp simd
      for (int64_t i = 0; i < a.half; ++i) {
        const float u = to_float(x1[i]), v = to_float(x2[i]);
        x1[i] = from_float<T>(u * c[i] - v * s[i]);
        x2[i] = from_float<T>(v * c[i] + u * s[i]);
      }
    }
  }
}

#if BF_X86
// AVX2: the portable loops compiled for AVX2 + FMA (8 lanes; still no fused multiply-add, see the top).
template <typename T>
BF_TARGET_AVX2 void rotary_avx2(T* x, const RotaryArgs& a, int64_t lo, int64_t hi) {
  rotary_rows(x, a, lo, hi);
}

// AVX-512: 16 lanes of the half row at a time, the tail masked; cos/sin loaded once per token for all heads.
template <typename T>
BF_TARGET_AVX512 void rotary_avx512(T* x, const RotaryArgs& a, int64_t lo, int64_t hi) {
  for (int64_t t = lo; t < hi; ++t) {
    for (int64_t e0 = 0; e0 < a.half; e0 += 16) {
      const __mmask16 m = tail_mask(a.half - e0);
      const __m512 c = _mm512_maskz_loadu_ps(m, a.cos + t * a.half + e0);
      const __m512 s = _mm512_maskz_loadu_ps(m, a.sin + t * a.half + e0);
      for (int64_t h = 0; h < a.heads; ++h) {
        T* x1 = x + t * a.ld_row + h * a.ld_head + e0;
        T* x2 = x1 + a.half;
        const __m512 u = load16(x1, m), v = load16(x2, m);
        store16(x1, _mm512_sub_ps(_mm512_mul_ps(u, c), _mm512_mul_ps(v, s)), m);
        store16(x2, _mm512_add_ps(_mm512_mul_ps(v, c), _mm512_mul_ps(u, s)), m);
      }
    }
  }
}
#endif

template <typename T>
void rotary_generic(T* x, const RotaryArgs& a, int64_t lo, int64_t hi) {
  rotary_rows(x, a, lo, hi);
}

}  // namespace

template <typename T>
void rotary(T* x, int64_t ld_row, int64_t ld_head, int64_t tokens, int64_t heads, int64_t head_dim, const float* cos,
            const float* sin) {
  const RotaryArgs a{ld_row, ld_head, heads, head_dim / 2, cos, sin};
  const int nt = threads_for(tokens * heads * head_dim);
  parallel_for(nt, nt, [&](int64_t part) {
    int64_t lo, hi;
    split_range(tokens, int(part), nt, &lo, &hi);
    BF_DISPATCH(rotary, x, a, lo, hi);
  });
}

template void rotary<float>(float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, const float*);
template void rotary<bf16>(bf16*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, const float*);

}  // namespace cpu
}  // namespace bertfast
