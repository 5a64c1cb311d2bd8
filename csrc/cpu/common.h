// Shared helpers of the native CPU kernels: element types, fp32 <-> bf16, vectorizable exp/GELU, ISA dispatch.
//
// Kernels are written once as always-inline templates over the element type and instantiated twice: inside
// a function marked BF_TARGET_AVX512 (GCC compiles it for AVX-512) and inside a plain function (the portable
// fallback: the baseline ISA of the build, e.g. SSE2 on x86-64 or NEON on aarch64). Which one runs is chosen
// at run time from the CPU's features (`active_isa`). Threads come from `parallel_for` (parallel.h), which
// calls that per-ISA function once per part of the work. All math is
// fp32 whatever the storage type; bf16 is rounded to nearest even once, on store.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

// BERTFAST_PORTABLE_ONLY builds the portable kernels alone (what a non-x86 build compiles).
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(BERTFAST_PORTABLE_ONLY)
#include <immintrin.h>
#endif

namespace bertfast {
namespace cpu {

struct bf16 {
  uint16_t bits;
};

enum class Act : int { None = 0, Gelu = 1, GeluTanh = 2, Relu = 3, Tanh = 4 };

// ISA tiers, lowest to highest; each tier's kernels need the features of the tiers below it too.
//   Portable:   the build's baseline (SSE2 on x86-64, NEON on aarch64), plain loops the compiler vectorizes.
//   Avx2:       AVX2 + FMA (+ F16C, BMI2).
//   Avx512Vnni: AVX-512 F/BW/VL/DQ + VNNI; AVX-512 BF16 used where present.
//   Amx:        the above + AVX-512 BF16 + AMX tiles (bf16, int8), granted by the OS.
enum class Isa : int { Portable = 0, Avx2 = 1, Avx512Vnni = 2, Amx = 3 };

// The best tier this CPU (and OS) supports.
Isa detected_isa();
// The tier the kernels dispatch to: the detected one, capped by BERTFAST_ISA at load or by set_isa.
Isa active_isa();
// Cap the kernels at `isa` (tests and benchmarks run every lower tier); false if the CPU lacks it.
bool set_isa(Isa isa);
bool isa_supported(Isa isa);
// The tier named by `name` ("amx", "avx512_vnni", "avx2", "portable"); false if no tier has that name.
bool parse_isa(const char* name, Isa* isa);
const char* isa_name(Isa isa);
// AVX-512 BF16 dot products (vdpbf16ps), used by the Avx512Vnni tier's bf16 GEMM where present.
bool has_avx512_bf16();
// Whether the CPU has AMX tiles and the OS granted this process their state (requested once).
bool amx_tiles_permitted();
int num_threads();

#define BF_INLINE inline __attribute__((always_inline))

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(BERTFAST_PORTABLE_ONLY)
#define BF_X86 1
// The Avx2 tier's kernels (the portable templates compiled for AVX2 + FMA, and AVX2 intrinsics).
#define BF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#define BF_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2,prefer-vector-width=512")))
#define BF_TARGET_AVX512BF16 \
  __attribute__((target(   \
      "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi2,prefer-vector-width=512")))
// AMX-BF16 kernels (tiles plus the AVX-512 BF16 code around them).
#define BF_TARGET_AMX                                                                                  \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c," \
                        "bmi2,prefer-vector-width=512")))
#else
#define BF_X86 0
#endif

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

// exp(x) in fp32, ~1 ulp on the range softmax/GELU use; branch-free so loops over it vectorize.
// Inputs below -87.3 return ~1e-38 instead of 0 (harmless for softmax weights and erfc tails).
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

// exp and its 8- and 16-lane forms (exp256, exp512), one set of numbers: clamp to the float range,
// Cody-Waite reduction by ln 2 (hi + lo), Taylor to r^7 (1/5040 first: below 1 ulp on |r| <= ln2/2, Horner),
// scale by 2^n.
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

BF_INLINE float apply_act(float x, Act act) {
  switch (act) {
    case Act::Gelu:
      return gelu_erf(x);
    case Act::GeluTanh:
      return gelu_tanh(x);
    case Act::Relu:
      return x > 0.f ? x : 0.f;
    case Act::Tanh:
      return tanh_f(x);
    default:
      return x;
  }
}

