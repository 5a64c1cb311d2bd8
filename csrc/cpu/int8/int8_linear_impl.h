// Internals shared by the int8 GEMM's files (int8_linear*.cpp): call arguments, VNNI steps, regime entry points.
//
// The arguments of a call, the work-item sizes, the VNNI dot product, k-group step and epilogue, and each
// regime's entry point (the dispatch is int8_linear.cpp).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu/common/activation.h"
#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/common/scalar_math.h"
#include "cpu/common/simd.h"
#include "cpu/common/vec_math.h"
#include "cpu/gemm/amx_gemm.h"
#include "cpu/gemm/lora.h"

namespace bertfast {
namespace cpu {

// The int8 GEMM kernels, one per path (int8_linear.cpp dispatches on choose_int8's answer).
enum class Int8Path : int {
  AmxStream,           // AMX-int8 tiles, streaming (int8_linear_amx.cpp)
  AmxStreamEmulated,   // the same with the tiles emulated (the amx_emulated tier)
  AmxBlocked,          // AMX-int8 tiles, blocked (int8_linear_amx.cpp)
  AmxBlockedEmulated,  // the same with the tiles emulated
  VnniStream,          // avx512_vnni, few rows: a 4 x 64 tile streams the weights (int8_linear_stream.cpp)
  VnniBlocked,         // avx512_vnni, more rows: unsigned codes, 6 x 64 tiles (int8_linear_blocked.cpp)
  AvxVnni,             // avx2 with AVX-VNNI: unsigned codes, VEX vpdpbusd, 6 x 16 tiles (int8_linear_blocked.cpp)
  Avx2,                // avx2: codes widened to int16, vpmaddwd, 6 x 8 tiles (int8_linear_blocked.cpp)
  Portable,            // codes widened to int16, plain loops (int8_linear_blocked.cpp)
};
const char* int8_path_name(Int8Path path);
// Whether a path runs on AMX tiles, emulated or not: the paths that take LoRA factors in tile form (lora_tile_rows).
inline bool on_tiles(Int8Path p) {
  return p == Int8Path::AmxStream || p == Int8Path::AmxStreamEmulated || p == Int8Path::AmxBlocked ||
         p == Int8Path::AmxBlockedEmulated;
}

// What the choice reads: the call's M and K (the same choice for every N) and the tier.
struct Int8Call {
  int64_t m, k;
  Isa isa;           // the tier (active_isa())
  bool avx_vnni;     // AVX-VNNI present and not hidden (has_avx_vnni())
  AmxGemm amx_mode;  // the AMX kernels' forced choice, or Auto (amx_gemm())
};
Int8Path choose_int8(const Int8Call& call);

namespace int8_detail {

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
  bf16* out16 = nullptr;  // instead of out: the output rounded to bf16 (int8_linear_bf16; the AVX-512 epilogue only)
  const LoraTerm* lora = nullptr;  // the rows' LoRA terms added before the activation (cpu/gemm/lora.h), or null
  const LoraBlock* terms = nullptr;  // lora's terms of a work item's rows, computed once for all its tiles, or null
};

constexpr int64_t kStreamRows = 16;  // avx512_vnni: the streaming tile up to here, the blocked one above
constexpr int64_t kRowBlock = 48;    // rows of one work item of the blocked paths
constexpr int64_t kGroupPanels = 4;  // panels (of 16 columns) of one work item

#if BF_X86
// acc += u8(x) . s8(w) per 4-byte group. Inline asm because GCC 12's vpdpbusd builtin does not tie the
// accumulator to its output: it copied every accumulator of a register tile (and spilled it) on each step.
BF_TARGET_VNNI BF_INLINE void dpbusd(__m512i& acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
}

// The epilogue's operands of columns [n0, n0 + 16) (lanes `mk`): weight scales, column sums, bias.
struct Cols16 {
  __m512 ws, cs, b;
  __mmask16 mk;
  int64_t n0;
};
BF_TARGET_VNNI BF_INLINE Cols16 cols16(const Int8Args& a, int64_t n0) {
  const __mmask16 mk = tail_mask(a.N - n0);
  return {_mm512_maskz_loadu_ps(mk, a.ws + n0), _mm512_maskz_loadu_ps(mk, a.colsum + n0),
          a.bias != nullptr ? _mm512_maskz_loadu_ps(mk, a.bias + n0) : _mm512_setzero_ps(), mk, n0};
}

// Row m, the columns of `col`, of the output from their int32 sums; xs = the row's scale, zp = its zero point plus
// zp_shift (128 for sums over the unsigned codes, 0 for the signed ones: AMX), both broadcast; term: the row's LoRA
// terms for these columns (lora_terms_rows), or null.
BF_TARGET_VNNI BF_INLINE void finish16(__m512i acc, int64_t m, const Cols16& col, __m512 xs, __m512 zp,
                                       const Int8Args& a, const float* term) {
  const __m512 o = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), col.ws);
  const __m512 centred = _mm512_fnmadd_ps(zp, col.cs, o);
  __m512 v = _mm512_fmadd_ps(xs, centred, col.b);
  if (term != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(col.mk, term));
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
  if (a.residual != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(col.mk, a.residual + m * a.ldr + col.n0));
  if (a.out16 != nullptr) return store16(a.out16 + m * a.N + col.n0, v, col.mk);
  _mm512_mask_storeu_ps(a.out + m * a.N + col.n0, col.mk, v);
}

