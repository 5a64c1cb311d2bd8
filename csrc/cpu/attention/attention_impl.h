// Internals shared by the attention's files (attention*.cpp): tile sizes, the work items (attention_items.h), the
// per-thread scratch, the position bias and window of a tile, and attention_thread, the driver
// of the fp32-math tiers over a tier's `Block`; each tier's entry point (the dispatch is attention.cpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "cpu/attention/attention_items.h"
#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/scalar_math.h"
#include "cpu/common/simd.h"
#include "cpu/common/vec_math.h"
#include "cpu/common/parallel.h"

namespace bertfast {
namespace cpu {

// The attention kernels, one per path (attention.cpp dispatches on choose_attention's answer).
enum class AttentionPath : int {
  Portable,     // fp32 math, plain loops (attention_portable.cpp)
  Avx2,         // fp32 math on AVX2 (attention_avx2.cpp)
  Avx512,       // fp32 math on AVX-512 (attention_avx512.cpp)
  Avx512Bf16,   // bf16 products on vdpbf16ps (attention_avx512bf16.cpp)
  Int16,        // int16 products on AVX-512 VNNI without AVX-512 BF16 (attention_avx512int16.cpp)
  Amx,          // bf16 products on AMX tiles (attention_amx.cpp)
  AmxEmulated,  // the same with the tiles emulated (the amx_emulated tier)
};
const char* attention_path_name(AttentionPath path);

// What the choice reads: the layer (dtype, head_dim, position bias, window) and the tier, none of the call's lengths.
struct AttentionCall {
  bool bf16;             // q, k, v are bf16 (else fp32)
  bool bf16_products;    // fp32 q, k, v whose products may run on bf16 operands (the int8 path)
  int64_t head_dim;
  bool has_bias;         // a relative position bias (AttnBias)
  int64_t window;        // > 0: a sliding window
  Isa isa;               // the tier (active_isa())
  bool avx512_bf16;      // AVX-512 BF16 present and not hidden (has_avx512_bf16())
};
AttentionPath choose_attention(const AttentionCall& call);

namespace attention_detail {

constexpr int64_t kQBlock = 32;
constexpr int64_t kKBlock = 64;
static_assert(kKBlock % kQBlock == 0, "a query block lies inside one key tile (its diagonal tile)");

// Buffers of one thread, in fp32. d_pad = head_dim rounded up to 16 (zero columns): no tail handling along head_dim.
struct Scratch {
  std::vector<float> qf;   // [kQBlock][d_pad], pre-scaled, rows past the block end zero; by key: [d][its block]
  std::vector<float> kt;   // [key tiles][d][kKBlock], K transposed per tile, keys past the end zero; by key:
                           // [keys rounded to 16][d_pad], K's rows
  std::vector<float> vf;   // [keys rounded to kKBlock][d_pad]
  std::vector<float> acc;  // [kQBlock][d_pad], written (not added to) by the first key tile
  std::vector<float> s;    // [kQBlock][kKBlock] scores, then probabilities; by key: [kKBlock][its block]
  float m[kQBlock], l[kQBlock];
};
Scratch& thread_scratch();  // this thread's, kept across calls (attention.cpp)

// The position bias of one (query block, key tile): score (i, j) += row[kpos[j] - qpos[i]], row = this head's
// table row at distance 0; or DeBERTa-v2's terms (index != nullptr): c = index[qpos[i] - kpos[j]] (index at
// distance 0) and score (i, j) += c2p[i * stride + c] + p2c[j * stride + c], c2p / p2c at this head's row of the
// block's first query / the tile's first key (either may be nullptr); row == index == nullptr: no bias.
struct TileBias {
  const float* row = nullptr;
  const int32_t *qpos = nullptr, *kpos = nullptr;
  const int32_t* index = nullptr;
  const float *c2p = nullptr, *p2c = nullptr;
  int64_t stride = 0;
};

// The tile of `bias` for query rows [q0, q0 + qn) and keys from k0 of the sequence starting at token `start`, head h.
BF_INLINE TileBias tile_bias(const AttnBias& bias, int64_t heads, int64_t h, int64_t start, int64_t q0, int64_t k0) {
  TileBias tb;
  tb.qpos = bias.pos + start + q0;
  tb.kpos = bias.pos + start + k0;
  if (bias.index == nullptr) {
    tb.row = bias.table + h * bias.width + (bias.width - 1) / 2;
    return tb;
  }
  tb.index = bias.index + (bias.width - 1) / 2;
  tb.stride = heads * bias.cols;
  if (bias.c2p != nullptr) tb.c2p = bias.c2p + ((start + q0) * heads + h) * bias.cols;
  if (bias.p2c != nullptr) tb.p2c = bias.p2c + ((start + k0) * heads + h) * bias.cols;
  return tb;
}

// DeBERTa-v2's terms on the tile (see TileBias): their sum added to each score, as transformers adds c2p + p2c.
template <bool kC2p, bool kP2c>
BF_INLINE void add_disentangled(float* s, const TileBias& b, int64_t qn, int64_t kn) {
  for (int64_t i = 0; i < qn; ++i) {
    const int32_t* idx = b.index + b.qpos[i];
    const float* c2p = b.c2p + (kC2p ? i * b.stride : 0);
    float* si = s + i * kKBlock;
    for (int64_t j = 0; j < kn; ++j) {
      const int32_t c = idx[-b.kpos[j]];
      float term = kC2p ? c2p[c] : 0.f;
      if (kP2c) term += b.p2c[j * b.stride + c];
      si[j] += term;
    }
  }
}

// Adds the bias to the tile's scores s [qn][kKBlock] (kn keys); inlined into each tier's block.
BF_INLINE void add_bias(float* s, const TileBias& b, int64_t qn, int64_t kn) {
  if (b.index != nullptr) {
    if (b.c2p != nullptr && b.p2c != nullptr) add_disentangled<true, true>(s, b, qn, kn);
    else if (b.c2p != nullptr) add_disentangled<true, false>(s, b, qn, kn);
    else if (b.p2c != nullptr) add_disentangled<false, true>(s, b, qn, kn);
    return;
  }
  if (b.row == nullptr) return;
  for (int64_t i = 0; i < qn; ++i) {
    const float* row = b.row - b.qpos[i];
    float* si = s + i * kKBlock;
#pragma omp simd
    for (int64_t j = 0; j < kn; ++j) si[j] += row[b.kpos[j]];
  }
}

// The sliding window on one (query block, key tile): query row i sees key j of the tile iff
// |j + offset - i| <= window, offset = the tile's first key minus the block's first query. window == 0: every
// row sees every key of the tile (no window, or a tile inside all the rows' windows): nothing is masked.
struct TileWindow {
  int64_t window = 0, offset = 0;
};

// Sets s[i][j] = value for the keys j < kn outside row i's window, rows i < qn (the scores before the softmax:
// -inf; the probabilities after it: 0, since exp of -inf is clamped to ~1e-38 there, not 0).
BF_INLINE void mask_window(float* s, const TileWindow& w, int64_t qn, int64_t kn, float value) {
  if (w.window == 0) return;
  for (int64_t i = 0; i < qn; ++i) {
    const int64_t lo = std::clamp<int64_t>(i - w.offset - w.window, 0, kn);
    const int64_t hi = std::clamp<int64_t>(i - w.offset + w.window + 1, lo, kn);
    float* si = s + i * kKBlock;
    for (int64_t j = 0; j < lo; ++j) si[j] = value;
    for (int64_t j = hi; j < kn; ++j) si[j] = value;
  }
}

#if BF_X86
// In-register transpose of a 16 x 16 fp32 block (r[i] = row i on entry, column i on exit).
BF_TARGET_AVX512 BF_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c]: rows 4i..4i+3 of column c within each 128-bit lane
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), w0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD), w1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    r[4 + c] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