#if BF_X86
// ---- 16-lane AVX-512 versions of the above (same algorithms) and fp32 <-> storage conversions ----

// The tile configuration both AMX GEMMs (bf16 and int8) use: tmm0-2 accumulators and tmm3 the A tile,
// `rows` rows of 64 bytes; tmm4-6 B tiles, 16 rows of 64 bytes. Inlined into the AMX kernels.
struct alignas(64) AmxTileConfig {  // the 64-byte operand of LDTILECFG (palette 1)
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

__attribute__((target("amx-tile"))) BF_INLINE void amx_load_tile_config(int rows) {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = uint8_t(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Starts a 16-row block of either AMX GEMM: (re)configures the tiles when its row count differs from
// the one configured (`configured`, -1 at first) and zeroes the three accumulators tmm0-2.
__attribute__((target("amx-tile"))) BF_INLINE void amx_begin_block(int rows, int* configured) {
  if (rows != *configured) {
    amx_load_tile_config(rows);
    *configured = rows;
  }
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
}

// exp_f on 16 lanes (the same numbers, above).
BF_TARGET_AVX512 BF_INLINE __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  x = _mm512_min_ps(x, _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// exp_f on 8 lanes.
BF_TARGET_AVX2 BF_INLINE __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  x = _mm256_min_ps(x, _mm256_set1_ps(kExpMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// gelu_erf on 16 lanes; the division becomes rcp14 + one Newton step (relative error ~1e-8), which
// makes it ~2x faster than the auto-vectorized scalar version.
BF_TARGET_AVX512 BF_INLINE __m512 gelu_erf512(__m512 x) {
  const __m512 z_abs = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.70710678118654752f));
  const __m512 z = _mm512_min_ps(z_abs, _mm512_set1_ps(9.0f));
  const __m512 den = _mm512_fmadd_ps(z, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.0f));
  __m512 t = _mm512_rcp14_ps(den);
  t = _mm512_mul_ps(t, _mm512_fnmadd_ps(den, t, _mm512_set1_ps(2.0f)));
  __m512 p = _mm512_set1_ps(0.17087277f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.82215223f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.48851587f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.13520398f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.27886807f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.18628806f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.09678418f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.37409196f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.00002368f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.26551223f));
  __m512 erfc_z = _mm512_mul_ps(t, exp512(_mm512_fnmadd_ps(z, z, p)));
  erfc_z = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(z_abs, _mm512_set1_ps(9.0f), _CMP_LE_OQ), erfc_z);
  const __m512 half_x = _mm512_mul_ps(x, _mm512_set1_ps(0.5f));
  const __m512 neg = _mm512_mul_ps(half_x, erfc_z);                      // x < 0: 0.5 x erfc
  const __m512 pos = _mm512_sub_ps(x, neg);                               // x >= 0: x (1 - 0.5 erfc)
  const __mmask16 nonneg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
  // NaN lanes compare false and take `neg`, which is NaN as well.
  return _mm512_mask_blend_ps(nonneg, neg, pos);
}

// The activations with a 16-lane form (the epilogues of the int8 and blocked fp32 GEMMs); the others
// (tanh, tanh-GELU) go through the scalar functions.
template <Act ACT>
BF_TARGET_AVX512 BF_INLINE __m512 act512(__m512 v) {
  static_assert(ACT == Act::None || ACT == Act::Gelu || ACT == Act::Relu, "no 16-lane form");
  if constexpr (ACT == Act::Gelu) {
    return gelu_erf512(v);
  } else if constexpr (ACT == Act::Relu) {
    return _mm512_max_ps(v, _mm512_setzero_ps());
  } else {
    return v;
  }
}

// Lanes [0, left) of a 16-lane vector (all of them if left >= 16, none if left <= 0).
BF_TARGET_AVX512 BF_INLINE __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1u);
}