// Rows [m0, m0 + mr) x the 16 * np columns from n0 of the output, from their int32 sums (sums(r, j): row m0 + r,
// columns n0 + 16 j on; a functor whose call is BF_TARGET_VNNI and force-inlined). The call's arguments are copied
// first, and each row's scale and zero point and each column's operands loaded once: read through `a` and from memory
// the output is written to, the compiler reloaded them all for every 16 outputs (~50 instructions where the
// arithmetic takes ~10). Inline: out of line, on the tile stored to memory, the calls and their loops' branches cost
// what they saved (benchmarks/results/2026-11-26-int8-cpu).
template <int MR, typename Sums>
BF_TARGET_VNNI BF_INLINE void finish_rows(const Int8Args& args, int mr, int64_t m0, int64_t n0, int np, int zp_shift,
                                          const Sums& sums) {
  const Int8Args a = args;
  __m512 xs[MR], zp[MR];
  // The rows' LoRA terms for the tile's columns, computed before its epilogue.
  alignas(64) float terms[MR][64];
  const float* term[MR] = {};
  if (a.terms != nullptr) {
    for (int r = 0; r < mr; ++r) term[r] = a.terms->term[m0 - a.terms->m0 + r];
  } else if (a.lora != nullptr) {
    if (np > 4) std::abort();  // every path's tiles are at most 4 panels (64 columns) wide
    lora_terms_rows(*a.lora, m0, mr, n0, std::min<int64_t>(16 * np, a.N - n0), terms, term);
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    xs[r] = _mm512_set1_ps(r < mr ? a.xs[m0 + r] : 0.f);
    zp[r] = _mm512_set1_ps(r < mr ? float(a.zp[m0 + r] + zp_shift) : 0.f);
  }
#pragma GCC unroll 8
  for (int j = 0; j < np; ++j) {
    const int64_t n = n0 + 16 * j;
    if (n < a.N) {  // no early exit: a loop GCC cannot unroll would keep register sums in memory inside the k loop
      const Cols16 col = cols16(a, n);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r)
        if (r < mr) finish16(sums(r, j), m0 + r, col, xs[r], zp[r], a, term[r] != nullptr ? term[r] + 16 * j : nullptr);
    }
  }
}

// The LoRA terms of a work item's rows for all its row tiles at once: per tile, the set-up of lora_terms_rows cost a
// quarter of its fmas' time, and rows of one run share each B^T load.
template <int ROWS>
struct ItemTerms {
  alignas(64) float out[ROWS][64];
  const float* term[ROWS] = {};
  LoraBlock block{0, term};
  // `args` with the terms of rows [r0, r1) (at most ROWS) at panels [p0, p1) (at most 4) where it has a term.
  BF_INLINE Int8Args with(const Int8Args& args, int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
    Int8Args a = args;
    if (a.lora == nullptr || r1 - r0 > ROWS || p1 - p0 > 4) return a;
    lora_terms_rows(*a.lora, r0, int(r1 - r0), 16 * p0, std::min(16 * (p1 - p0), a.N - 16 * p0), out, term);
    block.m0 = r0;
    a.terms = &block;
    return a;
  }
};

// An MR x (16 * NP) register tile's int32 sums, zeroed.
template <int MR, int NP>
BF_TARGET_VNNI BF_INLINE void zero_vnni(__m512i (&acc)[MR][NP]) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_si512();
}

