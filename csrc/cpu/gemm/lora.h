// LoRA terms in a GEMM's epilogue: the low-rank product (x A^T) B^T of each row's own adapter, computed per output
// tile from the row's shrunk values s = x A^T (lora_shrink, lora.cpp) instead of a stored (M, N) delta.
//
// Both forms below (scalar, 16 lanes) compute a column's term the same way: four chains d_c = fma(s[k], b[k], d_c)
// from zero over k = k0 + c, k0 + c + 4, ... in order (four, so that the fma latency overlaps), then
// y + ((d_0 + d_1) + (d_2 + d_3)). fma rounds once, so the forms give the same bits, and every epilogue of every
// kernel a tier may pick by M gives a row the same term: the engine stays batch-invariant. Factors whose B is in tile
// form (an AMX tier's bf16 or int8 engine) reach the AMX kernels alone (lora_tile_rows): the bf16 ones add the terms
// to their own C tiles before the epilogue (BF_LORA_FOLD); the int8 ones, whose C tiles hold int32 sums, compute
// them on the tiles apart (the blocked kernel per 32-row pair with BF_LORA_FOLD from zero, the streaming one per
// block in lora_expand_amx, lora_amx.cpp: the same products in the same order) for their epilogue.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/common/isa.h"
#include "cpu/common/simd.h"

