// Int8 dynamic quantization around the int8 GEMM (bertfast/quant.py): per-token asymmetric quantization of
// fp32 activations, and the epilogue that turns the GEMM's fp32 output back into the layer's result.
//
// quantize_rows: one read of each row for min/max (it is then in L1/L2), one more to write the codes; the
// math is the fp32 sequence of quant.quantize_rows_reference, so the codes are bitwise equal to it.
// int8_epilogue: out = act(xs[m] * (out - zp[m] * colsum[n]) + bias[n]) + residual, in place, one pass
// (after oneDNN's int8 GEMM, used for large token counts).
// int8_linear_small: the whole int8 linear for small token counts, epilogue fused, on weights packed at
// load: AMX-int8 tiles, AVX512-VNNI, or a portable loop, chosen at run time.
#include <omp.h>

#include <cmath>
#include <algorithm>
#include <atomic>
#include <vector>
#include <limits>

#include "common.h"
#include "parallel.h"

namespace bertfast {
namespace cpu {
namespace {

// Per-row parameters from the row's min and max (shared by both ISAs so they agree bit for bit).
struct RowQuant {
  float scale, inv;
  int32_t zero_point;
  bool finite;
};

BF_INLINE RowQuant row_params(float lo, float hi, bool has_nan) {
  lo = lo < 0.f ? lo : 0.f;
  hi = hi > 0.f ? hi : 0.f;
  const float span = hi - lo;
  RowQuant r;
  r.scale = has_nan ? std::numeric_limits<float>::quiet_NaN() : (span == 0.f ? 1.0f : span / 255.0f);
  r.inv = 1.0f / r.scale;
  r.finite = std::isfinite(r.scale);
  float zp = r.finite ? -128.0f - std::nearbyint(lo * r.inv) : 0.0f;  // nearbyint: half to even
  zp = zp < -128.f ? -128.f : (zp > 127.f ? 127.f : zp);
  r.zero_point = int32_t(zp);
  return r;
}

BF_INLINE int8_t code(float x, const RowQuant& r) {
  float v = std::nearbyint(x * r.inv) + float(r.zero_point);
  v = v < -128.f ? -128.f : (v > 127.f ? 127.f : v);
  return r.finite ? int8_t(v) : int8_t(0);
}

void quantize_rows_range_generic(const float* x, int64_t ldx, int64_t lo_row, int64_t hi_row, int64_t K, int8_t* q,
                                 float* scale, int32_t* zp) {
  for (int64_t m = lo_row; m < hi_row; ++m) {
    const float* row = x + m * ldx;
    float lo = 0.f, hi = 0.f;
    bool nan = false;
    for (int64_t k = 0; k < K; ++k) {
      const float v = row[k];
      nan |= v != v;
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    const RowQuant r = row_params(lo, hi, nan);
    int8_t* qr = q + m * K;
    for (int64_t k = 0; k < K; ++k) qr[k] = code(row[k], r);
    scale[m] = r.scale;
    zp[m] = r.zero_point;
  }
}

template <Act ACT>
BF_INLINE void epilogue_rows_generic(float* out, int64_t lo_row, int64_t hi_row, int64_t N, const float* xs,
                                     const int32_t* zp, const float* colsum, const float* bias,
                                     const float* residual, int64_t ldr) {
  for (int64_t m = lo_row; m < hi_row; ++m) {
    float* o = out + m * N;
    const float s = xs[m], z = float(zp[m]);
    const float* r = residual != nullptr ? residual + m * ldr : nullptr;
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) {
      float v = s * (o[n] - z * colsum[n]) + (bias != nullptr ? bias[n] : 0.f);
      v = apply_act(v, ACT);
      o[n] = r != nullptr ? v + r[n] : v;
    }
  }
}

void epilogue_range_generic(float* out, int64_t lo_row, int64_t hi_row, int64_t N, const float* xs, const int32_t* zp,
                            const float* colsum, const float* bias, Act act, const float* residual, int64_t ldr) {
  switch (act) {
    case Act::Gelu:
      return epilogue_rows_generic<Act::Gelu>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    case Act::GeluTanh:
      return epilogue_rows_generic<Act::GeluTanh>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    case Act::Relu:
      return epilogue_rows_generic<Act::Relu>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    case Act::Tanh:
      return epilogue_rows_generic<Act::Tanh>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    default:
      return epilogue_rows_generic<Act::None>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
  }
}

#if BF_X86
BF_TARGET_AVX2 void quantize_rows_range_avx2(const float* x, int64_t ldx, int64_t lo_row, int64_t hi_row, int64_t K,
                                             int8_t* q, float* scale, int32_t* zp) {
  quantize_rows_range_generic(x, ldx, lo_row, hi_row, K, q, scale, zp);
}

BF_TARGET_AVX2 void epilogue_range_avx2(float* out, int64_t lo_row, int64_t hi_row, int64_t N, const float* xs,
                                        const int32_t* zp, const float* colsum, const float* bias, Act act,
                                        const float* residual, int64_t ldr) {
  epilogue_range_generic(out, lo_row, hi_row, N, xs, zp, colsum, bias, act, residual, ldr);
}

BF_TARGET_AVX512 void quantize_rows_range_avx512(const float* x, int64_t ldx, int64_t lo_row, int64_t hi_row,
                                                 int64_t K, int8_t* q, float* scale, int32_t* zp) {
  for (int64_t m = lo_row; m < hi_row; ++m) {
    const float* row = x + m * ldx;
    __m512 vlo = _mm512_setzero_ps(), vhi = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(tail_mask(K - k), row + k);  // masked lanes read 0: harmless
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vlo = _mm512_min_ps(vlo, v);
      vhi = _mm512_max_ps(vhi, v);
    }
    const RowQuant r = row_params(_mm512_reduce_min_ps(vlo), _mm512_reduce_max_ps(vhi), nan != 0);
    int8_t* qr = q + m * K;
    if (!r.finite) {
      std::memset(qr, 0, size_t(K));
    } else {
      const __m512 inv = _mm512_set1_ps(r.inv);
      const __m512i z = _mm512_set1_epi32(r.zero_point);
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mk = tail_mask(K - k);
        const __m512 v = _mm512_maskz_loadu_ps(mk, row + k);
        const __m512 rounded = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        // |x * inv| <= 255 after the row's own min/max, so the int32 conversion is exact; the add and the
        // signed saturation to int8 give clamp(round(x * inv) + zp, -128, 127).
        const __m512i c = _mm512_add_epi32(_mm512_cvtps_epi32(rounded), z);
        _mm_mask_storeu_epi8(qr + k, mk, _mm512_cvtsepi32_epi8(c));
      }
    }
    scale[m] = r.scale;
    zp[m] = r.zero_point;
  }
}

template <Act ACT>
BF_TARGET_AVX512 void epilogue_rows_avx512(float* out, int64_t lo_row, int64_t hi_row, int64_t N, const float* xs,
                                           const int32_t* zp, const float* colsum, const float* bias,
                                           const float* residual, int64_t ldr) {
  for (int64_t m = lo_row; m < hi_row; ++m) {
    float* o = out + m * N;
    const __m512 s = _mm512_set1_ps(xs[m]), z = _mm512_set1_ps(float(zp[m]));
    const float* r = residual != nullptr ? residual + m * ldr : nullptr;
    for (int64_t n = 0; n < N; n += 16) {
      const __mmask16 mk = tail_mask(N - n);
      const __m512 centred = _mm512_fnmadd_ps(z, _mm512_maskz_loadu_ps(mk, colsum + n), _mm512_maskz_loadu_ps(mk, o + n));
      const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mk, bias + n) : _mm512_setzero_ps();
      __m512 v = act512<ACT>(_mm512_fmadd_ps(s, centred, b));
      if (r != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, r + n));
      _mm512_mask_storeu_ps(o + n, mk, v);
    }
  }
}