BF_TARGET_AVX512 BF_INLINE __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
BF_TARGET_AVX512 BF_INLINE __m512 load16(const bf16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
BF_TARGET_AVX512 BF_INLINE void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
BF_TARGET_AVX512 BF_INLINE void store16(bf16* p, __m512 v, __mmask16 m) {
  // Round to nearest even, NaN kept quiet, as from_float<bf16>.
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}
#endif

// Dispatch helper: `BF_DISPATCH(name, args)` calls name##_avx512 on the Avx512Vnni tier and above,
// name##_avx2 on Avx2, else name##_generic.
#if BF_X86
#define BF_DISPATCH(name, ...)                                                             \
  (::bertfast::cpu::active_isa() >= ::bertfast::cpu::Isa::Avx512Vnni ? name##_avx512(__VA_ARGS__) \
   : ::bertfast::cpu::active_isa() == ::bertfast::cpu::Isa::Avx2     ? name##_avx2(__VA_ARGS__)   \
                                                                     : name##_generic(__VA_ARGS__))
#else
#define BF_DISPATCH(name, ...) name##_generic(__VA_ARGS__)
#endif

// ---- kernel entry points (raw pointers; shapes and strides are validated in bindings.cpp) ----

// out[t, :] = LayerNorm(word[ids[t]] + type[types[t]] + pos[positions[t]]) ; types may be null.
template <typename T>
void embed(const int64_t* ids, const int64_t* positions, const int64_t* types, const T* word, const T* pos,
           const T* type, const T* gamma, const T* beta, float eps, int64_t tokens, int64_t hidden, T* out);

// out[t, :] = LayerNorm(x[t, :] + bias + residual[t, :]) with fp32 statistics; bias, residual may be null;
// out may alias x or residual.
template <typename T>
void layernorm(const T* x, const T* residual, const T* bias, const T* gamma, const T* beta, float eps,
               int64_t tokens, int64_t hidden, T* out);

// x[t, :] = act(x[t, :] + bias) in place; bias may be null.
template <typename T>
void bias_act(T* x, const T* bias, int64_t tokens, int64_t features, Act act);

// Varlen attention: q/k/v element (t, h, e) at ptr[t * row_stride + h * head_stride + e];
// out: [T, heads * head_dim] contiguous. bf16_products: fp32 inputs may run the two products on bf16
// operands (AMX; fp32 accumulation and softmax) where the CPU has it (the int8 path asks for it).
struct AttnStrides {
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
};
template <typename T>
void attention(const T* q, const T* k, const T* v, const AttnStrides& s, const int32_t* cu_seqlens,
               int64_t batch, int64_t heads, int64_t head_dim, float scale, T* out, bool bf16_products = false);

// GEMM on prepacked weights (linear.cpp): out[m, n] = act(x[m, :] . w[n, :] + bias[n]) + residual[m, n].
// Any M; out must not overlap x or residual. Built for few rows (streaming the weights); fp32 with
// AVX-512 also runs large M (blocked), bf16 and the portable kernels are meant for small M only.
// Packed layout: panels of kPanel output columns; fp32: [panels][K][kPanel]; bf16: [panels][ceil(K/2)][kPanel][2]
// (pairs along K for vdpbf16ps), zero padded in N and K.
constexpr int64_t kPanel = 48;
int64_t packed_numel(int64_t n, int64_t k, bool is_bf16);
template <typename T>
void pack_linear(const T* w, int64_t n, int64_t k, T* packed);
template <typename T>
void linear_packed(const T* x, int64_t ldx, const T* packed, const T* bias, const T* residual, int64_t ldr,
                    int64_t m, int64_t n, int64_t k, Act act, T* out, int64_t ldo);

// ---- int8 dynamic quantization (quant.cpp; used by bertfast/quant.py) ----

// Per-token asymmetric int8 quantization of x (M, K) fp32 with row stride ldx: q (M, K) int8 contiguous,
// scale (M,) fp32 and zero point (M,) int32 per row (the math of quant.quantize_rows_reference).
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* scale, int32_t* zp);
// out (M, N) fp32 in place: act(xs[m] * (out - zp[m] * colsum[n]) + bias[n]) + residual[m, n] (row stride ldr);
// bias and residual may be null.
void int8_epilogue(float* out, int64_t M, int64_t N, const float* xs, const int32_t* zp, const float* colsum,
                   const float* bias, Act act, const float* residual, int64_t ldr);
// Int8 GEMM (int8_linear.cpp), any M, on every tier: weights packed once by pack_int8 ([N/16][K/4][16][4] int8,
// zero padded); x the signed codes of quantize_rows; out (M, N) fp32 =
// act(xs[m] * (ws[n] * sum_k q[m, k] w[n, k] - zp[m] * colsum[n]) + bias[n]) + residual[m, n].
int64_t int8_packed_numel(int64_t n, int64_t k);
void pack_int8(const int8_t* w, int64_t n, int64_t k, int8_t* packed);
void int8_linear(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const float* xs, const int32_t* zp,
                 const int8_t* packed, int64_t N, const float* ws, const float* colsum, const float* bias, Act act,
                 const float* residual, int64_t ldr, float* out);

// ---- one post-LayerNorm encoder layer on the extension's GEMMs (layer.cpp) ----

// One GEMM of a layer: the weight packed by pack_linear (elements of T), or by pack_int8 (int8, T = float;
// then w_scale and colsum per output channel as int8_linear takes them); bias (N,).
template <typename T>
struct LayerGemm {
  const void* packed;
  const T* bias;
  const float* w_scale;
  const float* colsum;
};
template <typename T>
struct LayerPtrs {
  LayerGemm<T> qkv, attn_out, ffn_in, ffn_out;
  const T *attn_ln_weight, *attn_ln_bias, *ffn_ln_weight, *ffn_ln_bias;
  int64_t hidden, intermediate, heads;  // hidden = heads * head_dim
  float eps;
  Act act;
  bool int8;  // int8 GEMMs with x quantized per token (T = float), attention's products in bf16
};
// Scratch: work, layer_work_numel(T, H, I) elements of T; under int8 also x quantized for one GEMM
// (T * max(H, I) int8) with its per-token scale and zero point (T each).
constexpr int64_t layer_work_numel(int64_t tokens, int64_t hidden, int64_t intermediate) {
  return tokens * (5 * hidden + intermediate);
}
struct Int8Scratch {
  int8_t* q;
  float* scale;
  int32_t* zp;
};
// out (T, H) = the layer applied to x (T, H), sequences delimited by cu_seqlens.
template <typename T>
void encoder_layer(const T* x, int64_t tokens, const int32_t* cu_seqlens, int64_t batch, float scale,
                   const LayerPtrs<T>& w, T* work, const Int8Scratch& q8, T* out);

}  // namespace cpu
}  // namespace bertfast