namespace bertfast {
namespace cpu {

// One adapter's factor B of a slot whose N outputs are `segments` equal runs of `width` columns (q | k | v; gate | up;
// or one run): segment i reads s[k0, k1) (seg[3i..3i+2] = k0, k1, off; B is zero there outside them, so skipping the
// rest is exact) and its B^T rows [k0, k1), stored from bt + off in groups of 16 columns, each group the rows one
// after another (16 floats each, the last group zero-padded): a row's term for 16 columns reads one contiguous run.
struct LoraFactor {
  const float* bt;     // B^T by segment and 16-column group, the scale folded in; null where `tiles` holds it
  const int32_t* seg;  // (segments, 3) int32
  // B in the AMX expand's tile form instead of bt (lora_expand_amx; an AMX tier's GEMM epilogues only), or null: per
  // segment (from seg's offset, in bf16 values) and 16-column group, ceil(r / 16) B tiles of 16 pairs x 16 columns x
  // 2 over K' = [hi; lo] (hi = bf16(B), lo = bf16(B - hi), rank by rank, zero past 2r; r = k1 - k0).
  const bf16* tiles = nullptr;
};

// One factor of a 16-row block of a call on the tiles (LoraTerm::fold): the block's A tile rows for it, laid out as
// LoraTerm::sa (lda apart), the rows of other factors zero.
struct LoraFold {
  int32_t factor;
  const bf16* a;
};

// The term of one call: row m adds (s[m] . bt) where index[m] >= 0 names its factor, nothing where it is -1.
struct LoraTerm {
  const float* s;          // (M, R) fp32 rows lds apart: the shrunk rows
  int64_t lds;
  const int32_t* index;    // (M,) int32
  const LoraFactor* factors;
  int64_t width;           // columns per segment (a multiple of 16 where segments > 1)
  // The rows' shrunk values as lora_expand_amx's A tile rows (lora_tile_rows), or null: row m's from sa + m lda, per
  // segment i of its factor [s_hi | s_hi | 0...] at 2 i seg_ld and [s_lo | s_lo | 0...] seg_ld on (ranks k0..k1).
  const bf16* sa = nullptr;
  int64_t lda = 0, seg_ld = 0;
  // Per 16-row block b of the call (rows 16 b on), its factors: fold[block_at[b]] to fold[block_at[b + 1]], or null
  // (lora_tile_rows, for BF_LORA_FOLD).
  const int64_t* block_at = nullptr;
  const LoraFold* fold = nullptr;
};

// One GEMM's LoRA operands before their shrink, for a caller that shrinks the GEMM's own input itself (the whole
// layer, layer.cpp, through lora_shrink_term): per row its factor (index, as LoraTerm's), per factor A^T (at[f],
// (K, ranks[f]) as lora_shrink takes it) and B^T (factors[f]); s: where the rows' shrunk values go, (rows, rank) fp32
// with rank the widest of ranks.
struct LoraSlot {
  const int32_t* index;
  const float* const* at;
  const int64_t* ranks;
  const LoraFactor* factors;
  int64_t width;
  float* s;
  int64_t rank;
  const bf16* const* tiles = nullptr;  // per factor A^T's tile form (lora_shrink_amx), or null: lora_shrink's
};

#if BF_X86
namespace lora_detail {
// s = x A^T of `rows` (<= 16) rows on one factor on AMX tiles (lora_amx.cpp), x (rows, K) rows ldx apart, s rows lds
// apart; tiles: the factor's A^T (K, R) in tile form, per 16-rank group and 32-value step of K (zero past K) 1 KB
// of hi = bf16(A^T) then 1 KB of lo = bf16(A^T - hi), each 16 pairs of K rows x 16 ranks x 2 (pack_factors,
// bertfast/backends/cpu/lora.py). The _emulated form: the same with the tiles emulated (the amx_emulated tier).
template <typename T>
BF_TARGET_AMX void lora_shrink_amx(const T* x, int64_t ldx, int64_t K, const bf16* tiles, int64_t R, float* s,
                                   int64_t lds, int rows);
template <typename T>
BF_TARGET_AVX512 void lora_shrink_amx_emulated(const T* x, int64_t ldx, int64_t K, const bf16* tiles, int64_t R,
                                               float* s, int64_t lds, int rows);
}  // namespace lora_detail

// The terms of rows [m0, m0 + mr) (mr <= 16) at the `cols` (<= 48) columns from n (a multiple of 16) on AMX tiles
// (lora_amx.cpp), from factors in tile form (lora_on_tiles): out[i] and term[i] as lora_terms_rows gives them. The
// caller's tiles configured as amx_load_tile_config(mr) (amx_tiles.h); all eight are overwritten. The _emulated form:
// the tiles emulated.
BF_TARGET_AMX void lora_expand_amx(const LoraTerm& t, int64_t m0, int mr, int64_t n, int64_t cols, float (*out)[64],
                                   const float** term);
BF_TARGET_AVX512 void lora_expand_amx_emulated(const LoraTerm& t, int64_t m0, int mr, int64_t n, int64_t cols,
                                               float (*out)[64], const float** term);
#endif

// Whether a call's factors hold B in tile form (all or none do): the AMX kernels then take their terms on the tiles.
BF_INLINE bool lora_on_tiles(const LoraTerm* t) { return t != nullptr && t->factors[0].tiles != nullptr; }

// A GEMM call's term as its kernels take it (lora.cpp): on an AMX path (amx_path) with its rows' A tile rows
// (LoraTerm::sa) and its blocks' factors (LoraTerm::fold) where the factors hold B in tile form, written before an
// M-row GEMM of N outputs runs its kernels into buffers of the calling thread's, reused by its next call; `t` itself
// otherwise. B in tile form is for the AMX GEMMs alone (the other epilogues read bt): another path refuses it
// (std::invalid_argument).
LoraTerm lora_tile_rows(const LoraTerm& t, bool amx_path, int64_t M, int64_t N);

// The B tiles and A tile rows of one block factor's terms at the 16 columns from n (a multiple of 16): `steps` steps
// of a B tile (16 pairs x 16 columns, 1 KB) and two A tiles, [s_hi | s_hi] at a and [s_lo | s_lo] seg_ld values on.
struct LoraFoldGroup {
  const bf16* b;
  const bf16* a;
  int64_t steps;
};
BF_INLINE LoraFoldGroup lora_fold_group(const LoraTerm& t, const LoraFold& e, int64_t n) {
  int64_t seg = 0, col = n;
  for (; col >= t.width; col -= t.width) ++seg;
  const int32_t* sg = t.factors[e.factor].seg + 3 * seg;
  const int64_t steps = (sg[1] - sg[0] + 15) / 16;
  return {t.factors[e.factor].tiles + sg[2] + (col / 16) * steps * 512, e.a + 2 * seg * t.seg_ld, steps};
}

// C tile C += the terms of the 16-row block from row m (a multiple of 16) at the 16 columns from n, for each factor
// among its rows (lora_tile_rows' fold): per step, B_t = [B_hi; B_lo] into tile B, then [s_hi | s_hi] B_t and
// [s_lo | s_lo] B_t into C, the A tiles in tile A. A row's sums read only its own A row (the other factors' rows of
// it are zero), so its bits do not depend on the block it is in. The tile registers are literals (the intrinsics take
// register numbers): a macro, for amx_tiles.h's BF_TILE_* of the including kernel.
#define BF_LORA_FOLD(C, A, B, t, m, n)                                                                \
  do {                                                                                                \
    const int64_t blk_ = (m) / 16, ld_ = (t).lda * 2;                                                 \
    for (int64_t e_ = (t).block_at[blk_]; e_ < (t).block_at[blk_ + 1]; ++e_) {                        \
      const ::bertfast::cpu::LoraFoldGroup g_ = ::bertfast::cpu::lora_fold_group(t, (t).fold[e_], n); \
      for (int64_t st_ = 0; st_ < g_.steps; ++st_) {                                                  \
        BF_TILE_LOADD(B, g_.b + st_ * 512, 64);                                                       \
        BF_TILE_LOADD(A, g_.a + st_ * 32, ld_);                                                       \
        BF_TILE_DPBF16PS(C, A, B);                                                                    \
        BF_TILE_LOADD(A, g_.a + (t).seg_ld + st_ * 32, ld_);                                          \
        BF_TILE_DPBF16PS(C, A, B);                                                                    \
      }                                                                                               \
    }                                                                                                 \
  } while (0)

// The terms of a work item's rows [m0, m0 + rows) at its columns (lora_terms_rows over them all at once), for the
// epilogues of all its tiles: term[i] row m0 + i's (64 floats), null where the row has no term.
struct LoraBlock {
  int64_t m0;
  const float* const* term;
};

// The factor, shrunk row and segment of row m at column n, or false where the row has no term.
struct LoraRow {
  const float* s;
  const float* b;      // the group of column n: its row k0 (lane 0)
  int32_t k0, k1;
  int64_t col, width;  // n's column in its segment, and the segment's width
  int64_t group;       // floats between groups: 16 (k1 - k0)
};
BF_INLINE bool lora_row(const LoraTerm& t, int64_t m, int64_t n, LoraRow* r) {
  const int32_t f = t.index[m];
  if (f < 0) return false;
  int64_t seg = 0, col = n;
  for (; col >= t.width; col -= t.width) ++seg;  // a few segments at most: no division
  const int32_t* g = t.factors[f].seg + 3 * seg;
  const int64_t group = 16 * int64_t(g[1] - g[0]);
  *r = {t.s + m * t.lds, t.factors[f].bt + g[2] + (col / 16) * group, g[0], g[1], col, t.width, group};
  return true;
}

// Prefetches the B^T rows that rows [m0, m0 + mr) read at columns [n, n + cols): a streaming kernel's epilogue then
// finds them in cache, where the panel's weights streaming past had left them in memory.
BF_INLINE void lora_prefetch(const LoraTerm& t, int64_t m0, int64_t mr, int64_t n, int64_t cols) {
  int32_t last = -1;
  for (int64_t m = m0; m < m0 + mr; ++m) {
    if (t.index[m] < 0 || t.index[m] == last) continue;
    last = t.index[m];
    for (int64_t j = 0; j < cols;) {
      LoraRow r;
      lora_row(t, m, n + j, &r);
      const int64_t run = std::min(cols - j, r.width - r.col), groups = (r.col % 16 + run + 15) / 16;
      for (int64_t g = 0; g < groups; ++g)
        for (int32_t k = r.k0; k < r.k1; ++k) __builtin_prefetch(r.b + g * r.group + 16 * (k - r.k0), 0, 3);
      j += run;
    }
  }
}

// v[0, n) += the term of row m at columns [n0, n0 + n), one segment at a time; plain loops (any tier).
BF_INLINE void lora_add(const LoraTerm* t, int64_t m, int64_t n0, int64_t n, float* v) {
  if (t == nullptr) return;
  for (int64_t j0 = 0; j0 < n;) {
    LoraRow r;
    if (!lora_row(*t, m, n0 + j0, &r)) return;
    const int64_t end = std::min(n, j0 + r.width - r.col);
    float d[4][64] = {};  // n <= 64: a panel's columns (48 fp32/bf16, 16 int8)
    for (int64_t j = j0, lane = r.col % 16; j < end; lane = 0) {  // a 16-column group at a time
      const int64_t run = std::min<int64_t>(end - j, 16 - lane);
      const float* b = r.b + lane;
      for (int32_t k = r.k0; k < r.k1; ++k, b += 16) {
        const float sk = r.s[k];
        float* dc = d[(k - r.k0) & 3] + (j - j0);
        for (int64_t l = 0; l < run; ++l) dc[l] = std::fma(sk, b[l], dc[l]);
      }
      j += run;
      r.b += r.group;
    }
    for (int64_t j = 0; j < end - j0; ++j) v[j0 + j] += (d[0][j] + d[1][j]) + (d[2][j] + d[3][j]);
    j0 = end;
  }
}

#if BF_X86
// The 16- and 48-lane forms are out of line (their callers test for a term first): inlined, their accumulators
// would compete for registers with the GEMM's own in the kernels' hot loops.
#define BF_LORA_OUT_OF_LINE BF_TARGET_AVX512 __attribute__((noinline)) inline

// The terms ((d_0 + d_1) + (d_2 + d_3)) of V 16-column groups from r's (lanes mk[v]), the groups' chains interleaved:
// one broadcast of s[k] for all of them.
template <int V>
BF_TARGET_AVX512 BF_INLINE void lora_sums(const LoraRow& r, const __mmask16* mk, __m512* out) {
  __m512 d[V][4];
#pragma GCC unroll 16
  for (int i = 0; i < 4 * V; ++i) d[i / 4][i % 4] = _mm512_setzero_ps();
  const float* b = r.b;
  int32_t k = r.k0;
  for (; k + 4 <= r.k1; k += 4, b += 64) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512 s = _mm512_set1_ps(r.s[k + c]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v)
        d[v][c] = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(mk[v], b + 16 * c + v * r.group), d[v][c]);
    }
  }
