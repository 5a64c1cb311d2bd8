// Residual + LayerNorm in one pass over each row, statistics in fp32 (two-pass mean/variance on
// the row held shifted in an fp32 buffer, so inputs far from zero do not cancel).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/scalar_math.h"
#include "cpu/common/simd.h"
#include "cpu/common/parallel.h"

namespace bertfast {
namespace cpu {
namespace {

template <typename T>
BF_INLINE void layernorm_rows(const T* x, const T* residual, const T* gamma, const T* beta, float eps, int64_t lo,
                              int64_t hi, int64_t H, T* out, float* row) {
  for (int64_t t = lo; t < hi; ++t) {
    const T* xr = x + t * H;
    const T* rr = residual != nullptr ? residual + t * H : nullptr;
    // Statistics of the row shifted by its first element: for rows far from zero (cancellation) the
    // shifted values are small and exact, so the mean and variance keep full fp32 precision. (+ 0.f makes
    // a first element of -0 a shift of +0, as ever.)
    const float shift = to_float(xr[0]) + 0.f + (rr != nullptr ? to_float(rr[0]) : 0.f);
    float sum = 0.f;
    if (rr != nullptr) {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < H; ++i) {
        row[i] = (to_float(xr[i]) + to_float(rr[i])) - shift;
        sum += row[i];
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < H; ++i) {
        row[i] = to_float(xr[i]) - shift;
        sum += row[i];
      }
    }
    normalize_row(row, sum, H, eps, gamma, beta, out + t * H);
  }
}

// Rows [lo, hi) on each tier (layernorm_rows compiled for it); row: H floats of scratch.
#if BF_X86
template <typename T>
BF_TARGET_AVX2 void layernorm_avx2(const T* x, const T* residual, const T* gamma, const T* beta, float eps,
                                   int64_t lo, int64_t hi, int64_t H, T* out, float* row) {
  layernorm_rows(x, residual, gamma, beta, eps, lo, hi, H, out, row);
}

// fp32 rows on AVX-512: layernorm_rows's steps (the row shifted by its first element, its mean, the variance of the
// shifted row, then (row - mean) * rstd * gamma + beta), each sum in four accumulators (the compiler's vectorized
// reduction kept one: a chain of dependent adds), so another summation order than the other tiers'.
// Rows on AVX-512 are H floats in whole vectors (lanes past H are 0 in `row` and add nothing); f(i) of vector i.
template <typename F>
BF_TARGET_AVX512 BF_INLINE float sum4(int64_t vectors, F f) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t v = 0;
  for (; v + 4 <= vectors; v += 4) {
    s0 = _mm512_add_ps(s0, f(v));
    s1 = _mm512_add_ps(s1, f(v + 1));
    s2 = _mm512_add_ps(s2, f(v + 2));
    s3 = _mm512_add_ps(s3, f(v + 3));
  }
  for (; v < vectors; ++v) s0 = _mm512_add_ps(s0, f(v));
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

struct ShiftedRow {  // vector i of the row shifted, stored to `row` as it is summed
  const float *xr, *rr;
  float* row;
  __m512 shift;
  int64_t H;
  BF_TARGET_AVX512 BF_INLINE __m512 operator()(int64_t v) const {
    const __mmask16 m = tail_mask(H - 16 * v);
    __m512 x = _mm512_maskz_loadu_ps(m, xr + 16 * v);
    if (rr != nullptr) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, rr + 16 * v));
    x = _mm512_maskz_sub_ps(m, x, shift);
    _mm512_storeu_ps(row + 16 * v, x);
    return x;
  }
};

struct Squares {  // (row - mean)^2 of vector i, lanes past H 0
  const float* row;
  __m512 mean;
  int64_t H;
  BF_TARGET_AVX512 BF_INLINE __m512 operator()(int64_t v) const {
    const __m512 c = _mm512_maskz_sub_ps(tail_mask(H - 16 * v), _mm512_loadu_ps(row + 16 * v), mean);
    return _mm512_mul_ps(c, c);
  }
};