BF_TARGET_AVX512 void epilogue_range_avx512(float* out, int64_t lo_row, int64_t hi_row, int64_t N, const float* xs,
                                            const int32_t* zp, const float* colsum, const float* bias, Act act,
                                            const float* residual, int64_t ldr) {
  switch (act) {
    case Act::None:
      return epilogue_rows_avx512<Act::None>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    case Act::Gelu:
      return epilogue_rows_avx512<Act::Gelu>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    case Act::Relu:
      return epilogue_rows_avx512<Act::Relu>(out, lo_row, hi_row, N, xs, zp, colsum, bias, residual, ldr);
    default:  // tanh-GELU and tanh: the portable loop (auto-vectorized) is fast enough for them
      return epilogue_range_generic(out, lo_row, hi_row, N, xs, zp, colsum, bias, act, residual, ldr);
  }
}
#endif

}  // namespace

void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* scale, int32_t* zp) {
  // Threads only for large inputs: a short call is not worth waking another thread.
  const int nt = M * K >= (int64_t(1) << 20) ? num_threads() : 1;
  parallel_for(nt, nt, [&](int64_t part) {
    DenormalGuard ftz;
    int64_t lo, hi;
    split_range(M, int(part), nt, &lo, &hi);
    BF_DISPATCH(quantize_rows_range, x, ldx, lo, hi, K, q, scale, zp);
  });
}

