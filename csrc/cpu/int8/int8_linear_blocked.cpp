// The int8 GEMM's blocked regime (every tier; above kStreamRows rows on avx512_vnni): x's codes prepared once,
// then (row block, panel group) items whose weights stay in cache while every row tile runs over them.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/int8/int8_linear_impl.h"

namespace bertfast {
namespace cpu {
namespace int8_detail {
namespace {

// Row m, columns [n0, n0 + n) of the output from their int32 sums over the unsigned codes (n <= 16). The
// activation is chosen outside the loops so each loop vectorizes (GELU included) in the caller's ISA; kAvx2: the
// caller is the avx2 tier's (activate256, as its fp32 and bf16 GEMMs).
template <bool kAvx2, typename Cols>
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
  lora_add(a.lora, m, n0, int64_t(n), v);
  activate_lanes<kAvx2 ? Lanes::Avx2 : Lanes::Generic>(v, n, a.act);
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
template <bool kAvx2 = false>
BF_INLINE void finish_row(const int32_t* acc, int64_t m, int64_t n0, int64_t n, const Int8Args& a) {
  if (n == 16) return finish_cols<kAvx2>(acc, m, n0, std::integral_constant<int64_t, 16>{}, a);
  finish_cols<kAvx2>(acc, m, n0, n, a);
}

// ---- blocked paths without VNNI: x widened once to int16 unsigned codes, [M][K4 * 4] zero padded ----

BF_INLINE void widen_codes(const Int8Args& a, int64_t lo, int64_t hi, int64_t ldw, int16_t* xw) {
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

}  // namespace

void widen_codes_generic(const Int8Args& a, int64_t lo, int64_t hi, int64_t ldw, int16_t* xw) {
  widen_codes(a, lo, hi, ldw, xw);
}

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
namespace {

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
    for (int r = 0; r < MR; ++r) finish_row<true>(sums[r], m0 + r, n0, n, a);
  }
};

}  // namespace

BF_TARGET_AVX2 void item_avx2(const Int8Args& a, const int16_t* xw, int64_t ldw, int64_t r0, int64_t r1, int64_t p0,
                              int64_t p1) {
  DenormalGuard ftz;
  for (int64_t p = p0; p < p1; ++p) row_tiles<6>(r0, r1, p, Avx2Tile{a, xw, ldw});
}

BF_TARGET_AVX2 void widen_codes_avx2(const Int8Args& a, int64_t lo, int64_t hi, int64_t ldw, int16_t* xw) {
  widen_codes(a, lo, hi, ldw, xw);
}

// ---- AVX-VNNI (the avx2 tier where the CPU has it): x flipped once to unsigned bytes, vpdpbusd on ymm ----

namespace {

// acc += u8(x) . s8(w) per 4-byte group, VEX-encoded (no AVX-512 needed). Inline asm for the reason dpbusd
// gives (GCC 12 does not tie the builtin's accumulator to its output).
BF_TARGET_AVXVNNI BF_INLINE void dpbusd_vex(__m256i& acc, __m256i x, __m256i w) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(x), "x"(w));
}

// MR rows x panel p's 16 columns: per k group its 64 weight bytes as two ymm (columns 0-7, 8-15: lane c of a
// vpdpbusd is column c) times row r's 4 unsigned codes broadcast; 2 x MR accumulators (12 at MR = 6, of 16
// registers). The int32 sums are tile_avx2's exactly, and finish_row is its epilogue.
template <int MR>
BF_TARGET_AVXVNNI BF_INLINE void tile_avxvnni(const Int8Args& a, const uint8_t* xu, int64_t ldu, int64_t m0,
                                              int64_t p) {
  const int64_t k4 = (a.K + 3) / 4, n0 = p * 16, n = std::min<int64_t>(16, a.N - n0);
  __m256i acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const int8_t* wp = a.packed + p * k4 * 64;
  const uint8_t* xr = xu + m0 * ldu;
  for (int64_t g = 0; g < k4; ++g) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + g * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + g * 64 + 32));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t c;
      std::memcpy(&c, xr + r * ldu + 4 * g, 4);
      const __m256i xv = _mm256_set1_epi32(c);
      dpbusd_vex(acc[r][0], xv, w0);
      dpbusd_vex(acc[r][1], xv, w1);
    }
  }
  alignas(32) int32_t sums[MR][16];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums[r]), acc[r][0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums[r] + 8), acc[r][1]);
  }
  for (int r = 0; r < MR; ++r) finish_row<true>(sums[r], m0 + r, n0, n, a);
}

