// Element types of the kernels: bf16 storage and its fp32 conversions (round to nearest even, NaN kept).
//
// All math is fp32 whatever the storage type; bf16 is rounded once, on store.
#pragma once

#include <cstdint>
#include <cstring>

#define BF_INLINE inline __attribute__((always_inline))

namespace bertfast {
namespace cpu {

struct bf16 {
  uint16_t bits;
};

BF_INLINE float to_float(float x) { return x; }
BF_INLINE float to_float(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
BF_INLINE T from_float(float f);
template <>
BF_INLINE float from_float<float>(float f) {
  return f;
}
template <>
BF_INLINE bf16 from_float<bf16>(float f) {
  // Round to nearest even like torch; a NaN stays a (quiet) NaN instead of rounding into infinity.
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return bf16{uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded)};
}

}  // namespace cpu
}  // namespace bertfast
