// Int8 GEMM on weights packed at load, the dequantization epilogue fused (bertfast/quant.py):
//   out[m, n] = act(xs[m] * (ws[n] * sum_k q[m, k] w[n, k] - zp[m] * colsum[n]) + bias[n]) + residual[m, n]
// for activation codes q (per-token asymmetric int8, quantize_rows) and weights w (per-channel symmetric).
//
// Weights: panels of 16 output columns, groups of 4 along K, [N/16][K/4][16][4] int8, zero padded, so one
// 64-byte load feeds one vpdpbusd for 16 columns. vpdpbusd multiplies unsigned by signed bytes: the codes
// are made unsigned (q + 128 == q ^ 0x80) and the epilogue subtracts (zp + 128) * colsum instead of
// zp * colsum, the same correction. Every path sums exactly in int32, so the tiers differ at most in the
// epilogue's last bit. Paths, by tier (never a library's reference kernel):
//   amx, K % 64 == 0: AMX-int8 tiles (tdpbssd) on the signed codes, any M.
//   avx512_vnni: up to kStreamRows rows a 4 x 64 tile streams the weights (x flipped per broadcast); more
//     rows: x flipped once into an unsigned buffer, then row blocks x 64 columns in 6 x 64 register tiles.
//   avx2: x widened once to int16, weights sign-extended on the fly (vpmovsxbw), vpmaddwd: 6 x 8 tiles.
//   portable: x widened as for avx2; per panel the weights moved to k-contiguous rows, then 4 x 2 tiles of
//     dot products over k in plain loops (the compiler's pmaddwd / sdot reductions).
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "kernels.h"
#include "scalar_math.h"
#include "simd.h"
#include "vec_math.h"
#include "parallel.h"

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

struct Int8Args {
  const int8_t* x;
  int64_t ldx, M, K;
  const float* xs;
  const int32_t* zp;
  const int8_t* packed;
  int64_t N;
  const float* ws;
  const float* colsum;
  const float* bias;
  Activation act;
  const float* residual;
  int64_t ldr;
  float* out;
};

constexpr int64_t kStreamRows = 16;  // avx512_vnni: the streaming tile up to here, the blocked one above
constexpr int64_t kRowBlock = 48;    // rows of one work item of the blocked paths
constexpr int64_t kGroupPanels = 4;  // panels (of 16 columns) of one work item

// Row m, columns [n0, n0 + n) of the output from their int32 sums over the unsigned codes (n <= 16). The
// activation is chosen outside the loops so each loop vectorizes (GELU included) in the caller's ISA.
template <typename Cols>
BF_INLINE void finish_cols(const int32_t* acc, int64_t m, int64_t n0, Cols n, const Int8Args& a) {
  const float s = a.xs[m], z = float(a.zp[m] + 128);
  const float *ws = a.ws + n0, *cs = a.colsum + n0;
  float v[16];
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) v[j] = s * (float(acc[j]) * ws[j] - z * cs[j]);
  if (a.bias != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) v[j] += a.bias[n0 + j];
  }
  switch (a.act) {
    case Activation::Gelu:
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) v[j] = gelu_erf(v[j]);
      break;
    case Activation::None:
      break;
    default:
      for (int64_t j = 0; j < n; ++j) v[j] = apply_act(v[j], a.act);
      break;
  }
  float* o = a.out + m * a.N + n0;
  if (a.residual != nullptr) {
    const float* r = a.residual + m * a.ldr + n0;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) o[j] = v[j] + r[j];
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) o[j] = v[j];
  }
}

// A whole panel's 16 columns as a compile-time count: loops without remainders.
BF_INLINE void finish_row(const int32_t* acc, int64_t m, int64_t n0, int64_t n, const Int8Args& a) {
  if (n == 16) return finish_cols(acc, m, n0, std::integral_constant<int64_t, 16>{}, a);
  finish_cols(acc, m, n0, n, a);
}

