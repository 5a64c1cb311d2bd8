// DeBERTa-v2's per-token position terms (`bertfast.disentangled`): for each token t and head h, the row
// out[t, h, :] = scale * x[t, h, :] . pos[r, h, :] over the rows r of the layer's position projections (c2p: x = q,
// pos = pos_key; p2c: x = k, pos = pos_query). The attention adds them per (query, key) from these (T, heads, rows)
// tables (attention_impl.h), so nothing here is quadratic in the length. With windows, a token's entries are
// computed only over the columns its own sequence's distances reach (in whole 16-column groups): about half the
// table for full rows of one length, far less for a short row in a long batch.
//
// pos is widened once per call to fp32 and transposed per head to [d][rows rounded up to 16] (zero columns), so a
// token's entries are d broadcast multiply-adds over whole 16-column groups: each entry is one dot product over e in
// order from zero, with no tail loop whose rounding could differ, the same for every token count and window (batch
// invariance by construction). Threads claim (head, 192-token chunk) items. On AVX-512 a register block of 6 tokens
// x 64 columns (24 accumulators) runs over e, the block's columns the union of its tokens' windows; a token or
// column tail takes the same fma chain in smaller blocks: every entry bit-identical whatever T and the windows.
//
// bf16 with AVX-512 BF16 (Zen 4/5) and an even d, off the tiles: pos is packed per head in pairs of dims, [d / 2][rows
// rounded up to 16][2] bf16, and the same register blocks take one vdpbf16ps per pair: each entry the pairs' exact
// products summed over the pairs in order from zero, again the same for every token count and window. The widened
// fp32 blocks ran at about 150 GFLOP/s on 2 Zen 4 cores, a tenth of a bf16 DeBERTa-v3 forward.
//
// bf16 on the AMX tiers, d a multiple of kAmxK: the tiles (disentangled_amx.cpp). pos is packed once per call, per
// head, in pack_linear's bf16 layout (48-column panels); threads claim (head, 64-token block) items, each the blocked
// AMX GEMM of the block's x over the panels its tokens' windows reach. choose_position_scores holds the rule.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/attention/disentangled_impl.h"
#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/common/simd.h"
#include "cpu/gemm/amx_gemm.h"