BF_TARGET_AVX512 void layernorm_rows512(const float* x, const float* residual, const float* gamma, const float* beta,
                                        float eps, int64_t lo, int64_t hi, int64_t H, float* out, float* row) {
  const int64_t vectors = (H + 15) / 16;
  for (int64_t t = lo; t < hi; ++t) {
    const float* xr = x + t * H;
    const float* rr = residual != nullptr ? residual + t * H : nullptr;
    const __m512 shift = _mm512_set1_ps(xr[0] + 0.f + (rr != nullptr ? rr[0] : 0.f));
    const float mean = sum4(vectors, ShiftedRow{xr, rr, row, shift, H}) / float(H);
    const __m512 mv = _mm512_set1_ps(mean);
    const __m512 rstd = _mm512_set1_ps(1.0f / std::sqrt(sum4(vectors, Squares{row, mv, H}) / float(H) + eps));
    float* o = out + t * H;
    for (int64_t i = 0; i < H; i += 16) {
      const __mmask16 m = tail_mask(H - i);
      const __m512 n = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row + i), mv), rstd);
      _mm512_mask_storeu_ps(o + i, m,
                            _mm512_fmadd_ps(n, _mm512_maskz_loadu_ps(m, gamma + i), _mm512_maskz_loadu_ps(m, beta + i)));
    }
  }
}

template <typename T>
BF_TARGET_AVX512 void layernorm_avx512(const T* x, const T* residual, const T* gamma, const T* beta, float eps,
                                       int64_t lo, int64_t hi, int64_t H, T* out, float* row) {
  if constexpr (sizeof(T) == 4) {
    layernorm_rows512(x, residual, gamma, beta, eps, lo, hi, H, out, row);
  } else {
    layernorm_rows(x, residual, gamma, beta, eps, lo, hi, H, out, row);
  }
}
#endif

template <typename T>
void layernorm_generic(const T* x, const T* residual, const T* gamma, const T* beta, float eps, int64_t lo,
                       int64_t hi, int64_t H, T* out, float* row) {
  layernorm_rows(x, residual, gamma, beta, eps, lo, hi, H, out, row);
}

}  // namespace

template <typename T>
void layernorm(const T* x, const T* residual, const T* gamma, const T* beta, float eps,
               int64_t tokens, int64_t hidden, T* out) {
  const int nt = threads_for(tokens * hidden);
  parallel_for(nt, nt, [&](int64_t part) {
    int64_t lo, hi;
    split_range(tokens, int(part), nt, &lo, &hi);
    std::vector<float> row((hidden + 15) / 16 * 16);  // whole vectors on AVX-512
    BF_DISPATCH(layernorm, x, residual, gamma, beta, eps, lo, hi, hidden, out, row.data());
  });
}

void layernorm_then(float* x, const float* gamma, const float* beta, float eps, int64_t T, int64_t H,
                    const std::function<void(int64_t lo, int64_t hi)>& then) {
  constexpr int64_t kChunk = 16;  // rows normalized, then handed on while they are in L1
  const int nt = threads_for(T * H);
  parallel_for(nt, nt, [&](int64_t part) {
    int64_t lo, hi;
    split_range(T, int(part), nt, &lo, &hi);
    for (int64_t c = lo; c < hi; c += kChunk) {
      const int64_t e = std::min(hi, c + kChunk);
      layernorm_rows_here(x, gamma, beta, eps, c, e, H);
      then(c, e);
    }
  });
}

void layernorm_rows_here(float* x, const float* gamma, const float* beta, float eps, int64_t lo, int64_t hi,
                         int64_t H) {
  static thread_local std::vector<float> row;
  row.resize((H + 15) / 16 * 16);  // whole vectors on AVX-512
  // as layernorm<float>: no residual, no denormal flushing
  BF_DISPATCH(layernorm, x, static_cast<const float*>(nullptr), gamma, beta, eps, lo, hi, H, x, row.data());
}

template void layernorm<float>(const float*, const float*, const float*, const float*, float, int64_t, int64_t,
                               float*);
template void layernorm<bf16>(const bf16*, const bf16*, const bf16*, const bf16*, float, int64_t, int64_t, bf16*);

}  // namespace cpu
}  // namespace bertfast