void int8_epilogue(float* out, int64_t M, int64_t N, const float* xs, const int32_t* zp, const float* colsum,
                   const float* bias, Act act, const float* residual, int64_t ldr) {
  const int64_t cost = act == Act::None || act == Act::Relu ? 4 : 16;
  const int nt = threads_for(M * N * cost);
  parallel_for(nt, nt, [&](int64_t part) {
    DenormalGuard ftz;
    int64_t lo, hi;
    split_range(M, int(part), nt, &lo, &hi);
    BF_DISPATCH(epilogue_range, out, lo, hi, N, xs, zp, colsum, bias, act, residual, ldr);
  });
}

}  // namespace cpu
}  // namespace bertfast

// ---- Small-M int8 GEMM with the epilogue fused (AMX-int8 / AVX512-VNNI vpdpbusd / portable loop) ----
//
// At a few tokens the int8 GEMM only streams weights: oneDNN's kernel reads them at ~7 GB/s on one core
// here, below what the core can pull. This kernel reads each weight byte once per block of MR rows,
// from a layout made at load: panels of 16 output columns, groups of 4 along K, [N/16][K/4][16][4] int8,
// zero padded, so one 64-byte load feeds one vpdpbusd for 16 columns. vpdpbusd multiplies unsigned by
// signed bytes: the activation codes are made unsigned by flipping their top bit (q + 128), and the
// epilogue subtracts (zp + 128) * colsum instead of zp * colsum, which is the same correction.
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

namespace {

struct SmallArgs {
  const int8_t* x;
  int64_t ldx, M, K;
  const float* xs;
  const int32_t* zp;
  const int8_t* packed;
  int64_t N;
  const float* ws;
  const float* colsum;
  const float* bias;
  Act act;
  const float* residual;
  int64_t ldr;
  float* out;
};

// The 4 codes of row `r` at group g as unsigned bytes (q + 128 == q ^ 0x80), zero padded past K.
BF_INLINE uint32_t codes4(const int8_t* row, int64_t g, int64_t K) {
  uint32_t v = 0x80808080u;  // padding: code 0 -> 128, times a zero weight
  if (g * 4 + 4 <= K) {
    std::memcpy(&v, row + g * 4, 4);
    return v ^ 0x80808080u;
  }
  uint8_t b[4] = {0x80, 0x80, 0x80, 0x80};
  for (int64_t e = 0; g * 4 + e < K; ++e) b[e] = uint8_t(row[g * 4 + e]) ^ 0x80u;
  std::memcpy(&v, b, 4);
  return v;
}

// One output element from its int32 accumulator (unsigned codes), shared by both paths' tails.
BF_INLINE float finish(int32_t acc, int64_t m, int64_t n, const SmallArgs& a) {
  const float o = float(acc) * a.ws[n];
  float v = a.xs[m] * (o - float(a.zp[m] + 128) * a.colsum[n]) + (a.bias != nullptr ? a.bias[n] : 0.f);
  v = apply_act(v, a.act);
  return a.residual != nullptr ? v + a.residual[m * a.ldr + n] : v;
}

void small_panels_generic(const SmallArgs& a, int64_t p0, int64_t p1) {
  const int64_t k4 = (a.K + 3) / 4;
  for (int64_t m = 0; m < a.M; ++m) {
    const int8_t* row = a.x + m * a.ldx;
    for (int64_t p = p0; p < p1; ++p) {
      int32_t acc[16] = {0};
      for (int64_t g = 0; g < k4; ++g) {
        const uint32_t c = codes4(row, g, a.K);
        const int8_t* w = a.packed + (p * k4 + g) * 64;
        for (int64_t j = 0; j < 16; ++j)
          for (int64_t e = 0; e < 4; ++e) acc[j] += int32_t((c >> (8 * e)) & 0xffu) * int32_t(w[j * 4 + e]);
      }
      for (int64_t j = 0; j < 16 && p * 16 + j < a.N; ++j) a.out[m * a.N + p * 16 + j] = finish(acc[j], m, p * 16 + j, a);
    }
  }
}

#if BF_X86
#define BF_TARGET_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2,prefer-vector-width=512")))


template <int MR, int NP>
BF_TARGET_VNNI BF_INLINE void small_block_vnni(const SmallArgs& a, int64_t m0, int64_t p0) {
  const int64_t k4 = (a.K + 3) / 4, k4_full = a.K / 4;
  __m512i acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_si512();
  const int8_t* rows[MR];
  for (int r = 0; r < MR; ++r) rows[r] = a.x + (m0 + r) * a.ldx;
  const int8_t* wp = a.packed + p0 * k4 * 64;
  const __m512i flip = _mm512_set1_epi32(int32_t(0x80808080u));
  for (int64_t g = 0; g < k4_full; ++g) {
    __m512i w[NP];
    for (int j = 0; j < NP; ++j) w[j] = _mm512_loadu_si512(wp + (j * k4 + g) * 64);
    for (int r = 0; r < MR; ++r) {
      int32_t c;
      std::memcpy(&c, rows[r] + g * 4, 4);
      const __m512i xv = _mm512_xor_si512(_mm512_set1_epi32(c), flip);
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv, w[j]);
    }
  }
  if (k4 > k4_full) {  // K % 4 != 0: the last group, padded
    __m512i w[NP];
    for (int j = 0; j < NP; ++j) w[j] = _mm512_loadu_si512(wp + (j * k4 + k4_full) * 64);
    for (int r = 0; r < MR; ++r) {
      const __m512i xv = _mm512_set1_epi32(int32_t(codes4(rows[r], k4_full, a.K)));
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv, w[j]);
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t n0 = (p0 + j) * 16;
    const __mmask16 mk = a.N - n0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (a.N - n0)) - 1u);
    const __m512 ws = _mm512_maskz_loadu_ps(mk, a.ws + n0);
    const __m512 cs = _mm512_maskz_loadu_ps(mk, a.colsum + n0);
    const __m512 b = a.bias != nullptr ? _mm512_maskz_loadu_ps(mk, a.bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r;
      const __m512 o = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][j]), ws);
      const __m512 centred = _mm512_fnmadd_ps(_mm512_set1_ps(float(a.zp[m] + 128)), cs, o);
      __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(a.xs[m]), centred, b);
      float* dst = a.out + m * a.N + n0;
      if (a.act == Act::Gelu) {
        v = gelu_erf512(v);
      } else if (a.act == Act::Relu) {
        v = _mm512_max_ps(v, _mm512_setzero_ps());
      } else if (a.act != Act::None) {  // tanh-GELU, tanh: scalar, rare
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, v);
        for (int e = 0; e < 16; ++e) tmp[e] = apply_act(tmp[e], a.act);
        v = _mm512_load_ps(tmp);
      }
      if (a.residual != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, a.residual + m * a.ldr + n0));
      _mm512_mask_storeu_ps(dst, mk, v);
    }
  }
}

