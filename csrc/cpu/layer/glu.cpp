// The gate of a GLU FFN (GeGLU, SwiGLU): out[m, j] = act(h[m, j]) * h[m, N + j] for the (M, 2N) output of the
// FFN's first GEMM, rows [a | b]. The activation is the tier's GEMM epilogues' (activate512 on AVX-512, activate256 on
// avx2: erf-GELU from the piecewise fit of vec_math.h; activate, scalar_math.h, on the portable tier), computed in
// fp32 on a chunk of the row at a time and the product rounded once to the output type.
#include <omp.h>

#include <algorithm>

#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/common/scalar_math.h"
#include "cpu/common/vec_math.h"

namespace bertfast {
namespace cpu {
namespace {

constexpr int64_t kChunk = 256;  // columns per pass: the fp32 buffer stays on the stack, in L1

template <Lanes kLanes, typename T>
BF_INLINE void glu_rows(const T* h, int64_t ldh, int64_t lo, int64_t hi, int64_t N, Activation act, T* out) {
  float buf[kChunk];
  for (int64_t m = lo; m < hi; ++m) {
    const T* a = h + m * ldh;
    const T* b = a + N;
    T* o = out + m * N;
    for (int64_t j0 = 0; j0 < N; j0 += kChunk) {
      const int64_t n = std::min(kChunk, N - j0);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) buf[j] = to_float(a[j0 + j]);
      activate_lanes<kLanes>(buf, n, act);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j0 + j] = from_float<T>(buf[j] * to_float(b[j0 + j]));
    }
  }
}

#if BF_X86
template <typename T>
BF_TARGET_AVX2 void glu_avx2(const T* h, int64_t ldh, int64_t lo, int64_t hi, int64_t N, Activation act, T* out) {
  glu_rows<Lanes::Avx2>(h, ldh, lo, hi, N, act, out);
}

template <typename T>
BF_TARGET_AVX512 void glu_avx512(const T* h, int64_t ldh, int64_t lo, int64_t hi, int64_t N, Activation act, T* out) {
  glu_rows<Lanes::Avx512>(h, ldh, lo, hi, N, act, out);
}
#endif

template <typename T>
void glu_generic(const T* h, int64_t ldh, int64_t lo, int64_t hi, int64_t N, Activation act, T* out) {
  glu_rows<Lanes::Generic>(h, ldh, lo, hi, N, act, out);
}

}  // namespace

template <typename T>
void glu(const T* h, int64_t ldh, int64_t M, int64_t N, Activation act, T* out) {
  const int64_t cost = act == Activation::None || act == Activation::Relu ? 2 : 16;
  const int nt = threads_for(M * N * cost);
  parallel_for(nt, nt, [&](int64_t part) {
    DenormalGuard ftz;
    int64_t lo, hi;
    split_range(M, int(part), nt, &lo, &hi);
    BF_DISPATCH(glu, h, ldh, lo, hi, N, act, out);
  });
}

template void glu<float>(const float*, int64_t, int64_t, int64_t, Activation, float*);
template void glu<bf16>(const bf16*, int64_t, int64_t, int64_t, Activation, bf16*);

}  // namespace cpu
}  // namespace bertfast