// The 4 codes of `row` at group g as unsigned bytes, zero padded past K (code 0 -> 128, times a zero weight).
BF_INLINE uint32_t codes4(const int8_t* row, int64_t g, int64_t K) {
  uint32_t v = 0x80808080u;
  if (g * 4 + 4 <= K) {
    std::memcpy(&v, row + g * 4, 4);
    return v ^ 0x80808080u;
  }
  uint8_t b[4] = {0x80, 0x80, 0x80, 0x80};
  for (int64_t e = 0; g * 4 + e < K; ++e) b[e] = uint8_t(row[g * 4 + e]) ^ 0x80u;
  std::memcpy(&v, b, 4);
  return v;
}

// ---- blocked paths without VNNI: x widened once to int16 unsigned codes, [M][K4 * 4] zero padded ----

void widen_codes(const Int8Args& a, int64_t lo, int64_t hi, int64_t ldw, int16_t* xw) {
  for (int64_t m = lo; m < hi; ++m) {
    const int8_t* src = a.x + m * a.ldx;
    int16_t* dst = xw + m * ldw;
    for (int64_t k = 0; k < a.K; ++k) dst[k] = int16_t(uint8_t(src[k]) ^ 0x80u);
    for (int64_t k = a.K; k < ldw; ++k) dst[k] = 0;
  }
}

// Panel p's 16 columns as k-contiguous rows wt[16][ldw] (the 4-byte pieces of its groups moved into place), so
// the portable tile's sums are dot products over k, which compilers vectorize (pmaddwd on SSE2, sdot on NEON).
void panel_rows(const Int8Args& a, int64_t p, int64_t ldw, int8_t* wt) {
  const int64_t k4 = ldw / 4;
  const int8_t* wp = a.packed + p * k4 * 64;
  for (int64_t g = 0; g < k4; ++g)
    for (int c = 0; c < 16; ++c) std::memcpy(wt + c * ldw + 4 * g, wp + (g * 16 + c) * 4, 4);
}

// MR rows x the panel's columns, two at a time: 2 x MR dot products in one loop over k.
template <int MR>
BF_INLINE void tile_portable(const Int8Args& a, const int16_t* xw, int64_t ldw, int64_t m0, const int8_t* wt,
                             int64_t p) {
  const int64_t n0 = p * 16, n = std::min<int64_t>(16, a.N - n0);
  const int16_t* xr = xw + m0 * ldw;
  int32_t sums[MR][16];
  for (int c0 = 0; c0 < n; c0 += 2) {
    const int8_t* w = wt + c0 * ldw;
    int32_t acc[MR][2] = {};
    for (int64_t k = 0; k < ldw; ++k) {
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        acc[r][0] += int32_t(xr[r * ldw + k]) * int32_t(w[k]);
        acc[r][1] += int32_t(xr[r * ldw + k]) * int32_t(w[ldw + k]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      sums[r][c0] = acc[r][0];
      sums[r][c0 + 1] = acc[r][1];
    }
  }
  for (int r = 0; r < MR; ++r) finish_row(sums[r], m0 + r, n0, n, a);
}

// Rows [r0, r1) of a blocked work item against one panel (or group of panels) `p`, in tiles of MR rows
// (MR <= 6) and one shorter tile: the weights stay in cache while every row tile runs over them.
template <int MR, typename Tile>
BF_INLINE void row_tiles(int64_t r0, int64_t r1, int64_t p, const Tile& tile) {
  int64_t m = r0;
  for (; m + MR <= r1; m += MR) tile.template run<MR>(m, p);
  switch (r1 - m) {
    case 5: tile.template run<5>(m, p); break;
    case 4: tile.template run<4>(m, p); break;
    case 3: tile.template run<3>(m, p); break;
    case 2: tile.template run<2>(m, p); break;
    case 1: tile.template run<1>(m, p); break;
    default: break;
  }
}

struct PortableTile {
  const Int8Args& a;
  const int16_t* xw;
  int64_t ldw;
  const int8_t* wt;  // panel p as panel_rows lays it out
  template <int MR>
  BF_INLINE void run(int64_t m0, int64_t p) const { tile_portable<MR>(a, xw, ldw, m0, wt, p); }
};

void item_generic(const Int8Args& a, const int16_t* xw, int64_t ldw, int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
  DenormalGuard ftz;
  static thread_local std::vector<int8_t> wt;
  wt.resize(size_t(16 * ldw));
  for (int64_t p = p0; p < p1; ++p) {
    panel_rows(a, p, ldw, wt.data());
    row_tiles<4>(r0, r1, p, PortableTile{a, xw, ldw, wt.data()});
  }
}

#if BF_X86
// acc0 += w0 . x, acc1 += w1 . x (vpmaddwd) with the row's 4 codes at x broadcast. One asm block a row: from
// intrinsics GCC 12 may load all the tile's broadcasts first, 6 registers more than the 16, and spill.
BF_TARGET_AVX2 BF_INLINE void madd_row(__m256i& acc0, __m256i& acc1, const int16_t* x, __m256i w0, __m256i w1) {
  __m256i xv, t;
  asm("vpbroadcastq %[x], %[xv]\n\t"
      "vpmaddwd %[w0], %[xv], %[t]\n\t"
      "vpaddd %[t], %[a0], %[a0]\n\t"
      "vpmaddwd %[w1], %[xv], %[xv]\n\t"
      "vpaddd %[xv], %[a1], %[a1]"
      : [a0] "+x"(acc0), [a1] "+x"(acc1), [xv] "=&x"(xv), [t] "=&x"(t)
      : [x] "m"(*reinterpret_cast<const int64_t*>(x)), [w0] "x"(w0), [w1] "x"(w1));
}

// MR rows x 8 columns (half `h` of panel p) into sums[r][8h, 8h + 8): each 16-byte chunk of a group (4 columns
// x 4 k) sign-extended to 16 int16, times the row's 4 codes broadcast (vpmaddwd: 8 int32 lanes, two per
// column), 2 x MR accumulators.
template <int MR>
BF_TARGET_AVX2 BF_INLINE void tile_avx2(const Int8Args& a, const int16_t* xw, int64_t ldw, int64_t m0, int64_t p,
                                        int h, int32_t (*sums)[16]) {
  const int64_t k4 = (a.K + 3) / 4;
  __m256i acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const int8_t* wp = a.packed + p * k4 * 64 + 32 * h;
  const int16_t* xr = xw + m0 * ldw;
  for (int64_t g = 0; g < k4; ++g) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + g * 64)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + g * 64 + 16)));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) madd_row(acc[r][0], acc[r][1], xr + r * ldw + 4 * g, w0, w1);
  }
  // Lanes (2c, 2c + 1) of chunk i hold column 4i + c: pairwise sums, then the 64-bit lanes put in order.
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[r] + 8 * h),
                        _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][0], acc[r][1]), 0xD8));
}

