// The LoRA shrink (lora.h): s[m] = x[m] A^T on row m's own factor, each value an fma chain over k in order from zero,
// so a row's bits are its own whatever rows share its block. Rows of one factor go in blocks of up to kRows that
// share the loads of A (stored transposed, (K, R) with R a multiple of 16); on the AMX tiers a factor packed with
// its tile form goes in blocks of up to 16 rows on the tiles (lora_amx.cpp). lora_shrink_term: a LoraSlot's rows
// shrunk into their term (the whole layer's GEMMs).
#include "cpu/gemm/lora.h"

#include <algorithm>
#include <vector>

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