#pragma GCC unroll 3
  for (int c = 0; c < 3; ++c) {  // the last k1 - k < 4 terms, chains 0.. (indices fixed: the chains stay in registers)
    if (k + c < r.k1) {
      const __m512 s = _mm512_set1_ps(r.s[k + c]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v)
        d[v][c] = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(mk[v], b + 16 * c + v * r.group), d[v][c]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) out[v] = _mm512_add_ps(_mm512_add_ps(d[v][0], d[v][1]), _mm512_add_ps(d[v][2], d[v][3]));
}

// y + the term of row m at columns [n, n + 16) (lanes mk; n a multiple of 16, so one segment).
BF_LORA_OUT_OF_LINE __m512 lora_add16_row(const LoraTerm& t, int64_t m, int64_t n, __mmask16 mk, __m512 y) {
  LoraRow r;
  if (mk == 0 || !lora_row(t, m, n, &r)) return y;
  __m512 d;
  lora_sums<1>(r, &mk, &d);
  return _mm512_add_ps(y, d);
}

// lora_add16_row on the three vectors of a 48-column panel from n (lanes mk[v]; y[v] of the empty ones untouched).
BF_LORA_OUT_OF_LINE void lora_add48_row(const LoraTerm& t, int64_t m, int64_t n, const __mmask16 (&mk)[3],
                                        __m512 (&y)[3]) {
  LoraRow r;
  if (!lora_row(t, m, n, &r)) return;
  const int vectors = mk[2] != 0 ? 3 : mk[1] != 0 ? 2 : 1;
  if (r.col + 16 * vectors > r.width) {  // the panel crosses into the next segment
    for (int v = 0; v < vectors; ++v) y[v] = lora_add16_row(t, m, n + 16 * v, mk[v], y[v]);
    return;
  }
  __m512 d[3];
  lora_sums<3>(r, mk, d);
  for (int v = 0; v < vectors; ++v) y[v] = _mm512_add_ps(y[v], d[v]);
}