struct Avx2Tile {
  const Int8Args& a;
  const int16_t* xw;
  int64_t ldw;
  // Not force-inlined: row_tiles, which calls it, carries no target of its own.
  template <int MR>
  BF_TARGET_AVX2 void run(int64_t m0, int64_t p) const {
    const int64_t n0 = p * 16, n = std::min<int64_t>(16, a.N - n0);
    alignas(32) int32_t sums[MR][16];
    tile_avx2<MR>(a, xw, ldw, m0, p, 0, sums);
    if (n > 8) tile_avx2<MR>(a, xw, ldw, m0, p, 1, sums);
    for (int r = 0; r < MR; ++r) finish_row(sums[r], m0 + r, n0, n, a);
  }
};

BF_TARGET_AVX2 void item_avx2(const Int8Args& a, const int16_t* xw, int64_t ldw, int64_t r0, int64_t r1, int64_t p0,
                              int64_t p1) {
  DenormalGuard ftz;
  for (int64_t p = p0; p < p1; ++p) row_tiles<6>(r0, r1, p, Avx2Tile{a, xw, ldw});
}

BF_TARGET_AVX2 void widen_codes_avx2(const Int8Args& a, int64_t lo, int64_t hi, int64_t ldw, int16_t* xw) {
  widen_codes(a, lo, hi, ldw, xw);
}

// ---- AVX512-VNNI ----
#define BF_TARGET_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2,prefer-vector-width=512")))

// acc += u8(x) . s8(w) per 4-byte group. Inline asm because GCC 12's vpdpbusd builtin does not tie the
// accumulator to its output: it copied every accumulator of a register tile (and spilled it) on each step.
BF_TARGET_VNNI BF_INLINE void dpbusd(__m512i& acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
}