template <int NP>
BF_TARGET_VNNI void small_rows_vnni(const SmallArgs& a, int64_t p0) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) small_block_vnni<4, NP>(a, m, p0);
  switch (a.M - m) {
    case 3: small_block_vnni<3, NP>(a, m, p0); break;
    case 2: small_block_vnni<2, NP>(a, m, p0); break;
    case 1: small_block_vnni<1, NP>(a, m, p0); break;
    default: break;
  }
}

BF_TARGET_VNNI void small_panels_vnni(const SmallArgs& a, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + 4 <= p1; p += 4) small_rows_vnni<4>(a, p);
  switch (p1 - p) {
    case 3: small_rows_vnni<3>(a, p); break;
    case 2: small_rows_vnni<2>(a, p); break;
    case 1: small_rows_vnni<1>(a, p); break;
    default: break;
  }
}

// ---- AMX-int8: tdpbssd on signed codes (no flip: the epilogue subtracts zp * colsum) ----
// B tiles come straight from the packed layout: 16 groups of 4 along K for 16 columns are 16 rows of 64
// bytes, contiguous. Used when K is a multiple of 64 (one A tile row per 64 codes).
#define BF_TARGET_AMX_INT8                                                                                 \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c," \
                        "bmi2,prefer-vector-width=512")))



