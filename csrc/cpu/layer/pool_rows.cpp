// Sentence pooling on the packed tokens a forward leaves (bertfast/sentence.py's pool_packed, which it replaces on
// the CPU): one call where each torch op is slow right after a forward (its caches cold to the Python between them). The same numbers as pool_packed's torch formulation, bit for bit: a sequence's tokens are summed in
// order in fp32 (as index_add_ adds them, one after another), then divided by the count (or its square root) as a
// float; the first token copied for cls. A sequence's vector depends on its own tokens alone. (No
// mean_sqrt_len_tokens: torch's sqrt of the count is not always the correctly rounded one, so pool_packed keeps that
// mode in torch.)
#include <cstring>

#include "cpu/common/kernels.h"

namespace bertfast {
namespace cpu {

void pool_rows(const float* x, int64_t ldx, int64_t H, const int32_t* cu_seqlens, int64_t batch, RowPooling mode,
               float* out) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lo = cu_seqlens[b], n = cu_seqlens[b + 1] - lo;
    float* o = out + b * H;
    if (mode == RowPooling::kCls) {
      if (n > 0) std::memcpy(o, x + lo * ldx, size_t(H) * sizeof(float));
      else std::memset(o, 0, size_t(H) * sizeof(float));
      continue;
    }
    std::memset(o, 0, size_t(H) * sizeof(float));
    for (int64_t t = lo; t < lo + n; ++t) {
      const float* r = x + t * ldx;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) o[h] += r[h];
    }
    const float count = n > 0 ? float(n) : 1e-9f;  // torch: count.clamp(min=1e-9), then a division
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) o[h] /= count;
  }
}

}  // namespace cpu
}  // namespace bertfast