// Row m, columns [n0, n0 + 16) (lanes `mk`) of the output from their int32 sums; zp_shift is 128 for sums over
// the unsigned codes, 0 for the signed ones (AMX).
BF_TARGET_VNNI BF_INLINE void finish16(__m512i acc, int64_t m, int64_t n0, __mmask16 mk, int zp_shift,
                                       const Int8Args& a) {
  const __m512 ws = _mm512_maskz_loadu_ps(mk, a.ws + n0);
  const __m512 cs = _mm512_maskz_loadu_ps(mk, a.colsum + n0);
  const __m512 b = a.bias != nullptr ? _mm512_maskz_loadu_ps(mk, a.bias + n0) : _mm512_setzero_ps();
  const __m512 o = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), ws);
  const __m512 centred = _mm512_fnmadd_ps(_mm512_set1_ps(float(a.zp[m] + zp_shift)), cs, o);
  __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(a.xs[m]), centred, b);
  if (a.act == Activation::Gelu) {
    v = gelu_erf512(v);
  } else if (a.act == Activation::Relu) {
    v = _mm512_max_ps(v, _mm512_setzero_ps());
  } else if (a.act != Activation::None) {  // tanh-GELU, tanh: scalar, rare
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    for (int e = 0; e < 16; ++e) tmp[e] = apply_act(tmp[e], a.act);
    v = _mm512_load_ps(tmp);
  }
  if (a.residual != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, a.residual + m * a.ldr + n0));
  _mm512_mask_storeu_ps(a.out + m * a.N + n0, mk, v);
}

// The epilogue of an MR x (16 * NP) register tile of sums over the unsigned codes.
template <int MR, int NP>
BF_TARGET_VNNI BF_INLINE void store_vnni(const __m512i (&acc)[MR][NP], int64_t m0, int64_t p0, const Int8Args& a) {
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) {
    const int64_t n0 = (p0 + j) * 16;
    if (n0 < a.N) {  // no early exit: a loop GCC cannot unroll would keep acc in memory inside the k loop
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) finish16(acc[r][j], m0 + r, n0, tail_mask(a.N - n0), 128, a);
    }
  }
}

// One k group g of the streaming tile; PADDED: the last group when K % 4 != 0.
template <int MR, int NP, bool PADDED>
BF_TARGET_VNNI BF_INLINE void stream_step(__m512i (&acc)[MR][NP], const int8_t* const (&rows)[MR], const int8_t* wp,
                                          int64_t k4, int64_t g, int64_t K) {
  __m512i w[NP];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) w[j] = _mm512_loadu_si512(wp + (j * k4 + g) * 64);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    __m512i xv;
    if (PADDED) {
      xv = _mm512_set1_epi32(int32_t(codes4(rows[r], g, K)));
    } else {
      int32_t c;
      std::memcpy(&c, rows[r] + g * 4, 4);
      xv = _mm512_xor_si512(_mm512_set1_epi32(c), _mm512_set1_epi32(int32_t(0x80808080u)));
    }
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) dpbusd(acc[r][j], xv, w[j]);
  }
}

// Streaming tile: MR rows x NP panels from the signed codes, each row's 4 codes flipped as they are broadcast.
template <int MR, int NP>
BF_TARGET_VNNI BF_INLINE void stream_tile_vnni(const Int8Args& a, int64_t m0, int64_t p0) {
  const int64_t k4 = (a.K + 3) / 4, k4_full = a.K / 4;
  __m512i acc[MR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_si512();
  const int8_t* rows[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) rows[r] = a.x + (m0 + r) * a.ldx;
  const int8_t* wp = a.packed + p0 * k4 * 64;
  // The padded last group (K % 4 != 0) outside the loop: with the branch inside, GCC spilled an accumulator.
  for (int64_t g = 0; g < k4_full; ++g) stream_step<MR, NP, false>(acc, rows, wp, k4, g, a.K);
  if (k4_full < k4) stream_step<MR, NP, true>(acc, rows, wp, k4, k4_full, a.K);
  store_vnni<MR, NP>(acc, m0, p0, a);
}

template <int NP>
BF_TARGET_VNNI void stream_rows_vnni(const Int8Args& a, int64_t p0) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) stream_tile_vnni<4, NP>(a, m, p0);
  switch (a.M - m) {
    case 3: stream_tile_vnni<3, NP>(a, m, p0); break;
    case 2: stream_tile_vnni<2, NP>(a, m, p0); break;
    case 1: stream_tile_vnni<1, NP>(a, m, p0); break;
    default: break;
  }
}