// Epilogue of one stored C block: rows [m0, m0 + mr), columns [n0, n0 + 16 * np) (signed codes: zp as is).
BF_TARGET_VNNI void amx_store(const int32_t* c, int mr, int np, int64_t m0, int64_t n0, const SmallArgs& a) {
  for (int j = 0; j < np; ++j) {
    const int64_t n = n0 + 16 * j;
    if (n >= a.N) break;
    const __mmask16 mk = a.N - n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (a.N - n)) - 1u);
    const __m512 ws = _mm512_maskz_loadu_ps(mk, a.ws + n);
    const __m512 cs = _mm512_maskz_loadu_ps(mk, a.colsum + n);
    const __m512 b = a.bias != nullptr ? _mm512_maskz_loadu_ps(mk, a.bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < mr; ++r) {
      const int64_t m = m0 + r;
      const __m512i acc = _mm512_loadu_si512(c + r * 48 + 16 * j);
      const __m512 o = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), ws);
      const __m512 centred = _mm512_fnmadd_ps(_mm512_set1_ps(float(a.zp[m])), cs, o);
      __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(a.xs[m]), centred, b);
      if (a.act == Act::Gelu) {
        v = gelu_erf512(v);
      } else if (a.act == Act::Relu) {
        v = _mm512_max_ps(v, _mm512_setzero_ps());
      } else if (a.act != Act::None) {
        alignas(64) float tmp[16];
        _mm512_store_ps(tmp, v);
        for (int e = 0; e < 16; ++e) tmp[e] = apply_act(tmp[e], a.act);
        v = _mm512_load_ps(tmp);
      }
      if (a.residual != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, a.residual + m * a.ldr + n));
      _mm512_mask_storeu_ps(a.out + m * a.N + n, mk, v);
    }
  }
}

BF_TARGET_AMX_INT8 void small_panels_amx(const SmallArgs& a, int64_t p0, int64_t p1) {
  const int64_t k4 = a.K / 4;
  alignas(64) int32_t c[16 * 48];
  int configured = -1;
  for (int64_t p = p0; p < p1; p += 3) {
    const int np = int(std::min<int64_t>(3, p1 - p));
    for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
      const int mr = int(std::min<int64_t>(16, a.M - m0));
      amx_begin_block(mr, &configured);
      const int8_t* xa = a.x + m0 * a.ldx;
      for (int64_t k0 = 0; k0 < a.K; k0 += 64) {
        const int8_t* b = a.packed + (p * k4 + k0 / 4) * 64;  // panel p, groups k0/4 .. k0/4 + 15
        const int64_t panel_bytes = k4 * 64;
        if (m0 == 0) {  // first sweep streams the weights: fetch the next step's ahead
          for (int j = 0; j < np; ++j)
            for (int l = 0; l < 1024; l += 64) _mm_prefetch(reinterpret_cast<const char*>(b + j * panel_bytes + 2048 + l), _MM_HINT_T0);
        }
        _tile_loadd(3, xa + k0, a.ldx);
        _tile_loadd(4, b, 64);
        _tile_dpbssd(0, 3, 4);
        if (np > 1) {
          _tile_loadd(5, b + panel_bytes, 64);
          _tile_dpbssd(1, 3, 5);
        }
        if (np > 2) {
          _tile_loadd(6, b + 2 * panel_bytes, 64);
          _tile_dpbssd(2, 3, 6);
        }
      }
      _tile_stored(0, c, 48 * 4);
      if (np > 1) _tile_stored(1, c + 16, 48 * 4);
      if (np > 2) _tile_stored(2, c + 32, 48 * 4);
      amx_store(c, mr, np, m0, p * 16, a);
    }
  }
  if (configured >= 0) _tile_release();
}
#endif

}  // namespace

void int8_linear_small(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const float* xs, const int32_t* zp,
                       const int8_t* packed, int64_t N, const float* ws, const float* colsum, const float* bias, Act act,
                       const float* residual, int64_t ldr, float* out) {
  const SmallArgs a{x, ldx, M, K, xs, zp, packed, N, ws, colsum, bias, act, residual, ldr, out};
  const int64_t panels = (N + 15) / 16;
  // Threads split the output columns in groups of 4 panels (64 columns), so each streams its own weights.
  const int64_t groups = (panels + 3) / 4;
  int path = 0;  // 0 portable, 1 VNNI, 2 AMX
#if BF_X86
  if (active_isa() >= Isa::Avx512Vnni) path = K % 64 == 0 && active_isa() == Isa::Amx ? 2 : 1;
#endif
  struct Ctx {
    const SmallArgs* a;
    int64_t panels;
    int path;
  } ctx{&a, panels, path};
  auto chunk = [](const void* c, int64_t g) {
    const Ctx& x = *static_cast<const Ctx*>(c);
    DenormalGuard ftz;
    const int64_t p0 = g * 4, p1 = std::min(x.panels, p0 + 4);
#if BF_X86
    if (x.path == 2) {
      small_panels_amx(*x.a, p0, p1);
    } else if (x.path == 1) {
      small_panels_vnni(*x.a, p0, p1);
    } else {
      small_panels_generic(*x.a, p0, p1);
    }
#else
    small_panels_generic(*x.a, p0, p1);
#endif
  };
  parallel_for(M * N * K < (int64_t(1) << 18) ? 1 : num_threads(), groups, [&](int64_t g) { chunk(&ctx, g); });
}

}  // namespace cpu
}  // namespace bertfast