BF_TARGET_AVX512 BF_INLINE void lora_add48(const LoraTerm* t, int64_t m, int64_t n, const __mmask16 (&mk)[3],
                                           __m512 (&y)[3]) {
  if (t != nullptr) lora_add48_row(*t, m, n, mk, y);
}

// y += a row's terms for a 48-column panel computed beforehand (lora_terms_rows: term, 48 floats), if it has any.
BF_TARGET_AVX512 BF_INLINE void lora_add48_terms(const float* term, const __mmask16 (&mk)[3], __m512 (&y)[3]) {
  if (term == nullptr) return;
  for (int v = 0; v < 3; ++v) y[v] = _mm512_add_ps(y[v], _mm512_maskz_loadu_ps(mk[v], term + 16 * v));
}

// lora_sums<V> of R rows sharing a factor and segment (s[i]: row i's shrunk values) into o[i] (16 V floats, all
// lanes written): a vector at a time, its four chains for the R rows in registers, each B^T vector loaded once for the
// R rows and s[k] broadcast inside the fma. The same chains summed the same way, so the same bits as lora_sums.
template <int R, int V>
BF_TARGET_AVX512 BF_INLINE void lora_sums_rows(const LoraRow& r, const float* const* s, const __mmask16* mk,
                                               float* const* o) {
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    __m512 d[R][4];
#pragma GCC unroll 24
    for (int i = 0; i < 4 * R; ++i) d[i / 4][i % 4] = _mm512_setzero_ps();
    const float* b = r.b + v * r.group;
    int32_t k = r.k0;
    for (; k + 4 <= r.k1; k += 4, b += 64) {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512 bv = _mm512_maskz_loadu_ps(mk[v], b + 16 * c);
#pragma GCC unroll 6
        for (int i = 0; i < R; ++i) d[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[i][k + c]), bv, d[i][c]);
      }
    }
