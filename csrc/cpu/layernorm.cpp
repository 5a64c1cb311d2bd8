// Residual + LayerNorm in one pass over each row, statistics in fp32 (two-pass mean/variance on
// the row held shifted in an fp32 buffer, so inputs far from zero do not cancel).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "isa.h"
#include "kernels.h"
#include "scalar_math.h"
#include "parallel.h"

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

template <typename T>
BF_TARGET_AVX512 void layernorm_avx512(const T* x, const T* residual, const T* gamma, const T* beta, float eps,
                                       int64_t lo, int64_t hi, int64_t H, T* out, float* row) {
  layernorm_rows(x, residual, gamma, beta, eps, lo, hi, H, out, row);
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
    std::vector<float> row(hidden);
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
    std::vector<float> row(H);  // the LayerNorm's scratch, once per thread
    for (int64_t c = lo; c < hi; c += kChunk) {
      const int64_t e = std::min(hi, c + kChunk);
      // as layernorm<float>: no residual, no denormal flushing
      BF_DISPATCH(layernorm, x, static_cast<const float*>(nullptr), gamma, beta, eps, c, e, H, x, row.data());
      then(c, e);
    }
  });
}

template void layernorm<float>(const float*, const float*, const float*, const float*, float, int64_t, int64_t,
                               float*);
template void layernorm<bf16>(const bf16*, const bf16*, const bf16*, const bf16*, float, int64_t, int64_t, bf16*);

}  // namespace cpu
}  // namespace bertfast