// The online softmax's rescale for a new maximum: rows [0, qn) of acc (dp floats apart, dp a multiple of 16) times
// their queries' alpha.
BF_TARGET_AVX512 BF_INLINE void rescale_rows(float* acc, const float* alpha, int64_t qn, int64_t dp) {
  for (int64_t i = 0; i < qn; ++i) {
    const __m512 av = _mm512_set1_ps(alpha[i]);
    for (int64_t e = 0; e < dp; e += 16)
      _mm512_storeu_ps(acc + i * dp + e, _mm512_mul_ps(_mm512_loadu_ps(acc + i * dp + e), av));
  }
}

// DeBERTa-v2's terms on 16 lanes where the tile is affine: its queries' and keys' positions consecutive and the index
// one column per distance over the distances between them, so c(i, j) = c0 + i - j. Then a query's c2p entries for
// 16 keys are 16 consecutive floats (reversed) and 16 keys' p2c entries for 16 queries one 16 x 16 block (rows
// read straight, transposed in registers): the scalar loop's gathers become loads. Only entries of pairs (i < qn,
// j < kn) are read, as by add_disentangled (masked loads), and each score gets the same two additions in the same
// order (term = c2p + p2c, then s += term): the same bits, so which tiles take this path does not matter.
BF_TARGET_AVX512 BF_INLINE bool affine_tile(const TileBias& b, int64_t qn, int64_t kn, int32_t* c0) {
  const int32_t q0 = b.qpos[0], k0 = b.kpos[0];
  for (int64_t i = 1; i < qn; ++i)
    if (b.qpos[i] != q0 + i) return false;
  for (int64_t j = 1; j < kn; ++j)
    if (b.kpos[j] != k0 + j) return false;
  const int32_t* idx = b.index + (q0 - k0);  // the column of distance q0 - k0 + r at idx[r]
  for (int64_t r = 1 - kn; r < qn - 1; ++r)
    if (idx[r + 1] != idx[r] + 1) return false;
  *c0 = idx[0];
  return true;
}