namespace bertfast {
namespace cpu {

// Flushes denormals to zero (FTZ + DAZ) on this thread while in scope. exp/erfc tails and softmax
// weights of far-away keys produce values near 1e-38, and one denormal operand costs a ~100-cycle
// microcode assist on x86: unguarded, the erf-GELU of a GEMM output ran 5x slower. A flushed value
// is off by less than 1.2e-38 absolute. MXCSR is restored on exit (the threads are shared with torch).
struct DenormalGuard {
#if BF_X86
  unsigned int saved;
  DenormalGuard() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~DenormalGuard() { _mm_setcsr(saved); }
  DenormalGuard(const DenormalGuard&) = delete;
  DenormalGuard& operator=(const DenormalGuard&) = delete;
#else
  DenormalGuard() {}  // other ISAs: the kernels avoid denormals in exp/GELU by clamping instead
#endif
};

// Static split of [0, n) into nt contiguous chunks; chunk `tid` is [*lo, *hi).
BF_INLINE void split_range(int64_t n, int tid, int nt, int64_t* lo, int64_t* hi) {
  int64_t base = n / nt, rem = n % nt;
  *lo = tid * base + (tid < rem ? tid : rem);
  *hi = *lo + base + (tid < rem ? 1 : 0);
}

// Threads worth using for `work` elementwise operations: one thread below ~32k elements, where
// waking the OpenMP team costs more than it saves.
BF_INLINE int threads_for(int64_t work) { return work < 32768 ? 1 : num_threads(); }

}  // namespace cpu
}  // namespace bertfast