#pragma GCC unroll 3
    for (int c = 0; c < 3; ++c) {  // the last k1 - k < 4 terms, chains 0..
      if (k + c < r.k1) {
        const __m512 bv = _mm512_maskz_loadu_ps(mk[v], b + 16 * c);
#pragma GCC unroll 6
        for (int i = 0; i < R; ++i) d[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(s[i][k + c]), bv, d[i][c]);
      }
    }
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i)
      _mm512_storeu_ps(o[i] + 16 * v, _mm512_add_ps(_mm512_add_ps(d[i][0], d[i][1]), _mm512_add_ps(d[i][2], d[i][3])));
  }
}

template <int R>
BF_TARGET_AVX512 BF_INLINE void lora_sums_rows_v(int vectors, const LoraRow& r, const float* const* s,
                                                 const __mmask16* mk, float* const* o) {
  switch (vectors) {
    case 1: return lora_sums_rows<R, 1>(r, s, mk, o);
    case 2: return lora_sums_rows<R, 2>(r, s, mk, o);
    case 3: return lora_sums_rows<R, 3>(r, s, mk, o);
    default: return lora_sums_rows<R, 4>(r, s, mk, o);
  }
}

// The terms of rows [m0, m0 + mr) at the `cols` (<= 64) columns from n (a multiple of 16) into out[i], the epilogue
// then adding them as lora_add16_row adds its sums (int8's finish16, 16 columns at a time); term[i] is set to out[i]
// for the rows with a term, left null for the others. Runs of consecutive rows on one factor (a
// sequence's tokens) share each B^T load, up to 6 rows at a time (6 x 4 accumulators, the B^T vectors, s[k]). A
// segment's piece writes whole 16-lane vectors (its zeros past `cols` stay inside out's 64 floats, or are overwritten
// by the next segment's piece).
BF_LORA_OUT_OF_LINE void lora_terms_rows(const LoraTerm& t, int64_t m0, int mr, int64_t n, int64_t cols,
                                         float (*out)[64], const float** term) {
  struct Piece {  // a segment's share of the columns: from column j, `vectors` vectors (lanes mk)
    LoraRow r;
    int64_t j;
    int vectors;
    __mmask16 mk[4];
  };
  Piece pieces[4];  // cols <= 64 and a segment's width a multiple of 16 where there are several: <= 4 pieces
  int npieces = 0;
  int32_t cached = -1;  // the factor `pieces` are of: runs on one factor (a sequence's rows) share them
  for (int i0 = 0; i0 < mr;) {
    const int32_t f = t.index[m0 + i0];
    if (f < 0) {
      ++i0;
      continue;
    }
    int rows = 1;
    while (rows < 6 && i0 + rows < mr && t.index[m0 + i0 + rows] == f) ++rows;
    const float* s[6];
    for (int i = 0; i < rows; ++i) {
      s[i] = t.s + (m0 + i0 + i) * t.lds;
      term[i0 + i] = out[i0 + i];
    }
    if (f != cached) {
      npieces = 0;
      for (int64_t j = 0; j < cols;) {
        Piece& p = pieces[npieces++];
        lora_row(t, m0 + i0, n + j, &p.r);
        p.j = j;
        p.vectors = int(std::min<int64_t>({(cols - j + 15) / 16, (p.r.width - p.r.col + 15) / 16, 4}));
        const int64_t run = std::min<int64_t>(cols - j, p.r.width - p.r.col);
        for (int v = 0; v < 4; ++v) p.mk[v] = v < p.vectors ? tail_mask(run - 16 * v) : 0;
        j += std::min<int64_t>(16 * p.vectors, p.r.width - p.r.col);
      }
      cached = f;
    }
    for (int q = 0; q < npieces; ++q) {
      const Piece& p = pieces[q];
      float* o[6];
      for (int i = 0; i < rows; ++i) o[i] = out[i0 + i] + p.j;
      switch (rows) {
        case 1: lora_sums_rows_v<1>(p.vectors, p.r, s, p.mk, o); break;
        case 2: lora_sums_rows_v<2>(p.vectors, p.r, s, p.mk, o); break;
        case 3: lora_sums_rows_v<3>(p.vectors, p.r, s, p.mk, o); break;
        case 4: lora_sums_rows_v<4>(p.vectors, p.r, s, p.mk, o); break;
        case 5: lora_sums_rows_v<5>(p.vectors, p.r, s, p.mk, o); break;
        default: lora_sums_rows_v<6>(p.vectors, p.r, s, p.mk, o); break;
      }
    }
    i0 += rows;
  }
}
#endif

}  // namespace cpu
}  // namespace bertfast