template <bool kC2p, bool kP2c>
BF_TARGET_AVX512 BF_INLINE void add_disentangled512(float* s, const TileBias& b, int64_t qn, int64_t kn, int32_t c0) {
  const __m512i reverse = _mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i0 = 0; i0 < qn; i0 += 16) {
    const int64_t nq = std::min<int64_t>(16, qn - i0);
    for (int64_t j0 = 0; j0 < kn; j0 += 16) {
      const int64_t nk = std::min<int64_t>(16, kn - j0);
      const __mmask16 keys = tail_mask(nk);
      __m512 p2c[16];  // p2c[m]: query i0 + m's p2c terms for keys j0 .. j0 + 15
      if constexpr (kP2c) {
        const __mmask16 queries = tail_mask(nq);
        for (int l = 0; l < 16; ++l)  // row l: key j0 + l's terms for queries i0 .. i0 + 15
          p2c[l] = l < nk ? _mm512_maskz_loadu_ps(queries, b.p2c + (j0 + l) * b.stride + c0 + i0 - (j0 + l))
                          : _mm512_setzero_ps();
        transpose16(p2c);
      }
      // Key j0 + l's c2p column for query i is c0 + i - j0 - l: memory element 15 - l of the 16 from c0 + i - j0 - 15.
      const __mmask16 keys_reversed = __mmask16(uint32_t(keys) << (16 - nk));
      for (int64_t m = 0; m < nq; ++m) {
        const int64_t i = i0 + m;
        __m512 term = _mm512_setzero_ps();
        if constexpr (kC2p) {
          const float* row = b.c2p + i * b.stride + c0 + i - j0 - 15;
          term = _mm512_permutexvar_ps(reverse, _mm512_maskz_loadu_ps(keys_reversed, row));
        }
        if constexpr (kP2c) term = _mm512_add_ps(term, p2c[m]);
        float* si = s + i * kKBlock + j0;
        _mm512_mask_storeu_ps(si, keys, _mm512_add_ps(_mm512_maskz_loadu_ps(keys, si), term));
      }
    }
  }
}

// add_bias for the AVX-512 tiers' blocks (AVX-512 and AMX): DeBERTa-v2's affine tiles on 16 lanes, the rest as
// add_bias.
BF_TARGET_AVX512 BF_INLINE void add_bias512(float* s, const TileBias& b, int64_t qn, int64_t kn) {
  int32_t c0;
  if (b.index != nullptr && qn > 0 && kn > 0 && affine_tile(b, qn, kn, &c0)) {
    if (b.c2p != nullptr && b.p2c != nullptr) add_disentangled512<true, true>(s, b, qn, kn, c0);
    else if (b.c2p != nullptr) add_disentangled512<true, false>(s, b, qn, kn, c0);
    else if (b.p2c != nullptr) add_disentangled512<false, true>(s, b, qn, kn, c0);
    return;
  }
  add_bias(s, b, qn, kn);
}
#endif

// The key tiles [lo, hi] that query rows [q0, q0 + qn) of a sequence of len keys visit (all of them without a window,
// w == 0; else those meeting [q0 - w, q0 + qn - 1 + w]), in the order every kernel takes them: the diagonal tile
// first (the one holding rows q0..q0 + qn - 1 as keys; tile 0 without a window), so every row has a key in the first
// tile, then the others in order.
struct TileWalk {
  int64_t lo, hi, diag;
  TileWalk(int64_t q0, int64_t qn, int64_t len, int64_t w)
      : lo(w == 0 ? 0 : std::max<int64_t>(0, q0 - w) / kKBlock),
        hi(w == 0 ? (len - 1) / kKBlock : std::min<int64_t>(len - 1, q0 + qn - 1 + w) / kKBlock),
        diag(w == 0 ? 0 : q0 / kKBlock) {}
  int64_t count() const { return hi - lo + 1; }
  // The n-th tile visited, n < count().
  int64_t tile(int64_t n) const {
    if (n == 0) return diag;
    return lo + n - 1 >= diag ? lo + n : lo + n - 1;
  }
};