BF_TARGET_VNNI void stream_panels_vnni(const Int8Args& a, int64_t p0, int64_t p1) {
  DenormalGuard ftz;
  switch (p1 - p0) {
    case 4: stream_rows_vnni<4>(a, p0); break;
    case 3: stream_rows_vnni<3>(a, p0); break;
    case 2: stream_rows_vnni<2>(a, p0); break;
    case 1: stream_rows_vnni<1>(a, p0); break;
    default: break;
  }
}

// Blocked tile: MR rows x NP panels from the unsigned codes xu ([M][ldu], padded to whole groups); each
// row's 4 codes are one broadcast load (24 zmm accumulators at 6 x 4).
template <int MR, int NP>
BF_TARGET_VNNI BF_INLINE void blocked_tile_vnni(const Int8Args& a, const uint8_t* xu, int64_t ldu, int64_t m0,
                                                int64_t p0) {
  const int64_t k4 = (a.K + 3) / 4;
  __m512i acc[MR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_si512();
  const uint8_t* xr = xu + m0 * ldu;
  const int8_t* wp = a.packed + p0 * k4 * 64;
  for (int64_t g = 0; g < k4; ++g) {
    __m512i w[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) w[j] = _mm512_loadu_si512(wp + (j * k4 + g) * 64);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t c;
      std::memcpy(&c, xr + r * ldu + 4 * g, 4);
      const __m512i xv = _mm512_set1_epi32(c);
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) dpbusd(acc[r][j], xv, w[j]);
    }
  }
  store_vnni<MR, NP>(acc, m0, p0, a);
}

template <int NP>
struct VnniTile {
  const Int8Args& a;
  const uint8_t* xu;
  int64_t ldu;
  template <int MR>
  BF_TARGET_VNNI void run(int64_t m0, int64_t p0) const { blocked_tile_vnni<MR, NP>(a, xu, ldu, m0, p0); }
};

BF_TARGET_VNNI void item_vnni(const Int8Args& a, const uint8_t* xu, int64_t ldu, int64_t r0, int64_t r1, int64_t p0,
                              int64_t p1) {
  DenormalGuard ftz;
  switch (p1 - p0) {  // the group's panels in one register tile
    case 4: row_tiles<6>(r0, r1, p0, VnniTile<4>{a, xu, ldu}); break;
    case 3: row_tiles<6>(r0, r1, p0, VnniTile<3>{a, xu, ldu}); break;
    case 2: row_tiles<6>(r0, r1, p0, VnniTile<2>{a, xu, ldu}); break;
    case 1: row_tiles<6>(r0, r1, p0, VnniTile<1>{a, xu, ldu}); break;
    default: break;
  }
}

BF_TARGET_VNNI void flip_codes_vnni(const Int8Args& a, int64_t lo, int64_t hi, int64_t ldu, uint8_t* xu) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t m = lo; m < hi; ++m) {
    const int8_t* src = a.x + m * a.ldx;
    uint8_t* dst = xu + m * ldu;
    for (int64_t k = 0; k < ldu; k += 64) {
      const __mmask64 in = a.K - k >= 64 ? ~__mmask64(0) : a.K - k <= 0 ? __mmask64(0) : (__mmask64(1) << (a.K - k)) - 1;
      const __mmask64 out = ldu - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (ldu - k)) - 1;
      _mm512_mask_storeu_epi8(dst + k, out, _mm512_xor_si512(_mm512_maskz_loadu_epi8(in, src + k), flip));
    }
  }
}
// ---- AMX-int8: tdpbssd on signed codes (no flip: the epilogue subtracts zp * colsum) ----
// B tiles come straight from the packed layout: 16 groups of 4 along K for 16 columns are 16 rows of 64
// bytes, contiguous. Used when K is a multiple of 64 (one A tile row per 64 codes).
#define BF_TARGET_AMX_INT8                                                                                 \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c," \
                        "bmi2,prefer-vector-width=512")))