struct AvxVnniTile {
  const Int8Args& a;
  const uint8_t* xu;
  int64_t ldu;
  template <int MR>
  BF_TARGET_AVXVNNI void run(int64_t m0, int64_t p) const { tile_avxvnni<MR>(a, xu, ldu, m0, p); }
};

}  // namespace

BF_TARGET_AVXVNNI void item_avxvnni(const Int8Args& a, const uint8_t* xu, int64_t ldu, int64_t r0, int64_t r1,
                                    int64_t p0, int64_t p1) {
  DenormalGuard ftz;
  for (int64_t p = p0; p < p1; ++p) row_tiles<6>(r0, r1, p, AvxVnniTile{a, xu, ldu});
}

// The codes of rows [lo, hi) as unsigned bytes (q ^ 0x80), [M][ldu], the pad past K zero (its weights are zero).
BF_TARGET_AVX2 void flip_codes_avx2(const Int8Args& a, int64_t lo, int64_t hi, int64_t ldu, uint8_t* xu) {
  for (int64_t m = lo; m < hi; ++m) {
    const int8_t* src = a.x + m * a.ldx;
    uint8_t* dst = xu + m * ldu;
    for (int64_t k = 0; k < a.K; ++k) dst[k] = uint8_t(src[k]) ^ 0x80u;
    for (int64_t k = a.K; k < ldu; ++k) dst[k] = 0;
  }
}

// ---- AVX512-VNNI: x flipped once to unsigned bytes ----

namespace {

// Row r's 4 codes of group g, already unsigned (xr: the tile's first row, rows ldu bytes apart): one
// broadcast load.
struct UnsignedCodes {
  const uint8_t* xr;
  int64_t ldu, g;
  BF_TARGET_VNNI BF_INLINE __m512i operator()(int r) const {
    int32_t c;
    std::memcpy(&c, xr + r * ldu + 4 * g, 4);
    return _mm512_set1_epi32(c);
  }
};

// Blocked tile: MR rows x NP panels from the unsigned codes xu ([M][ldu], padded to whole groups)
// (24 zmm accumulators at 6 x 4).
template <int MR, int NP>
BF_TARGET_VNNI BF_INLINE void blocked_tile_vnni(const Int8Args& a, const uint8_t* xu, int64_t ldu, int64_t m0,
                                                int64_t p0) {
  const int64_t k4 = (a.K + 3) / 4;
  __m512i acc[MR][NP];
  zero_vnni<MR, NP>(acc);
  const uint8_t* xr = xu + m0 * ldu;
  const int8_t* wp = a.packed + p0 * k4 * 64;
  for (int64_t g = 0; g < k4; ++g) vnni_group<MR, NP>(acc, wp, k4, g, UnsignedCodes{xr, ldu, g});
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

}  // namespace

BF_TARGET_VNNI void item_vnni(const Int8Args& args, const uint8_t* xu, int64_t ldu, int64_t r0, int64_t r1,
                              int64_t p0, int64_t p1) {
  DenormalGuard ftz;
  ItemTerms<kRowBlock> terms;
  const Int8Args a = terms.with(args, r0, r1, p0, p1);
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
#endif

}  // namespace int8_detail
}  // namespace cpu
}  // namespace bertfast