template <typename T, typename Block>
BF_INLINE void attention_thread(const T* q, const T* k, const T* v, const AttnStrides& st,
                                const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t d, float scale,
                                T* out, std::atomic<int64_t>* next, const AttnBias* bias, int64_t window) {
  DenormalGuard ftz;
  const int64_t H = heads * d;
  const int64_t dp = (d + 15) / 16 * 16;
  // Kept per thread across calls (at small batches allocation would cost more), reached through a reference returned
  // once: one to the thread_local itself had its address looked up again (__tls_get_addr) at each use after a call.
  Scratch& sc = thread_scratch();
  constexpr int64_t qrows = Block::kQueryRows;  // a query block's rows at most: by row kQBlock, by key more
  sc.qf.resize(qrows * dp);
  sc.acc.resize(qrows * dp);
  sc.s.resize(qrows * kKBlock);
  WorkItems items{next, cu_seqlens, batch * heads, heads};
  for_each_item(items, q, k, v, out, st, d, [&](int64_t h, int64_t start, int64_t len, RowPrefetch& pf) {
    const int64_t tiles = (len + kKBlock - 1) / kKBlock;
    const int64_t w = window < len - 1 ? window : 0;  // a window reaching every key is no window
    int64_t runs = 0;  // (query block, key tile) pairs this item computes
    for (int64_t q0 = 0; q0 < len; q0 += kQBlock)
      runs += TileWalk(q0, std::min<int64_t>(kQBlock, len - q0), len, w).count();
    const int64_t rows_per_run = (pf.rows + runs - 1) / runs;  // the next item's rows (none after the last)
    // A tier whose Block computes the scores by key (Block::kByKey) does so for every item without a position
    // bias or a window: which items take it depends on the model and the item's own length, not on the batch.
    const bool by_key = Block::kByKey && bias == nullptr && w == 0;
    // K transposed per key tile (or as rows, by key) and V, widened once for every query block of this
    // (sequence, head). Keys past the end of a tile are masked out of the softmax and never read from V; the
    // columns of V past head_dim (to d_pad) must be zero (they are accumulated, then dropped).
    sc.vf.resize(tiles * kKBlock * dp);
    if (!by_key) {
      sc.kt.resize(tiles * d * kKBlock);
      Block::template load_kt<T>(k + start * st.k_row + h * st.k_head, st.k_row, len, d, sc.kt.data());
    }
    for (int64_t j = 0; j < len; ++j) {
      const T* vs = v + (start + j) * st.v_row + h * st.v_head;
      float* vd = sc.vf.data() + j * dp;
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) vd[e] = to_float(vs[e]);
      for (int64_t e = d; e < dp; ++e) vd[e] = 0.f;
    }
    if constexpr (Block::kByKey) {
      if (by_key) {
        Block::template item_by_key<T>(sc, q + start * st.q_row + h * st.q_head, st.q_row,
                                       k + start * st.k_row + h * st.k_head, st.k_row, len, d, dp, scale,
                                       out + start * H + h * d, H, pf);
        return;
      }
    }
    for (int64_t q0 = 0; q0 < len; q0 += kQBlock) {
      const int64_t qn = std::min<int64_t>(kQBlock, len - q0);
      for (int64_t i = 0; i < qn; ++i) {
        const T* src = q + (start + q0 + i) * st.q_row + h * st.q_head;
        float* dst = sc.qf.data() + i * dp;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) dst[e] = to_float(src[e]) * scale;
        for (int64_t e = d; e < dp; ++e) dst[e] = 0.f;
        sc.m[i] = -INFINITY;
        sc.l[i] = 0.f;
      }
      // The register tiles read up to a multiple of 4 rows: zero queries past the end.
      std::fill(sc.qf.begin() + qn * dp, sc.qf.begin() + kQBlock * dp, 0.f);
      const TileWalk walk(q0, qn, len, w);
      for (int64_t n = 0; n < walk.count(); ++n) {
        const int64_t t = walk.tile(n), k0 = t * kKBlock;
        const int64_t kn = std::min<int64_t>(kKBlock, len - k0);
        pf.step(rows_per_run);
        TileBias tb;
        if (bias != nullptr) tb = tile_bias(*bias, heads, h, start, q0, k0);
        TileWindow tw;  // masks only a tile some row's window leaves part of
        if (w > 0 && (k0 + kn - 1 - q0 > w || q0 + qn - 1 - k0 > w)) tw = {w, k0 - q0};
        Block::run(sc, sc.kt.data() + t * d * kKBlock, sc.vf.data() + t * kKBlock * dp, qn, kn, d, dp, n == 0, tb, tw);
      }
      for (int64_t i = 0; i < qn; ++i) {
        const float inv = 1.0f / sc.l[i];
        const float* a = sc.acc.data() + i * dp;
        T* o = out + (start + q0 + i) * H + h * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) o[e] = from_float<T>(a[e] * inv);
      }
    }
  });
}

