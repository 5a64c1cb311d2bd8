// pack_int8: an int8 (N, K) weight into the int8 GEMM's layout ([N/16][K/4][16][4], zero padded), once at load.
#include "cpu/common/kernels.h"

namespace bertfast {
namespace cpu {

int64_t int8_packed_numel(int64_t n, int64_t k) { return (n + 15) / 16 * ((k + 3) / 4) * 64; }

void pack_int8(const int8_t* w, int64_t n, int64_t k, int8_t* packed) {
  const int64_t k4 = (k + 3) / 4, panels = (n + 15) / 16;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t g = 0; g < k4; ++g)
      for (int64_t c = 0; c < 16; ++c)
        for (int64_t e = 0; e < 4; ++e) {
          const int64_t row = p * 16 + c, col = g * 4 + e;
          packed[((p * k4 + g) * 16 + c) * 4 + e] = (row < n && col < k) ? w[row * k + col] : int8_t(0);
        }
}

}  // namespace cpu
}  // namespace bertfast