// One k group g of an MR x (16 * NP) register tile (the streaming and the blocked one): the group's 64 weight
// bytes of each of the NP panels (k4 groups apart from wp) times row r's 4 unsigned codes broadcast,
// `codes(r)` (a functor whose call is BF_TARGET_VNNI and force-inlined).
template <int MR, int NP, typename Codes>
BF_TARGET_VNNI BF_INLINE void vnni_group(__m512i (&acc)[MR][NP], const int8_t* wp, int64_t k4, int64_t g,
                                         const Codes& codes) {
  __m512i w[NP];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) w[j] = _mm512_loadu_si512(wp + (j * k4 + g) * 64);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m512i xv = codes(r);
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) dpbusd(acc[r][j], xv, w[j]);
  }
}

// An MR x (16 * NP) register tile's sums, as finish_rows reads them.
template <int MR, int NP>
struct RegisterSums {
  const __m512i (&acc)[MR][NP];
  BF_TARGET_VNNI BF_INLINE __m512i operator()(int r, int j) const { return acc[r][j]; }
};
// The epilogue of an MR x (16 * NP) register tile of sums over the unsigned codes.
template <int MR, int NP>
BF_TARGET_VNNI BF_INLINE void store_vnni(const __m512i (&acc)[MR][NP], int64_t m0, int64_t p0, const Int8Args& a) {
  finish_rows<MR>(a, MR, m0, p0 * 16, NP, 128, RegisterSums<MR, NP>{acc});
}

#endif

// ---- each regime's entry point (by tier: int8_linear.cpp) ----

// Streaming, avx512_vnni up to kStreamRows rows (int8_linear_stream.cpp): every row against panels [p0, p1).
#if BF_X86
BF_TARGET_VNNI void stream_panels_vnni(const Int8Args& a, int64_t p0, int64_t p1);
#endif

// Blocked (int8_linear_blocked.cpp): the codes of rows [lo, hi) prepared once (widened to int16 [M][ldw], or
// flipped to unsigned bytes [M][ldu] for VNNI), then one item: rows [r0, r1) x panels [p0, p1).
void widen_codes_generic(const Int8Args& a, int64_t lo, int64_t hi, int64_t ldw, int16_t* xw);
void item_generic(const Int8Args& a, const int16_t* xw, int64_t ldw, int64_t r0, int64_t r1, int64_t p0, int64_t p1);
#if BF_X86
BF_TARGET_AVX2 void widen_codes_avx2(const Int8Args& a, int64_t lo, int64_t hi, int64_t ldw, int16_t* xw);
BF_TARGET_AVX2 void item_avx2(const Int8Args& a, const int16_t* xw, int64_t ldw, int64_t r0, int64_t r1, int64_t p0,
                              int64_t p1);
// The avx2 tier with AVX-VNNI: the codes flipped to unsigned bytes [M][ldu], then vpdpbusd on ymm; the same int32
// sums as item_avx2's, the same epilogue.
BF_TARGET_AVX2 void flip_codes_avx2(const Int8Args& a, int64_t lo, int64_t hi, int64_t ldu, uint8_t* xu);
BF_TARGET_AVXVNNI void item_avxvnni(const Int8Args& a, const uint8_t* xu, int64_t ldu, int64_t r0, int64_t r1,
                                    int64_t p0, int64_t p1);
BF_TARGET_VNNI void flip_codes_vnni(const Int8Args& a, int64_t lo, int64_t hi, int64_t ldu, uint8_t* xu);
BF_TARGET_VNNI void item_vnni(const Int8Args& a, const uint8_t* xu, int64_t ldu, int64_t r0, int64_t r1, int64_t p0,
                              int64_t p1);

// AMX-int8, K a multiple of 64 (int8_linear_amx.cpp): every row against panels [p0, p1); the same kernel with
// the tiles emulated (int8_linear_amx.cpp built with BF_AMX_EMULATED, the amx_emulated tier).
BF_TARGET_AMX_INT8 void panels_amx(const Int8Args& a, int64_t p0, int64_t p1);
BF_TARGET_VNNI void panels_amx_emulated(const Int8Args& a, int64_t p0, int64_t p1);
// AMX-int8 blocked (int8_linear_amx.cpp, amx_gemm.h): rows [r0, r0 + rows) x units [u0, u1) of three panels, the
// same int32 sums and epilogue as panels_amx; and with the tiles emulated. int8_linear.cpp runs a whole call's items
// on nt threads (amx_for_items, amx_gemm.h).
BF_TARGET_AMX_INT8 void panels_amx_blocked(const Int8Args& a, int64_t r0, int64_t rows, int64_t u0, int64_t u1);
BF_TARGET_VNNI void panels_amx_blocked_emulated(const Int8Args& a, int64_t r0, int64_t rows, int64_t u0, int64_t u1);
#endif

}  // namespace int8_detail
}  // namespace cpu
}  // namespace bertfast
