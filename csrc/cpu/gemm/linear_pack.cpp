// pack_linear: a (N, K) weight into the panels the GEMM streams (layout in kernels.h), once at load.
#include <cstring>

#include "cpu/common/kernels.h"

namespace bertfast {
namespace cpu {

int64_t packed_numel(int64_t n, int64_t k, bool is_bf16) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t kk = is_bf16 ? 2 * ((k + 1) / 2) : k;
  return panels * kk * kPanel;
}

template <typename T>
void pack_linear(const T* w, int64_t n, int64_t k, T* packed) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  constexpr bool kPairs = sizeof(T) == 2;
  const int64_t kk = kPairs ? 2 * ((k + 1) / 2) : k;
  std::memset(static_cast<void*>(packed), 0, sizeof(T) * panels * kk * kPanel);
  for (int64_t p = 0; p < panels; ++p) {
    T* dst = packed + p * kk * kPanel;
    for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) {
      const T* row = w + (p * kPanel + c) * k;
      for (int64_t j = 0; j < k; ++j) {
        if (kPairs)
          dst[((j / 2) * kPanel + c) * 2 + (j & 1)] = row[j];
        else
          dst[j * kPanel + c] = row[j];
      }
    }
  }
}
template void pack_linear<float>(const float*, int64_t, int64_t, float*);
template void pack_linear<bf16>(const bf16*, int64_t, int64_t, bf16*);

}  // namespace cpu
}  // namespace bertfast