// Epilogue of one stored C block: rows [m0, m0 + mr), columns [n0, n0 + 16 * np) (signed codes).
BF_TARGET_VNNI void amx_store(const int32_t* c, int mr, int np, int64_t m0, int64_t n0, const Int8Args& a) {
  for (int j = 0; j < np; ++j) {
    const int64_t n = n0 + 16 * j;
    if (n >= a.N) break;
    for (int r = 0; r < mr; ++r) finish16(_mm512_loadu_si512(c + r * 48 + 16 * j), m0 + r, n, tail_mask(a.N - n), 0, a);
  }
}

BF_TARGET_AMX_INT8 void panels_amx(const Int8Args& a, int64_t p0, int64_t p1) {
  DenormalGuard ftz;
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

void int8_linear(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const float* xs, const int32_t* zp,
                 const int8_t* packed, int64_t N, const float* ws, const float* colsum, const float* bias, Activation act,
                 const float* residual, int64_t ldr, float* out) {
  if (M == 0 || N == 0) return;
  const Int8Args a{x, ldx, M, K, xs, zp, packed, N, ws, colsum, bias, act, residual, ldr, out};
  const int64_t panels = (N + 15) / 16, groups = (panels + kGroupPanels - 1) / kGroupPanels;
  const int nt = M * N * K < (int64_t(1) << 18) ? 1 : num_threads();
  const Isa isa = active_isa();
#if BF_X86
  // Threads split the output columns in groups of 4 panels (64 columns), so each streams its own weights.
  if (isa == Isa::Amx && K % 64 == 0) {
    parallel_for(nt, groups, [&](int64_t g) { panels_amx(a, g * 4, std::min(panels, g * 4 + 4)); });
    return;
  }
  if (isa >= Isa::Avx512Vnni && M <= kStreamRows) {
    parallel_for(nt, groups, [&](int64_t g) { stream_panels_vnni(a, g * 4, std::min(panels, g * 4 + 4)); });
    return;
  }
#endif
  // Blocked: the codes prepared once (unsigned bytes for VNNI, int16 otherwise, rows padded to whole
  // groups), then (row block, panel group) items claimed by the threads.
  const int64_t ld = (K + 3) / 4 * 4, row_blocks = (M + kRowBlock - 1) / kRowBlock;
  static thread_local std::vector<int16_t> codes;  // the caller's: reused across calls
  codes.resize(size_t(M * ld));
  const auto item = [&](int64_t i, auto&& run) {
    const int64_t rb = i / groups, g = i % groups;
    run(rb * kRowBlock, std::min(M, (rb + 1) * kRowBlock), g * kGroupPanels, std::min(panels, (g + 1) * kGroupPanels));
  };
  const int prep_threads = int(std::min<int64_t>(nt, row_blocks));
#if BF_X86
  if (isa >= Isa::Avx512Vnni) {
    uint8_t* xu = reinterpret_cast<uint8_t*>(codes.data());
    parallel_for(prep_threads, row_blocks, [&](int64_t rb) {
      flip_codes_vnni(a, rb * kRowBlock, std::min(M, (rb + 1) * kRowBlock), ld, xu);
    });
    parallel_for(nt, row_blocks * groups, [&](int64_t i) {
      item(i, [&](int64_t r0, int64_t r1, int64_t p0, int64_t p1) { item_vnni(a, xu, ld, r0, r1, p0, p1); });
    });
    return;
  }
#endif
  int16_t* xw = codes.data();
  parallel_for(prep_threads, row_blocks, [&](int64_t rb) {
    const int64_t lo = rb * kRowBlock, hi = std::min(M, lo + kRowBlock);
#if BF_X86
    if (isa == Isa::Avx2) return widen_codes_avx2(a, lo, hi, ld, xw);
#endif
    widen_codes(a, lo, hi, ld, xw);
  });
  parallel_for(nt, row_blocks * groups, [&](int64_t i) {
    item(i, [&](int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
#if BF_X86
      if (isa == Isa::Avx2) return item_avx2(a, xw, ld, r0, r1, p0, p1);
#endif
      item_generic(a, xw, ld, r0, r1, p0, p1);
    });
  });
}

}  // namespace cpu
}  // namespace bertfast