// The tiers' entry points: one thread's share of the (sequence, head) items, claimed from `next`.
// fp32 math (attention_thread) on the portable (attention_portable.cpp), AVX2 (attention_avx2.cpp) and
// AVX-512 (attention_avx512.cpp) tiers.
template <typename T>
void attention_generic(const T* q, const T* k, const T* v, const AttnStrides& st, const int32_t* cu, int64_t batch,
                       int64_t heads, int64_t d, float scale, T* out, std::atomic<int64_t>* next,
                       const AttnBias* bias, int64_t window);
#if BF_X86
template <typename T>
BF_TARGET_AVX2 void attention_avx2(const T* q, const T* k, const T* v, const AttnStrides& st, const int32_t* cu,
                                   int64_t batch, int64_t heads, int64_t d, float scale, T* out,
                                   std::atomic<int64_t>* next, const AttnBias* bias, int64_t window);
template <typename T>
BF_TARGET_AVX512 void attention_avx512(const T* q, const T* k, const T* v, const AttnStrides& st, const int32_t* cu,
                                       int64_t batch, int64_t heads, int64_t d, float scale, T* out,
                                       std::atomic<int64_t>* next, const AttnBias* bias, int64_t window);
// AMX tiles, bf16 products (attention_amx.cpp): head_dim <= 64, with or without a position bias and a window.
template <typename T>  // bf16, or fp32 rounded to bf16 as it is packed
BF_TARGET_AMX void attention_amx(const T* q, const T* k, const T* v, const AttnStrides& st,
                                 const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t d, float scale,
                                 T* out, std::atomic<int64_t>* next, const AttnBias* bias, int64_t window);
// The same kernel with the tiles emulated (attention_amx.cpp built with BF_AMX_EMULATED, the amx_emulated tier).
template <typename T>
BF_TARGET_AVX512 void attention_amx_emulated(const T* q, const T* k, const T* v, const AttnStrides& st,
                                             const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t d,
                                             float scale, T* out, std::atomic<int64_t>* next,
                                             const AttnBias* bias, int64_t window);
// bf16 products on AVX-512 BF16 without AMX (attention_avx512bf16.cpp): head_dim <= 64, no position bias; window > 0:
// a sliding window (the bf16 dtype's calls; the int8 path's take none).
// T: fp32 q, k, v, or bf16 (the int8 QKV GEMM's output rounded: int8_linear_bf16; the bf16 dtype's); O: the output's
// type; kSplit: P V on P in two bf16 parts (the bf16 dtype), else P rounded once (int8).
template <typename T, typename O, bool kSplit>
BF_TARGET_AVX512BF16 void attention_avx512bf16(const T* q, const T* k, const T* v, const AttnStrides& st,
                                               const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t d,
                                               float scale, O* out, std::atomic<int64_t>* next, int64_t window);
#endif

// Defines an fp32-math tier's entry point `name` (declared above), compiled for `TARGET` (empty: the build's
// baseline): attention_thread on the tier's `Block`, for float and bf16. Each tier's file expands it once.
#define BF_ATTENTION_TIER(name, TARGET, Block)                                                                        \
  template <typename T>                                                                                               \
  TARGET void name(const T* q, const T* k, const T* v, const AttnStrides& st, const int32_t* cu, int64_t batch,       \
                   int64_t heads, int64_t d, float scale, T* out, std::atomic<int64_t>* next,                         \
                   const AttnBias* bias, int64_t window) {                                                            \
    attention_thread<T, Block>(q, k, v, st, cu, batch, heads, d, scale, out, next, bias, window);                     \
  }                                                                                                                   \
  template TARGET void name<float>(const float*, const float*, const float*, const AttnStrides&, const int32_t*,      \
                                   int64_t, int64_t, int64_t, float, float*, std::atomic<int64_t>*,                   \
                                   const AttnBias*, int64_t);                                                         \
  template TARGET void name<bf16>(const bf16*, const bf16*, const bf16*, const AttnStrides&, const int32_t*,          \
                                  int64_t, int64_t, int64_t, float, bf16*, std::atomic<int64_t>*,                     \
                                  const AttnBias*, int64_t);

}  // namespace attention_detail
}  // namespace cpu
}  // namespace bertfast
