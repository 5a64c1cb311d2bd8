// fp32 rows to bf16: a bf16 GEMM's operands from the fp32 residual stream of a bf16 forward (layer.cpp,
// `_C.linear` on fp32 x with bf16 weights). Round to nearest even, bit for bit as torch's .to(torch.bfloat16),
// so the whole layer and the ops composed from Python agree.
#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/common/simd.h"

namespace bertfast {
namespace cpu {
namespace {

BF_INLINE void convert_rows(const float* x, int64_t ldx, int64_t lo, int64_t hi, int64_t K, bf16* out) {
  for (int64_t m = lo; m < hi; ++m) {
    const float* xr = x + m * ldx;
    bf16* o = out + m * K;
#pragma omp simd
    for (int64_t j = 0; j < K; ++j) o[j] = from_float<bf16>(xr[j]);
  }
}

#if BF_X86
// 16 lanes at a time through store16 (simd.h: the same rounding as from_float<bf16>): the auto-vectorized loop
// lagged far behind torch's .to(torch.bfloat16) (benchmarks/results/2026-12-06-native-notes).
BF_TARGET_AVX512 void convert_avx512(const float* x, int64_t ldx, int64_t lo, int64_t hi, int64_t K, bf16* out) {
  for (int64_t m = lo; m < hi; ++m) {
    const float* xr = x + m * ldx;
    bf16* o = out + m * K;
    for (int64_t j = 0; j < K; j += 16) {
      const __mmask16 mk = tail_mask(K - j);
      store16(o + j, _mm512_maskz_loadu_ps(mk, xr + j), mk);
    }
  }
}
BF_TARGET_AVX2 void convert_avx2(const float* x, int64_t ldx, int64_t lo, int64_t hi, int64_t K, bf16* out) {
  convert_rows(x, ldx, lo, hi, K, out);
}
#endif
void convert_generic(const float* x, int64_t ldx, int64_t lo, int64_t hi, int64_t K, bf16* out) {
  convert_rows(x, ldx, lo, hi, K, out);
}

}  // namespace

void layernorm_to_bf16(float* x, const float* gamma, const float* beta, float eps, int64_t T, int64_t H, bf16* out) {
  layernorm_then(x, gamma, beta, eps, T, H,
                 [&](int64_t lo, int64_t hi) { BF_DISPATCH(convert, x, H, lo, hi, H, out); });
}

void to_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, bf16* out) {
  const int nt = threads_for(M * K);
  parallel_for(nt, nt, [&](int64_t part) {
    int64_t lo, hi;
    split_range(M, int(part), nt, &lo, &hi);
    BF_DISPATCH(convert, x, ldx, lo, hi, K, out);
  });
}

}  // namespace cpu
}  // namespace bertfast