namespace bertfast {
namespace cpu {
namespace {

struct ScoreArgs {
  int64_t ld_row, ld_head, heads, d, rows, rows_pad;
  float scale;
  const float* pos_t;      // [heads][d][rows_pad] fp32 (Avx512Bf16: null)
  const bf16* pos_p;       // Avx512Bf16 only: [heads][d / 2][rows_pad][2] bf16
  float* out;              // [tokens][heads][rows]
  const int32_t* windows;  // [tokens][2] columns [lo, hi) a token needs, or nullptr: all of them
};

// The columns tokens [lo, hi) need, widened to whole 16-column groups: [*c0, *c1), empty if none.
BF_INLINE void block_columns(const ScoreArgs& a, int64_t lo, int64_t hi, int64_t* c0, int64_t* c1) {
  if (a.windows == nullptr) {
    *c0 = 0;
    *c1 = a.rows_pad;
    return;
  }
  int64_t first = a.rows, last = 0;
  for (int64_t t = lo; t < hi; ++t) {
    first = std::min<int64_t>(first, a.windows[2 * t]);
    last = std::max<int64_t>(last, a.windows[2 * t + 1]);
  }
  *c0 = first / 16 * 16;
  *c1 = last <= first ? *c0 : std::min(a.rows_pad, (last + 15) / 16 * 16);
}

// Head h's rows of tokens [lo, hi), 16 columns at a time.
template <typename T>
BF_INLINE void score_rows(const T* x, const ScoreArgs& a, int64_t h, int64_t lo, int64_t hi) {
  const float* pt = a.pos_t + h * a.d * a.rows_pad;
  for (int64_t t = lo; t < hi; ++t) {
    const T* xr = x + t * a.ld_row + h * a.ld_head;
    float* o = a.out + (t * a.heads + h) * a.rows;
    int64_t c0, c1;
    block_columns(a, t, t + 1, &c0, &c1);
    for (int64_t c = c0; c < c1; c += 16) {
      float acc[16] = {};
      for (int64_t e = 0; e < a.d; ++e) {
        const float xe = to_float(xr[e]);
        const float* col = pt + e * a.rows_pad + c;
#pragma omp simd
        for (int r = 0; r < 16; ++r) acc[r] += xe * col[r];
      }
      const int64_t n = std::min<int64_t>(16, a.rows - c);
      for (int64_t r = 0; r < n; ++r) o[c + r] = acc[r] * a.scale;
    }
  }
}

#if BF_X86
template <typename T>
BF_TARGET_AVX2 void score_avx2(const T* x, const ScoreArgs& a, int64_t h, int64_t lo, int64_t hi) {
  score_rows(x, a, h, lo, hi);
}

// out[t0 + i, h, c + 16 j + lane] for i < TB, j < NV: fma over e in order from zero, then * scale.
template <int TB, int NV, typename T>
BF_TARGET_AVX512 __attribute__((noinline)) void score_block512(const T* x, const ScoreArgs& a, int64_t t0, int64_t h,
                                                            int64_t c) {
  const float* pt = a.pos_t + h * a.d * a.rows_pad + c;
  const T* xr[TB];
  for (int i = 0; i < TB; ++i) xr[i] = x + (t0 + i) * a.ld_row + h * a.ld_head;
  __m512 acc[TB][NV];  // [tokens, 16 * NV rows]
  for (int i = 0; i < TB; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t e = 0; e < a.d; ++e) {
    __m512 col[NV];
    for (int j = 0; j < NV; ++j) col[j] = _mm512_loadu_ps(pt + e * a.rows_pad + 16 * j);
    for (int i = 0; i < TB; ++i) {
      const __m512 xe = _mm512_set1_ps(to_float(xr[i][e]));
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(xe, col[j], acc[i][j]);
    }
  }
  const __m512 s = _mm512_set1_ps(a.scale);
  for (int i = 0; i < TB; ++i) {
    float* o = a.out + ((t0 + i) * a.heads + h) * a.rows + c;
    for (int j = 0; j < NV; ++j) store16(o + 16 * j, _mm512_mul_ps(acc[i][j], s), tail_mask(a.rows - c - 16 * j));
  }
}

// score_block512 on bf16 pairs: acc += x[t, 2p : 2p + 2] . pos[2p : 2p + 2, column] for p in order from zero.
template <int TB, int NV>
BF_TARGET_AVX512BF16 __attribute__((noinline)) void score_block_bf16(const bf16* x, const ScoreArgs& a, int64_t t0,
                                                                     int64_t h, int64_t c) {
  const bf16* pp = a.pos_p + (h * a.d * a.rows_pad + 2 * c);
  const bf16* xr[TB];
  for (int i = 0; i < TB; ++i) xr[i] = x + (t0 + i) * a.ld_row + h * a.ld_head;
  __m512 acc[TB][NV];
  for (int i = 0; i < TB; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < a.d / 2; ++p) {
    __m512bh col[NV];
    for (int j = 0; j < NV; ++j) col[j] = (__m512bh)_mm512_loadu_si512(pp + 2 * (p * a.rows_pad + 16 * j));
    for (int i = 0; i < TB; ++i) {
      uint32_t pair;
      std::memcpy(&pair, xr[i] + 2 * p, sizeof(pair));
      const __m512bh xe = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xe, col[j]);
    }
  }
  const __m512 s = _mm512_set1_ps(a.scale);
  for (int i = 0; i < TB; ++i) {
    float* o = a.out + ((t0 + i) * a.heads + h) * a.rows + c;
    for (int j = 0; j < NV; ++j) store16(o + 16 * j, _mm512_mul_ps(acc[i][j], s), tail_mask(a.rows - c - 16 * j));
  }
}

// Tokens [t, t + TB), columns [c0, c1) (whole 16-column groups, at most 64): one register block.
template <int TB, bool kPairs, typename T>
BF_TARGET_AVX512 BF_INLINE void score_part512(const T* x, const ScoreArgs& a, int64_t t, int64_t h, int64_t c0,
                                              int64_t c1) {
  const int64_t groups = (c1 - c0) / 16;
  if constexpr (kPairs) {
    if constexpr (sizeof(T) == 2) {
      if (groups == 4) return score_block_bf16<TB, 4>(x, a, t, h, c0);
      if (groups == 3) return score_block_bf16<TB, 3>(x, a, t, h, c0);
      if (groups == 2) return score_block_bf16<TB, 2>(x, a, t, h, c0);
      if (groups == 1) return score_block_bf16<TB, 1>(x, a, t, h, c0);
    }
    return;
  }
  if (groups == 4) return score_block512<TB, 4>(x, a, t, h, c0);
  if (groups == 3) return score_block512<TB, 3>(x, a, t, h, c0);
  if (groups == 2) return score_block512<TB, 2>(x, a, t, h, c0);
  if (groups == 1) return score_block512<TB, 1>(x, a, t, h, c0);
}

// Tokens [lo, hi) of head h in blocks of 6, each over the 16-column groups of its tokens' windows: 64 at a time, then
// the last 16, 32 or 48 in one block (the tail tokens one at a time, each over its own window).
template <bool kPairs, typename T>
BF_TARGET_AVX512 void score_avx512(const T* x, const ScoreArgs& a, int64_t h, int64_t lo, int64_t hi) {
  constexpr int kTokens = 6;
  for (int64_t t = lo; t < hi;) {
    const bool whole = t + kTokens <= hi;
    const int64_t n = whole ? kTokens : 1;
    int64_t c, c1;
    block_columns(a, t, t + n, &c, &c1);
    for (; c < c1; c += 64) {
      if (whole) score_part512<kTokens, kPairs>(x, a, t, h, c, std::min(c + 64, c1));
      else score_part512<1, kPairs>(x, a, t, h, c, std::min(c + 64, c1));
    }
    t += n;
  }
}
#endif

template <typename T>
void score_generic(const T* x, const ScoreArgs& a, int64_t h, int64_t lo, int64_t hi) {
  score_rows(x, a, h, lo, hi);
}

template <typename T>
void score_path(PositionScoresPath path, const T* x, const ScoreArgs& a, int64_t h, int64_t lo, int64_t hi) {
#if BF_X86
  if (path == PositionScoresPath::Avx512) return score_avx512<false>(x, a, h, lo, hi);
  if (path == PositionScoresPath::Avx512Bf16) return score_avx512<true>(x, a, h, lo, hi);
  if (path == PositionScoresPath::Avx2) return score_avx2(x, a, h, lo, hi);
#endif
  score_generic(x, a, h, lo, hi);
}

// Items (head, 192-token chunk) claimed dynamically: each reads one head's table, a late thread takes fewer.
template <typename T>
void score_items(PositionScoresPath path, const T* x, const ScoreArgs& a, int64_t tokens) {
  constexpr int64_t kChunk = 192;
  const int64_t chunks = (tokens + kChunk - 1) / kChunk;
  parallel_for(threads_for(tokens * a.heads * a.d * a.rows_pad), a.heads * chunks, [&](int64_t item) {
    const int64_t h = item / chunks, lo = item % chunks * kChunk, hi = std::min(tokens, lo + kChunk);
    score_path(path, x, a, h, lo, hi);
  });
}

#if BF_X86
// The AMX path: per head its rows (R, d) packed as pack_linear packs a bf16 weight, then (head, 64-token block) items,
// each over the 48-column panels the block's windows reach (every entry written there is the full table's).
void scores_amx(const bf16* x, int64_t ld_row, int64_t ld_head, int64_t tokens, int64_t heads, int64_t d,
                const bf16* pos, int64_t rows, float scale, float* out, const int32_t* windows, bool emulated) {
  const int64_t units = (rows + kPanel - 1) / kPanel, per_head = units * d * kPanel;
  std::vector<bf16> packed(heads * per_head);
  parallel_for(threads_for(heads * per_head), heads, [&](int64_t h) {
    bf16* dst = packed.data() + h * per_head;
    std::fill(dst, dst + per_head, bf16{});
    for (int64_t r = 0; r < rows; ++r) {
      const bf16* src = pos + r * heads * d + h * d;
      bf16* panel = dst + r / kPanel * d * kPanel + r % kPanel * 2;
      for (int64_t e = 0; e < d; ++e) panel[(e / 2) * kPanel * 2 + (e & 1)] = src[e];
    }
  });
  // 64 tokens: the block's column union (a sequence's windows shift one column a token) stays near one window.
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (tokens + kBlock - 1) / kBlock;
  parallel_for(threads_for(tokens * heads * d * rows), heads * blocks, [&](int64_t item) {
    const int64_t h = item / blocks, lo = item % blocks * kBlock, n = std::min(kBlock, tokens - lo);
    int64_t u0 = 0, u1 = units;
    if (windows != nullptr) {
      int64_t first = rows, last = 0;
      for (int64_t t = lo; t < lo + n; ++t) {
        first = std::min<int64_t>(first, windows[2 * t]);
        last = std::max<int64_t>(last, windows[2 * t + 1]);
      }
      if (last <= first) return;
      u0 = first / kPanel;
      u1 = (last + kPanel - 1) / kPanel;
    }
    const disentangled_detail::ScoreOut o{out, heads, h, rows, scale};
    const bf16* xh = x + h * ld_head;
    const bf16* ph = packed.data() + h * per_head;
    emulated ? disentangled_detail::position_scores_amx_emulated(xh, ld_row, ph, d, o, lo, n, u0, u1)
             : disentangled_detail::position_scores_amx(xh, ld_row, ph, d, o, lo, n, u0, u1);
  });
}
#endif

}  // namespace

const char* position_scores_path_name(PositionScoresPath path) {
  switch (path) {
    case PositionScoresPath::Portable: return "Portable";
    case PositionScoresPath::Avx2: return "Avx2";
    case PositionScoresPath::Avx512: return "Avx512";
    case PositionScoresPath::Avx512Bf16: return "Avx512Bf16";
    case PositionScoresPath::Amx: return "Amx";
    case PositionScoresPath::AmxEmulated: return "AmxEmulated";
  }
  return "?";
}

// The one rule. Batch invariance: nothing here reads T, the rows or the windows. bf16 on AMX tiles where d % kAmxK
// == 0 on the AMX tiers (d = 64 on DeBERTa-v3), else on vdpbf16ps where AVX-512 BF16 is there and d is even; AVX-512
// register blocks from the avx512_vnni tier up.
PositionScoresPath choose_position_scores(const PositionScoresCall& c) {
  if (c.bf16 && amx_kernels(c.isa) && c.head_dim % kAmxK == 0)
    return c.isa == Isa::AmxEmulated ? PositionScoresPath::AmxEmulated : PositionScoresPath::Amx;
  if (BF_X86 && c.bf16 && c.isa >= Isa::Avx512Vnni && c.avx512_bf16 && c.head_dim % 2 == 0)
    return PositionScoresPath::Avx512Bf16;
  if (BF_X86 && c.isa >= Isa::Avx512Vnni) return PositionScoresPath::Avx512;
  if (BF_X86 && c.isa == Isa::Avx2) return PositionScoresPath::Avx2;
  return PositionScoresPath::Portable;
}

template <typename T>
void position_scores(const T* x, int64_t ld_row, int64_t ld_head, int64_t tokens, int64_t heads, int64_t head_dim,
                     const T* pos, int64_t rows, float scale, float* out, const int32_t* windows) {
  const PositionScoresPath path =
      choose_position_scores({sizeof(T) == 2, head_dim, active_isa(), has_avx512_bf16()});
#if BF_X86
  if constexpr (sizeof(T) == 2) {
    if (path == PositionScoresPath::Amx || path == PositionScoresPath::AmxEmulated)
      return scores_amx(x, ld_row, ld_head, tokens, heads, head_dim, pos, rows, scale, out, windows,
                        path == PositionScoresPath::AmxEmulated);
  }
#endif
  const int64_t rows_pad = (rows + 15) / 16 * 16;
  if constexpr (sizeof(T) == 2) {
    if (path == PositionScoresPath::Avx512Bf16) {
      std::vector<bf16> pos_p(heads * head_dim * rows_pad, bf16{});
      parallel_for(threads_for(heads * head_dim * rows_pad), heads, [&](int64_t h) {
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t e = 0; e < head_dim; ++e)
            pos_p[(h * head_dim + e - e % 2) * rows_pad + 2 * r + e % 2] = pos[r * heads * head_dim + h * head_dim + e];
      });
      const ScoreArgs a{ld_row, ld_head, heads, head_dim, rows, rows_pad, scale, nullptr, pos_p.data(), out, windows};
      return score_items(path, x, a, tokens);
    }
  }
  std::vector<float> pos_t(heads * head_dim * rows_pad, 0.f);
  // Transposed 16 rows at a time (whole cache lines written), heads split over threads: a row-at-a-time scatter with
  // a rows_pad stride wrote partial lines and was several times slower (benchmarks/results/2026-12-06-native-notes).
  const int nh = threads_for(heads * head_dim * rows_pad);
  parallel_for(nh, heads, [&](int64_t h) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
      for (int64_t e = 0; e < head_dim; ++e)
        for (int64_t r = r0; r < std::min(rows, r0 + 16); ++r)
          pos_t[(h * head_dim + e) * rows_pad + r] = to_float(pos[r * heads * head_dim + h * head_dim + e]);
  });
  const ScoreArgs a{ld_row, ld_head, heads, head_dim, rows, rows_pad, scale, pos_t.data(), nullptr, out, windows};
  score_items(path, x, a, tokens);
}

template void position_scores<float>(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, int64_t,
                                     float, float*, const int32_t*);
template void position_scores<bf16>(const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t, const bf16*, int64_t,
                                    float, float*, const int32_t*);

}  // namespace cpu
}  // namespace bertfast
