// The LoRA shrink (lora.h): s[m] = x[m] A^T on row m's own factor, each value an fma chain over k in order from zero,
// so a row's bits are its own whatever rows share its block. Rows of one factor go in blocks of up to kRows that
// share the loads of A (stored transposed, (K, R) with R a multiple of 16); on the AMX tiers a factor packed with
// its tile form goes in blocks of up to 16 rows on the tiles (lora_amx.cpp). lora_shrink_term: a LoraSlot's rows
// shrunk into their term (the whole layer's GEMMs).
#include "cpu/gemm/lora.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "cpu/common/amx_tiles.h"
#include "cpu/common/kernels.h"
#include "cpu/common/parallel.h"

namespace bertfast {
namespace cpu {

namespace {

constexpr int kRows = 8;

struct Block {
  int64_t m0;
  int rows;
  int32_t factor;
  bool tiles;  // on AMX tiles (lora_shrink_amx)
};

// Columns [c0, c0 + 16 CH) of the rows' s, CH 16-column chunks in one pass over x: each x value broadcast once for
// all of them (one chunk at a time, the loads of x and A outnumbered the fmas).
template <int ROWS, int CH, typename T>
BF_INLINE void shrink_chunks(const T* x, int64_t ldx, int64_t K, const float* at, int64_t R, int64_t c0, float* s,
                             int64_t lds) {
  float acc[ROWS][16 * CH] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* a = at + k * R + c0;
    // Rank 16: A^T is one cache line a k, asked for 32 ahead; the hardware's prefetch alone left the fmas waiting.
    if (R == 16) __builtin_prefetch(a + 32 * R, 0, 3);
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; ++i) {
      const float xv = to_float(x[i * ldx + k]);
#pragma omp simd
      for (int c = 0; c < 16 * CH; ++c) acc[i][c] = __builtin_fmaf(xv, a[c], acc[i][c]);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int c = 0; c < 16 * CH; ++c) s[i * lds + c0 + c] = acc[i][c];
}

// s = x A^T for ROWS rows on one factor (R a multiple of 16): up to three chunks a pass.
template <int ROWS, typename T>
BF_INLINE void shrink_block(const T* x, int64_t ldx, int64_t K, const float* at, int64_t R, float* s, int64_t lds) {
  for (int64_t c0 = 0; c0 < R;) {
    const int64_t chunks = std::min<int64_t>(ROWS <= 4 ? 3 : 2, (R - c0) / 16);
    if (chunks == 3) shrink_chunks<ROWS, 3>(x, ldx, K, at, R, c0, s, lds);
    else if (chunks == 2) shrink_chunks<ROWS, 2>(x, ldx, K, at, R, c0, s, lds);
    else shrink_chunks<ROWS, 1>(x, ldx, K, at, R, c0, s, lds);
    c0 += 16 * chunks;
  }
}

template <typename T>
BF_INLINE void shrink_rows(const T* x, int64_t ldx, int64_t K, const float* const* at, const int64_t* ranks,
                           float* s, int64_t lds, const Block& b) {
  const T* xb = x + b.m0 * ldx;
  float* sb = s + b.m0 * lds;
  const float* a = at[b.factor];
  const int64_t R = ranks[b.factor];
  switch (b.rows) {
    case 1: return shrink_block<1>(xb, ldx, K, a, R, sb, lds);
    case 2: return shrink_block<2>(xb, ldx, K, a, R, sb, lds);
    case 3: return shrink_block<3>(xb, ldx, K, a, R, sb, lds);
    case 4: return shrink_block<4>(xb, ldx, K, a, R, sb, lds);
    case 5: return shrink_block<5>(xb, ldx, K, a, R, sb, lds);
    case 6: return shrink_block<6>(xb, ldx, K, a, R, sb, lds);
    case 7: return shrink_block<7>(xb, ldx, K, a, R, sb, lds);
    default: return shrink_block<kRows>(xb, ldx, K, a, R, sb, lds);
  }
}

template <typename T>
void shrink_generic(const T* x, int64_t ldx, int64_t K, const float* const* at, const int64_t* ranks, float* s,
                    int64_t lds, const Block& b) {
  shrink_rows(x, ldx, K, at, ranks, s, lds, b);
}

#if BF_X86
template <typename T>
BF_TARGET_AVX2 void shrink_avx2(const T* x, int64_t ldx, int64_t K, const float* const* at, const int64_t* ranks,
                                float* s, int64_t lds, const Block& b) {
  shrink_rows(x, ldx, K, at, ranks, s, lds, b);
}

template <typename T>
BF_TARGET_AVX512 void shrink_avx512(const T* x, int64_t ldx, int64_t K, const float* const* at,
                                    const int64_t* ranks, float* s, int64_t lds, const Block& b) {
  shrink_rows(x, ldx, K, at, ranks, s, lds, b);
}
#endif

}  // namespace

template <typename T>
void lora_shrink(const T* x, int64_t ldx, int64_t M, int64_t K, const int32_t* index, const float* const* at,
                 const int64_t* ranks, float* s, int64_t lds, const bf16* const* tiles) {
  const Isa isa = active_isa();
  const bool amx = amx_kernels(isa) && tiles != nullptr;
  std::vector<Block> blocks;
  for (int64_t m = 0; m < M;) {
    const bool on_tiles = amx && index[m] >= 0 && tiles[index[m]] != nullptr;
    const int64_t most = on_tiles ? 16 : kRows;
    int64_t end = m + 1;
    while (end < M && end - m < most && index[end] == index[m]) ++end;
    if (index[m] >= 0) blocks.push_back({m, int(end - m), index[m], on_tiles});
    m = end;
  }
  int64_t work = 0;
  for (const Block& b : blocks) work += b.rows * K * ranks[b.factor];
  parallel_for(threads_for(work / 16), int64_t(blocks.size()), [&](int64_t i) {
    const Block& b = blocks[i];
#if BF_X86
    if (b.tiles) {
      const auto run = isa == Isa::AmxEmulated ? lora_detail::lora_shrink_amx_emulated<T>
                                                  : lora_detail::lora_shrink_amx<T>;
      return run(x + b.m0 * ldx, ldx, K, tiles[b.factor], ranks[b.factor], s + b.m0 * lds, lds, b.rows);
    }
#endif
    BF_DISPATCH(shrink, x, ldx, K, at, ranks, s, lds, b);
  });
}

[[noreturn]] static void throw_tiles_off_amx() {
  throw std::invalid_argument("lora: B in tile form needs an AMX GEMM (amx tiers: bf16 with K % 32 == 0, int8 with "
                              "K % 64 == 0); this call takes another kernel: give bt instead");
}

#if BF_X86
namespace {

// Rows [m0, m1) of t's A tile rows (LoraTerm::sa) into sa: per segment of the row's factor [hi | hi | 0...] and
// [lo | lo | 0...], hi = bf16(s) and lo = bf16(s - hi) rounded as VCVTNEPS2BF16 rounds (cvtneps_bf16); base rows zero.
BF_TARGET_AVX512 void tile_rows(const LoraTerm& t, int64_t segments, int64_t m0, int64_t m1, bf16* sa, int64_t lda,
                                int64_t seg_ld) {
  for (int64_t m = m0; m < m1; ++m) {
    bf16* row = sa + m * lda;
    std::fill(row, row + lda, bf16{0});
    const int32_t f = t.index[m];
    if (f < 0) continue;
    for (int64_t i = 0; i < segments; ++i) {
      const int32_t* g = t.factors[f].seg + 3 * i;
      const int r = g[1] - g[0];
      bf16 *a1 = row + 2 * i * seg_ld, *a2 = a1 + seg_ld;
      for (int k = 0; k < r; k += 16) {
        const __mmask16 mk = tail_mask(r - k);
        const __m512 v = _mm512_maskz_loadu_ps(mk, t.s + m * t.lds + g[0] + k);
        const __m256i h = cvtneps_bf16(v), l = cvtneps_bf16(_mm512_sub_ps(v, widen_bf16(h)));
        for (bf16* p : {a1 + k, a1 + r + k}) _mm256_mask_storeu_epi16(p, mk, h);
        for (bf16* p : {a2 + k, a2 + r + k}) _mm256_mask_storeu_epi16(p, mk, l);
      }
    }
  }
}

}  // namespace

// The factors of each 16-row block of M rows with A tile rows sa (lda apart), as LoraTerm::fold: a block on one
// factor (with or without base rows, whose A rows are zero) reads sa itself; a block mixing factors, per factor a
// copy of its rows with the others' zeroed.
static void fold_blocks(const int32_t* index, int64_t M, const bf16* sa, int64_t lda, std::vector<int64_t>& at,
                        std::vector<LoraFold>& fold, std::vector<bf16>& masked) {
  const int64_t blocks = (M + 15) / 16;
  at.assign(blocks + 1, 0);
  fold.clear();
  std::vector<int64_t> copies;  // the entries that take a copy, in order
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t m0 = 16 * b, m1 = std::min(M, m0 + 16), first = int64_t(fold.size());
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t f = index[m];
      bool seen = f < 0;
      for (int64_t e = first; e < int64_t(fold.size()) && !seen; ++e) seen = fold[e].factor == f;
      if (!seen) fold.push_back({f, sa + m0 * lda});
    }
    if (int64_t(fold.size()) - first > 1)
      for (int64_t e = first; e < int64_t(fold.size()); ++e) copies.push_back(e);
    at[b + 1] = int64_t(fold.size());
  }
  masked.assign(copies.size() * 16 * lda, bf16{0});
  for (size_t i = 0; i < copies.size(); ++i) {
    LoraFold& e = fold[copies[i]];
    const int64_t m0 = (e.a - sa) / lda;
    bf16* dst = masked.data() + i * 16 * lda;
    for (int64_t m = m0; m < std::min(M, m0 + 16); ++m)
      if (index[m] == e.factor) std::copy(sa + m * lda, sa + (m + 1) * lda, dst + (m - m0) * lda);
    e.a = dst;
  }
}

