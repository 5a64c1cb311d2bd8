// Scalar fp32 math the kernels share: exp, GELU (erf, tanh), tanh, the activations, a LayerNorm row's end.
//
// Branch-free, so loops over them vectorize in the caller's ISA.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/common/activation.h"
#include "cpu/common/types.h"

namespace bertfast {
namespace cpu {

// The end of a portable LayerNorm row: `row` holds the H values shifted by a constant and `sum` their
// sum; two-pass variance on the shifted row, then out = (row - mean) * rstd * gamma + beta.
template <typename T>
BF_INLINE void normalize_row(const float* row, float sum, int64_t H, float eps, const T* gamma, const T* beta,
                             T* out) {
  const float mean = sum / float(H);
  float var = 0.f;
#pragma omp simd reduction(+ : var)
  for (int64_t i = 0; i < H; ++i) {
    float c = row[i] - mean;
    var += c * c;
  }
  const float rstd = 1.0f / std::sqrt(var / float(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = from_float<T>((row[i] - mean) * rstd * to_float(gamma[i]) + to_float(beta[i]));
}

// exp(x) in fp32, ~1 ulp on the range softmax/GELU use; branch-free so loops over it vectorize.
// Inputs below -87.3 return ~1e-38 instead of 0 (harmless for softmax weights and erfc tails).
// exp and its 8- and 16-lane forms (exp256, exp512 in vec_math.h), one set of numbers: clamp to the float
// range, Cody-Waite reduction by ln 2 (hi + lo), Taylor to r^7 (1/5040 first: below 1 ulp on |r| <= ln2/2,
// Horner), scale by 2^n.
constexpr float kExpMin = -87.3f, kExpMax = 88.7f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
constexpr float kExpPoly[] = {1.9841270e-4f, 1.3888889e-3f, 8.3333333e-3f, 4.1666667e-2f,
                              1.6666667e-1f, 0.5f,          1.0f,          1.0f};

BF_INLINE float exp_f(float x) {
  x = x < kExpMin ? kExpMin : x;
  x = x > kExpMax ? kExpMax : x;
  float n = (x * kLog2e + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpPoly[0];
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = p * r + kExpPoly[i];
  uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// Exact GELU, 0.5 x (1 + erf(x / sqrt 2)), through erfc with the Chebyshev fit of Numerical Recipes
// (fractional error < 1.2e-7): x < 0 uses 0.5 x erfc(|x|/sqrt 2) directly, so no cancellation.
BF_INLINE float gelu_erf(float x) {
  const float z_abs = (x < 0.f ? -x : x) * 0.70710678118654752f;
  // erfc(z) < 4.2e-37 past z = 9: taken as 0 there, and z clamped so no intermediate is denormal.
  const float z = z_abs > 9.0f ? 9.0f : z_abs;
  float t = 1.0f / (1.0f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  float erfc_z = t * exp_f(p - z * z);
  erfc_z = z_abs > 9.0f ? 0.0f : erfc_z;
  return x >= 0.f ? x * (1.0f - 0.5f * erfc_z) : 0.5f * x * erfc_z;
}

// gelu_erf of 16 floats at v, in place: the same operations, so the same numbers, as gelu_erf on each, on
// four 4-lane vectors (GCC/Clang vector extensions) whose steps alternate, so that four independent chains
// of its ~150 cycles of dependent operations are in flight from the instruction order itself (the x86
// compilers do not reorder for that). One chain at a time, as the vectorized loop over gelu_erf had it,
// left the loop waiting on latency.
BF_INLINE void gelu_erf16(float* v) {
  using f4 = float __attribute__((vector_size(16)));
  using i4 = int32_t __attribute__((vector_size(16)));
  constexpr int U = 4;
  f4 x[U], z_abs[U], z[U], t[U], p[U], n[U], r[U];
#define BF_EACH _Pragma("GCC unroll 4") for (int u = 0; u < U; ++u)
  BF_EACH std::memcpy(&x[u], v + 4 * u, sizeof(f4));
  BF_EACH z_abs[u] = (x[u] < 0.f ? -x[u] : x[u]) * 0.70710678118654752f;
  BF_EACH z[u] = z_abs[u] > 9.0f ? f4{} + 9.0f : z_abs[u];
  BF_EACH t[u] = 1.0f / (1.0f + 0.5f * z[u]);
  static constexpr float kErfc[] = {0.17087277f,  -0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f,
                                    -0.18628806f, 0.09678418f,  0.37409196f, 1.00002368f,  -1.26551223f};
  BF_EACH p[u] = f4{} + kErfc[0];
#pragma GCC unroll 9
  for (int i = 1; i < 10; ++i) BF_EACH p[u] = p[u] * t[u] + kErfc[i];
  // exp_f(p - z * z), step by step
  BF_EACH p[u] = p[u] - z[u] * z[u];
  BF_EACH p[u] = p[u] < kExpMin ? f4{} + kExpMin : p[u];
  BF_EACH p[u] = p[u] > kExpMax ? f4{} + kExpMax : p[u];
  BF_EACH n[u] = (p[u] * kLog2e + 12582912.0f) - 12582912.0f;
  BF_EACH r[u] = p[u] - n[u] * kLn2Hi;
  BF_EACH r[u] = r[u] - n[u] * kLn2Lo;
  BF_EACH p[u] = f4{} + kExpPoly[0];
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) BF_EACH p[u] = p[u] * r[u] + kExpPoly[i];
  BF_EACH {
    const i4 bits = (__builtin_convertvector(n[u], i4) + 127) << 23;
    f4 scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    p[u] = t[u] * (p[u] * scale);  // erfc(z)
  }
  BF_EACH p[u] = z_abs[u] > 9.0f ? f4{} : p[u];
  BF_EACH x[u] = x[u] >= 0.f ? x[u] * (1.0f - 0.5f * p[u]) : 0.5f * x[u] * p[u];
  BF_EACH std::memcpy(v + 4 * u, &x[u], sizeof(f4));
#undef BF_EACH
}

BF_INLINE float tanh_f(float y) {
  float a = y < 0.f ? -y : y;
  a = a > 9.0f ? 9.0f : a;  // tanh(9) rounds to 1 in fp32; larger |y| would only make denormals
  float e = exp_f(2.0f * a);
  float t = 1.0f - 2.0f / (e + 1.0f);
  return y < 0.f ? -t : t;
}

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
BF_INLINE float gelu_tanh(float x) {
  float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + tanh_f(y));
}

// SiLU (swish), x sigmoid(x) = x / (1 + exp(-x)). Below -88.7 exp_f(-x) is clamped, so x times 0 there:
// -0 as torch gives for finite x, NaN for -inf (as torch).
BF_INLINE float silu(float x) { return x < -kExpMax ? x * 0.f : x / (1.0f + exp_f(-x)); }

// v[j] = act(v[j]) for j in [0, n), a straight vectorizable loop per activation (force-inlined, so the loops
// are compiled for the caller's ISA).
template <typename Count>
BF_INLINE void activate(float* v, Count n, Activation act) {
  switch (act) {
    case Activation::Gelu: {
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) gelu_erf16(v + j);
#pragma omp simd
      for (int64_t i = j; i < n; ++i) v[i] = gelu_erf(v[i]);
      break;
    }
    case Activation::GeluTanh:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) v[j] = gelu_tanh(v[j]);
      break;
    case Activation::Relu:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) v[j] = v[j] > 0.f ? v[j] : 0.f;
      break;
    case Activation::Tanh:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) v[j] = tanh_f(v[j]);
      break;
    case Activation::Silu:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) v[j] = silu(v[j]);
      break;
    default:
      break;
  }
}

BF_INLINE float apply_act(float x, Activation act) {
  switch (act) {
    case Activation::Gelu:
      return gelu_erf(x);
    case Activation::GeluTanh:
      return gelu_tanh(x);
    case Activation::Relu:
      return x > 0.f ? x : 0.f;
    case Activation::Tanh:
      return tanh_f(x);
    case Activation::Silu:
      return silu(x);
    default:
      return x;
  }
}

}  // namespace cpu
}  // namespace bertfast