LoraTerm lora_tile_rows(const LoraTerm& t, bool amx_path, int64_t M, int64_t N) {
  if (!lora_on_tiles(&t)) return t;
  if (!amx_path) throw_tiles_off_amx();
  if (M == 0) return t;
  static thread_local std::vector<bf16> buf;  // reused: a fresh one per call faulted in its pages every time
  const int64_t segments = N / t.width;
  int32_t factors = 0;
  for (int64_t m = 0; m < M; ++m) factors = std::max(factors, t.index[m] + 1);
  int64_t seg_ld = 32;  // the widest segment's A tile row: 32 values per 16 ranks
  for (int32_t f = 0; f < factors; ++f)
    for (int64_t i = 0; i < segments; ++i)
      seg_ld = std::max<int64_t>(seg_ld, (t.factors[f].seg[3 * i + 1] - t.factors[f].seg[3 * i] + 15) / 16 * 32);
  const int64_t lda = 2 * segments * seg_ld, blocks = (M + 63) / 64;
  buf.resize(M * lda);
  bf16* const sa = buf.data();  // this thread's buffer: `buf` named inside the workers would be theirs
  parallel_for(threads_for(M * lda), blocks, [&](int64_t b) {
    tile_rows(t, segments, b * 64, std::min(M, b * 64 + 64), sa, lda, seg_ld);
  });
  LoraTerm out = t;
  out.sa = sa, out.lda = lda, out.seg_ld = seg_ld;
  static thread_local std::vector<int64_t> at;
  static thread_local std::vector<LoraFold> folds;
  static thread_local std::vector<bf16> masked;
  fold_blocks(t.index, M, sa, lda, at, folds, masked);
  out.block_at = at.data(), out.fold = folds.data();
  return out;
}
#else
LoraTerm lora_tile_rows(const LoraTerm& t, bool, int64_t, int64_t) {
  if (lora_on_tiles(&t)) throw_tiles_off_amx();
  return t;
}
#endif

template <typename T>
void lora_shrink_term(const LoraSlot& slot, int64_t t0, const T* x, int64_t ldx, int64_t M, int64_t K,
                      LoraTerm* term) {
  const int32_t* index = slot.index + t0;
  float* s = slot.s + t0 * slot.rank;
  lora_shrink(x, ldx, M, K, index, slot.at, slot.ranks, s, slot.rank, slot.tiles);
  *term = {s, slot.rank, index, slot.factors, slot.width};
}

template void lora_shrink<float>(const float*, int64_t, int64_t, int64_t, const int32_t*, const float* const*,
                                 const int64_t*, float*, int64_t, const bf16* const*);
template void lora_shrink<bf16>(const bf16*, int64_t, int64_t, int64_t, const int32_t*, const float* const*,
                                const int64_t*, float*, int64_t, const bf16* const*);

template void lora_shrink_term<float>(const LoraSlot&, int64_t, const float*, int64_t, int64_t, int64_t, LoraTerm*);
template void lora_shrink_term<bf16>(const LoraSlot&, int64_t, const bf16*, int64_t, int64_t, int64_t, LoraTerm*);

}  // namespace cpu
}  // namespace bertfast
