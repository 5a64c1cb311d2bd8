// Varlen fused attention on packed tokens: softmax(q k^T * scale) v per sequence and head, tiled over
// queries (kQBlock rows) and keys (kKBlock keys) with an online softmax, so no score buffer is larger
// than one [kQBlock, kKBlock] tile. Q/K/V are read in place through row/head strides (views of the
// fused [T, 3H] QKV output). A work item is one (sequence, head): its K (transposed, per key tile) and V
// are widened to fp32 once and reused by all its query blocks; all math is fp32. bf16 with head_dim <= 64
// on a CPU with AMX runs the two products on tiles instead (attention_amx: same tiling, bf16 operands,
// fp32 accumulation and softmax). An optional relative position bias (MPNet, `AttnBias`) is added to each
// score tile between the product and the softmax, read per distance from a (heads, width) table; calls
// with one run the fp32-math tiers (AVX-512, AVX2, portable), not the AMX tiles.
//
// Sliding window (window > 0, ModernBERT's local layers): query t sees key u iff |t - u| <= window. A query
// block visits only the key tiles that meet its rows' windows, its diagonal tile first (it holds every row's
// own key, so each row's running max is finite from then on); in a boundary tile the scores outside the window
// are set to -inf before the softmax and their probabilities to 0 after it. Work is linear in length then,
// like the memory (K and V widened once per (sequence, head), nothing quadratic). A window reaching the whole
// sequence (window >= len - 1) is no window: the same tiles in the same order as global attention. Windowed
// calls also run the fp32-math tiers, not the AMX tiles (which are not built with the window).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "isa.h"
#include "kernels.h"
#include "scalar_math.h"
#include "simd.h"
#include "vec_math.h"
#include "parallel.h"


namespace bertfast {
namespace cpu {
namespace {

constexpr int64_t kQBlock = 32;
constexpr int64_t kKBlock = 64;
static_assert(kKBlock % kQBlock == 0, "a query block lies inside one key tile (its diagonal tile)");

// The (sequence, head) work items of one call, claimed from a counter the threads share until none are
// left: a dynamic schedule, since sequences differ in length and so items in cost. Empty sequences are
// skipped.
struct WorkItems {
  std::atomic<int64_t>* next;
  const int32_t* cu_seqlens;
  int64_t total, heads;
  bool claim(int64_t* h, int64_t* start, int64_t* len) {
    for (;;) {
      const int64_t w = next->fetch_add(1, std::memory_order_relaxed);
      if (w >= total) return false;
      const int64_t b = w / heads;
      *h = w % heads;
      *start = cu_seqlens[b];
      *len = cu_seqlens[b + 1] - *start;
      if (*len > 0) return true;
    }
  }
};

// Pulls the q, k, v and output rows of the item a thread claimed next toward L2, a few rows per call of
// step() while the current item computes: they come from a [T, 3H] tensor larger than L2, one head's
// slice of each row at a time, which the hardware prefetchers do not follow.
struct RowPrefetch {
  const char* src[4];
  int64_t stride[4];  // bytes between rows
  int64_t bytes = 0, rows = 0, next = 0;

  template <typename T>
  void start(const T* q, const T* k, const T* v, T* out, const AttnStrides& st, int64_t heads, int64_t d,
             int64_t h, int64_t row0, int64_t len) {
    const T* base[4] = {q + row0 * st.q_row + h * st.q_head, k + row0 * st.k_row + h * st.k_head,
                        v + row0 * st.v_row + h * st.v_head, out + row0 * heads * d + h * d};
    const int64_t strides[4] = {st.q_row, st.k_row, st.v_row, heads * d};
    for (int i = 0; i < 4; ++i) {
      src[i] = reinterpret_cast<const char*>(base[i]);
      stride[i] = strides[i] * int64_t(sizeof(T));
    }
    bytes = d * int64_t(sizeof(T));
    rows = len;
    next = 0;
  }

  BF_INLINE void step(int64_t n) {
    for (const int64_t end = std::min(rows, next + n); next < end; ++next) {
      for (int i = 0; i < 3; ++i) lines<0>(src[i] + next * stride[i]);
      lines<1>(src[3] + next * stride[3]);
    }
  }

  template <int kWrite>
  BF_INLINE void lines(const char* row) const {
    const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63));
    for (; line < row + bytes; line += 64) __builtin_prefetch(line, kWrite, 2);
  }
};

// Buffers of one thread, in fp32. d_pad = head_dim rounded up to 16 (zero columns), so vector code
// needs no tail handling along head_dim.
struct Scratch {
  std::vector<float> qf;   // [kQBlock][d_pad], pre-scaled, rows past the block end zero
  std::vector<float> kt;   // [key tiles][d][kKBlock], K transposed per tile, keys past the end zero
  std::vector<float> vf;   // [keys rounded to kKBlock][d_pad]
  std::vector<float> acc;  // [kQBlock][d_pad], written (not added to) by the first key tile
  std::vector<float> s;    // [kQBlock][kKBlock] scores, then probabilities
  float m[kQBlock], l[kQBlock];
};

// The position bias of one (query block, key tile): score (i, j) += row[kpos[j] - qpos[i]], row = this head's
// table row at distance 0; row == nullptr: no bias.
struct TileBias {
  const float* row = nullptr;
  const int32_t *qpos = nullptr, *kpos = nullptr;
};

// Adds the bias to the tile's scores s [qn][kKBlock] (kn keys); inlined into each tier's block.
BF_INLINE void add_bias(float* s, const TileBias& b, int64_t qn, int64_t kn) {
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

// ---- portable block: plain loops the compiler vectorizes ----
struct GenericBlock {
  // K rows [0, len) of one head into kt: [tile][d][kKBlock] (keys past len stay zero).
  template <typename T>
  BF_INLINE static void load_kt(const T* k, int64_t row_stride, int64_t len, int64_t d, float* kt) {
    for (int64_t j = 0; j < len; ++j) {
      const T* ks = k + j * row_stride;
      float* kd = kt + (j / kKBlock) * d * kKBlock + (j % kKBlock);
      for (int64_t e = 0; e < d; ++e) kd[e * kKBlock] = to_float(ks[e]);
    }
  }

  // One key tile (kn keys) against the query block (qn rows): online softmax update of acc/m/l. The two
  // products run on register tiles of 4-lane vectors (GCC vector extensions: SSE2 on x86-64, NEON on
  // aarch64); the compiler's own vectorization of these loops kept every partial sum in memory.
  BF_INLINE static void run(Scratch& sc, const float* kt, const float* vf, int64_t qn, int64_t kn, int64_t d,
                            int64_t dp, bool first, const TileBias& bias, const TileWindow& win) {
    for (int64_t i = 0; i < qn; i += kR) {  // rows past qn are zero queries: computed, never used
      const float* q = sc.qf.data() + i * dp;
      float* s = sc.s.data() + i * kKBlock;
      int64_t j = 0;
      for (; j + 4 < kn; j += 8) score_tile<2>(q, dp, kt + j, d, s + j);
      if (j < kn) score_tile<1>(q, dp, kt + j, d, s + j);
    }
    add_bias(sc.s.data(), bias, qn, kn);
    mask_window(sc.s.data(), win, qn, kn, -INFINITY);
    for (int64_t i = 0; i < qn; ++i) {
      float* s = sc.s.data() + i * kKBlock;
      float mx = sc.m[i];
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < kn; ++j) mx = s[j] > mx ? s[j] : mx;
      const float alpha = exp_f(sc.m[i] - mx);  // rescales what earlier key tiles accumulated
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < kn; ++j) {
        s[j] = exp_f(s[j] - mx);
        sum += s[j];
      }
      sc.l[i] = sc.l[i] * alpha + sum;
      sc.m[i] = mx;
      if (!first) {
        float* a = sc.acc.data() + i * dp;
#pragma omp simd
        for (int64_t e = 0; e < dp; ++e) a[e] *= alpha;
      }
    }
    mask_window(sc.s.data(), win, qn, kn, 0.f);
    // acc += P V (acc = P V on the first key tile), 4 rows x 8 head dims per register tile.
    for (int64_t i = 0; i < qn; i += kR) {
      const int rows = int(std::min<int64_t>(kR, qn - i));
      const float* p = sc.s.data() + i * kKBlock;
      for (int64_t e0 = 0; e0 < dp; e0 += 8) {
        float* acc = sc.acc.data() + i * dp + e0;
        f4 a[kR][2];
#pragma GCC unroll 8
        for (int r = 0; r < kR; ++r)
#pragma GCC unroll 8
          for (int c = 0; c < 2; ++c) a[r][c] = !first && r < rows ? load4(acc + r * dp + 4 * c) : f4{};
        for (int64_t j = 0; j < kn; ++j) {
          const f4 v0 = load4(vf + j * dp + e0), v1 = load4(vf + j * dp + e0 + 4);
#pragma GCC unroll 8
          for (int r = 0; r < kR; ++r) {
            const float pr = p[r * kKBlock + j];
            a[r][0] += pr * v0;
            a[r][1] += pr * v1;
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < kR; ++r)
          if (r < rows)
#pragma GCC unroll 8
            for (int c = 0; c < 2; ++c) store4(acc + r * dp + 4 * c, a[r][c]);
      }
    }
  }

  static constexpr int kR = 4;  // query rows per register tile
  using f4 = float __attribute__((vector_size(16)));
  BF_INLINE static f4 load4(const float* p) {
    f4 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  BF_INLINE static void store4(float* p, f4 v) { std::memcpy(p, &v, sizeof(v)); }

  // S for kR query rows and kC * 4 keys.
  template <int kC>
  BF_INLINE static void score_tile(const float* q, int64_t dp, const float* kt, int64_t d, float* s) {
    f4 acc[kR][kC];
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < kC; ++c) acc[r][c] = f4{};
    for (int64_t e = 0; e < d; ++e) {
      f4 kv[kC];
#pragma GCC unroll 8
      for (int c = 0; c < kC; ++c) kv[c] = load4(kt + e * kKBlock + 4 * c);
#pragma GCC unroll 8
      for (int r = 0; r < kR; ++r) {
        const float qe = q[r * dp + e];
#pragma GCC unroll 8
        for (int c = 0; c < kC; ++c) acc[r][c] += qe * kv[c];
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < kC; ++c) store4(s + r * kKBlock + 4 * c, acc[r][c]);
  }
};

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

// ---- AVX-512 block: 4 query rows at a time in registers ----
struct Avx512Block {
  // K transposed 16 keys x 16 dims at a time, widened on load.
  template <typename T>
  BF_TARGET_AVX512 __attribute__((noinline)) static void load_kt(const T* k, int64_t row_stride, int64_t len,
                                                                  int64_t d, float* kt) {
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      float* tile = kt + (j0 / kKBlock) * d * kKBlock + (j0 % kKBlock);
      for (int64_t e0 = 0; e0 < d; e0 += 16) {
        const int64_t de = std::min<int64_t>(16, d - e0);
        const __mmask16 mask = __mmask16((1u << de) - 1u);
        __m512 r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = j0 + i < len ? load16(k + (j0 + i) * row_stride + e0, mask) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t c = 0; c < de; ++c) _mm512_storeu_ps(tile + (e0 + c) * kKBlock, r[c]);
      }
    }
  }

  // A tile of kn keys needs only ceil(kn / 16) score vectors per row: short sequences (and the last
  // tile of a longer one) do not pay for a full kKBlock of keys.
  BF_TARGET_AVX512 static void run(Scratch& sc, const float* kt, const float* vf, int64_t qn, int64_t kn, int64_t d,
                                   int64_t dp, bool first, const TileBias& bias, const TileWindow& win) {
    switch ((kn + 15) / 16) {
      case 1: run_cols<1>(sc, kt, vf, qn, kn, d, dp, first, bias, win); break;
      case 2: run_cols<2>(sc, kt, vf, qn, kn, d, dp, first, bias, win); break;
      case 3: run_cols<3>(sc, kt, vf, qn, kn, d, dp, first, bias, win); break;
      default: run_cols<kKBlock / 16>(sc, kt, vf, qn, kn, d, dp, first, bias, win); break;
    }
  }

  template <int kC>  // score vectors per row (16 keys each), kC * 16 >= kn
  BF_TARGET_AVX512 __attribute__((noinline)) static void run_cols(Scratch& sc, const float* kt, const float* vf,
                                                                  int64_t qn, int64_t kn, int64_t d, int64_t dp,
                                                                  bool first, const TileBias& bias,
                                                                  const TileWindow& win) {
    static_assert(kC >= 1 && kC * 16 <= kKBlock, "a tile has at most kKBlock keys");
    constexpr int kR = 4;                // query rows per register block
    const int64_t qn4 = (qn + kR - 1) / kR * kR;  // rows past qn are zero queries: computed, never used
    // S = Q K^T for the tile: [4 rows x kC * 16 keys] in 4 * kC accumulators per step over head_dim.
    for (int64_t i = 0; i < qn4; i += kR) {
      __m512 s[kR][kC];
      for (int r = 0; r < kR; ++r)
        for (int c = 0; c < kC; ++c) s[r][c] = _mm512_setzero_ps();
      const float* q0 = sc.qf.data() + i * dp;
      for (int64_t e = 0; e < d; ++e) {
        const float* kr = kt + e * kKBlock;
        __m512 kv[kC];
        for (int c = 0; c < kC; ++c) kv[c] = _mm512_loadu_ps(kr + 16 * c);
        for (int r = 0; r < kR; ++r) {
          const __m512 qb = _mm512_set1_ps(q0[r * dp + e]);
          for (int c = 0; c < kC; ++c) s[r][c] = _mm512_fmadd_ps(qb, kv[c], s[r][c]);
        }
      }
      for (int r = 0; r < kR; ++r)
        for (int c = 0; c < kC; ++c) _mm512_storeu_ps(sc.s.data() + (i + r) * kKBlock + 16 * c, s[r][c]);
    }
    add_bias(sc.s.data(), bias, qn, kn);
    mask_window(sc.s.data(), win, qn, kn, -INFINITY);
    // Online softmax per row; keys past kn are masked out.
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < qn; ++i) {
      float* s = sc.s.data() + i * kKBlock;
      __m512 sv[kC];
      __m512 mx = _mm512_set1_ps(sc.m[i]);
      for (int c = 0; c < kC; ++c) {
        const int64_t valid = std::min<int64_t>(16, std::max<int64_t>(0, kn - 16 * c));
        const __mmask16 mask = __mmask16((1u << valid) - 1u);
        sv[c] = _mm512_mask_loadu_ps(neg_inf, mask, s + 16 * c);
        mx = _mm512_max_ps(mx, sv[c]);
      }
      const float m_new = _mm512_reduce_max_ps(mx);
      const float alpha = exp_f(sc.m[i] - m_new);
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < kC; ++c) {
        // exp(-inf - m) would clamp to ~1e-38, not 0: masked keys are zeroed explicitly.
        const int64_t valid = std::min<int64_t>(16, std::max<int64_t>(0, kn - 16 * c));
        const __mmask16 mask = __mmask16((1u << valid) - 1u);
        const __m512 p = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(sv[c], mv)));
        _mm512_storeu_ps(s + 16 * c, p);
        sum = _mm512_add_ps(sum, p);
      }
      sc.l[i] = sc.l[i] * alpha + _mm512_reduce_add_ps(sum);
      sc.m[i] = m_new;
      if (!first) {
        float* a = sc.acc.data() + i * dp;
        const __m512 av = _mm512_set1_ps(alpha);
        for (int64_t e = 0; e < dp; e += 16) _mm512_storeu_ps(a + e, _mm512_mul_ps(_mm512_loadu_ps(a + e), av));
      }
    }
    mask_window(sc.s.data(), win, qn, kn, 0.f);
    // acc += P V: 4 rows x up to 64 head_dim columns (up to 4 vectors, no more than the head has) per register block.
    for (int64_t i = 0; i < qn; i += kR) {
      const int rows = int(std::min<int64_t>(kR, qn - i));
      for (int64_t e0 = 0; e0 < dp; e0 += 64) {
        switch (std::min<int64_t>(4, (dp - e0) / 16)) {
          case 1: accumulate<kR, 1>(sc, vf, i, rows, e0, kn, dp, first); break;
          case 2: accumulate<kR, 2>(sc, vf, i, rows, e0, kn, dp, first); break;
          case 3: accumulate<kR, 3>(sc, vf, i, rows, e0, kn, dp, first); break;
          default: accumulate<kR, 4>(sc, vf, i, rows, e0, kn, dp, first); break;
        }
      }
    }
  }

  // Rows [i, i + rows) x head_dim columns [e0, e0 + 16 * kV) of acc += P V (acc = P V on the first key tile).
  // kV is a template argument so a 32-wide head (MiniLM) runs 2 vectors a row, not 4 with 2 of zeros.
  template <int kR, int kV>
  BF_TARGET_AVX512 __attribute__((noinline)) static void accumulate(Scratch& sc, const float* vf, int64_t i, int rows,
                                                                    int64_t e0, int64_t kn, int64_t dp, bool first) {
    __m512 a[kR][kV];
    for (int r = 0; r < kR; ++r)
      for (int c = 0; c < kV; ++c)
        a[r][c] = (!first && r < rows) ? _mm512_loadu_ps(sc.acc.data() + (i + r) * dp + e0 + 16 * c)
                                       : _mm512_setzero_ps();
    for (int64_t j = 0; j < kn; ++j) {
      const float* vr = vf + j * dp + e0;
      __m512 vv[kV];
      for (int c = 0; c < kV; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
      for (int r = 0; r < kR; ++r) {
        const __m512 p = _mm512_set1_ps(sc.s[(i + r) * kKBlock + j]);
        for (int c = 0; c < kV; ++c) a[r][c] = _mm512_fmadd_ps(p, vv[c], a[r][c]);
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < kV; ++c) _mm512_storeu_ps(sc.acc.data() + (i + r) * dp + e0 + 16 * c, a[r][c]);
  }
};

// ---- AVX2 block: the AVX-512 block's schedule on 8-wide vectors, tiles sized for 16 registers ----

// In-register transpose of an 8 x 8 fp32 block (r[i] = row i on entry, column i on exit).
BF_TARGET_AVX2 BF_INLINE void transpose8(__m256 r[8]) {
  __m256 t[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // columns 0, 1 of rows i, i + 1 | columns 4, 5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // columns 2, 3 | 6, 7
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);      // column 0 of rows i..i+3 | column 4
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);  // column 1 | 5
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
#pragma GCC unroll 8
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm256_permute2f128_ps(r[j], r[j + 4], 0x20);
    t[j + 4] = _mm256_permute2f128_ps(r[j], r[j + 4], 0x31);
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}

BF_TARGET_AVX2 BF_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
BF_TARGET_AVX2 BF_INLINE __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

BF_TARGET_AVX2 BF_INLINE float reduce_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

BF_TARGET_AVX2 BF_INLINE float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

struct Avx2Block {
  static constexpr int kR = 4;  // query rows per register tile

  // K transposed 8 keys x 8 dims at a time, widened on load; head dims past a multiple of 8 one by one.
  template <typename T>
  BF_TARGET_AVX2 __attribute__((noinline)) static void load_kt(const T* k, int64_t row_stride, int64_t len,
                                                                int64_t d, float* kt) {
    const int64_t d8 = d / 8 * 8;
    for (int64_t j0 = 0; j0 < len; j0 += 8) {
      float* tile = kt + (j0 / kKBlock) * d * kKBlock + (j0 % kKBlock);
      const int64_t jn = std::min<int64_t>(8, len - j0);
      for (int64_t e0 = 0; e0 < d8; e0 += 8) {
        __m256 r[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) r[i] = i < jn ? load8(k + (j0 + i) * row_stride + e0) : _mm256_setzero_ps();
        transpose8(r);
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(tile + (e0 + c) * kKBlock, r[c]);
      }
      for (int64_t e = d8; e < d; ++e)
        for (int64_t i = 0; i < 8; ++i) tile[e * kKBlock + i] = i < jn ? to_float(k[(j0 + i) * row_stride + e]) : 0.f;
    }
  }

  BF_TARGET_AVX2 static void run(Scratch& sc, const float* kt, const float* vf, int64_t qn, int64_t kn, int64_t d,
                                 int64_t dp, bool first, const TileBias& bias, const TileWindow& win) {
    scores(sc, kt, qn, kn, d, dp);
    add_bias(sc.s.data(), bias, qn, kn);
    mask_window(sc.s.data(), win, qn, kn, -INFINITY);
    softmax(sc, qn, kn, dp, first);
    mask_window(sc.s.data(), win, qn, kn, 0.f);
    accumulate(sc, vf, qn, kn, dp, first);
  }

  // S for kR query rows (rows past qn are zero queries: computed, never used) and kC * 8 keys.
  template <int kC>
  BF_TARGET_AVX2 BF_INLINE static void score_tile(const float* q, int64_t dp, const float* kt, int64_t d, float* s) {
    __m256 acc[kR][kC];
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < kC; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; ++e) {
      __m256 kv[kC];
#pragma GCC unroll 8
      for (int c = 0; c < kC; ++c) kv[c] = _mm256_loadu_ps(kt + e * kKBlock + 8 * c);
#pragma GCC unroll 8
      for (int r = 0; r < kR; ++r) {
        const __m256 qb = _mm256_broadcast_ss(q + r * dp + e);
#pragma GCC unroll 8
        for (int c = 0; c < kC; ++c) acc[r][c] = _mm256_fmadd_ps(qb, kv[c], acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < kC; ++c) _mm256_storeu_ps(s + r * kKBlock + 8 * c, acc[r][c]);
  }

  BF_TARGET_AVX2 __attribute__((noinline)) static void scores(Scratch& sc, const float* kt, int64_t qn, int64_t kn,
                                                               int64_t d, int64_t dp) {
    for (int64_t i = 0; i < qn; i += kR) {
      const float* q = sc.qf.data() + i * dp;
      float* s = sc.s.data() + i * kKBlock;
      int64_t j = 0;
      for (; j + 8 < kn; j += 16) score_tile<2>(q, dp, kt + j, d, s + j);
      if (j < kn) score_tile<1>(q, dp, kt + j, d, s + j);
    }
  }

  // Online softmax per row; keys past kn are masked out (and their probabilities stored as zero).
  BF_TARGET_AVX2 __attribute__((noinline)) static void softmax(Scratch& sc, int64_t qn, int64_t kn, int64_t dp,
                                                                bool first) {
    const int64_t nv = (kn + 7) / 8;
    const __m256 tail = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(kn - 8 * (nv - 1))),
                                                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < qn; ++i) {
      float* s = sc.s.data() + i * kKBlock;
      __m256 mx = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + 8 * (nv - 1)), tail);
      for (int64_t c = 0; c < nv - 1; ++c) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + 8 * c));
      const float m_new = std::max(sc.m[i], reduce_max8(mx));
      const float alpha = exp_f(sc.m[i] - m_new);
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t c = 0; c < nv; ++c) {
        __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * c), mv));
        if (c == nv - 1) p = _mm256_and_ps(p, tail);
        _mm256_storeu_ps(s + 8 * c, p);
        sum = _mm256_add_ps(sum, p);
      }
      sc.l[i] = sc.l[i] * alpha + reduce_add8(sum);
      sc.m[i] = m_new;
      if (!first) {
        float* a = sc.acc.data() + i * dp;
        const __m256 av = _mm256_set1_ps(alpha);
        for (int64_t e = 0; e < dp; e += 8) _mm256_storeu_ps(a + e, _mm256_mul_ps(_mm256_loadu_ps(a + e), av));
      }
    }
  }

  // acc += P V (acc = P V on the first key tile): kR rows x 16 head_dim columns per register tile (d_pad
  // is a multiple of 16).
  BF_TARGET_AVX2 __attribute__((noinline)) static void accumulate(Scratch& sc, const float* vf, int64_t qn,
                                                                   int64_t kn, int64_t dp, bool first) {
    constexpr int kC = 2;
    for (int64_t i = 0; i < qn; i += kR) {
      const int rows = int(std::min<int64_t>(kR, qn - i));
      const float* p = sc.s.data() + i * kKBlock;
      for (int64_t e0 = 0; e0 < dp; e0 += 8 * kC) {
        float* acc = sc.acc.data() + i * dp + e0;
        __m256 a[kR][kC];
#pragma GCC unroll 8
        for (int r = 0; r < kR; ++r)
#pragma GCC unroll 8
          for (int c = 0; c < kC; ++c)
            a[r][c] = !first && r < rows ? _mm256_loadu_ps(acc + r * dp + 8 * c) : _mm256_setzero_ps();
        for (int64_t j = 0; j < kn; ++j) {
          __m256 vv[kC];
#pragma GCC unroll 8
          for (int c = 0; c < kC; ++c) vv[c] = _mm256_loadu_ps(vf + j * dp + e0 + 8 * c);
#pragma GCC unroll 8
          for (int r = 0; r < kR; ++r) {
            const __m256 pb = _mm256_broadcast_ss(p + r * kKBlock + j);
#pragma GCC unroll 8
            for (int c = 0; c < kC; ++c) a[r][c] = _mm256_fmadd_ps(pb, vv[c], a[r][c]);
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < kR; ++r)
          if (r < rows)
#pragma GCC unroll 8
            for (int c = 0; c < kC; ++c) _mm256_storeu_ps(acc + r * dp + 8 * c, a[r][c]);
      }
    }
  }
};

// ---- AMX-BF16 (bf16, head_dim <= 64): Q K^T and P V as tile products, softmax on AVX-512 ----
//
// A work item is one (sequence, head), as above. K is packed once per item as AMX B tiles: for 16 keys
// and 32 head dims, B row r holds the pair of dims (2r, 2r + 1) of every key, i.e. the 16 x 16 transpose
// of K viewed as 32-bit pairs. V is packed as pairs of keys (row p holds keys 2p and 2p + 1 interleaved
// per column), the B layout of P V. Per block of 16 queries and 64 keys: S = Q K^T in four fp32 tiles,
// the online softmax in fp32 (scale applied there), P rounded to bf16 (as torch's bf16 flash
// attention on CPU does), P V into fresh tiles added to the fp32 accumulator. Head dims are zero-padded
// to 32 or 64 in the packed copies, so any head_dim <= 64 works.
constexpr int64_t kAmxQ = 16;     // query rows per block (tile rows)
constexpr int64_t kAmxKeys = 64;  // keys per block (four 16-key score tiles)

struct AmxScratch {
  std::vector<uint32_t> kp;  // [key tiles of 16][dp / 32][16 dim pairs][16 keys]
  std::vector<bf16> vp;      // [keys rounded to kAmxKeys / 2][dp][2]
  alignas(64) bf16 qs[kAmxQ * 64];
  alignas(64) float s[kAmxQ * kAmxKeys];
  alignas(64) bf16 ps[kAmxQ * kAmxKeys];
  alignas(64) float pv[kAmxQ * 64];
  alignas(64) float acc[kAmxQ * 64];
  float m[kAmxQ], l[kAmxQ];
};

BF_TARGET_AMX BF_INLINE __mmask32 dims_mask(int64_t d, int64_t e0) {
  const int64_t n = std::min<int64_t>(32, std::max<int64_t>(0, d - e0));
  return n == 32 ? __mmask32(0xffffffffu) : __mmask32((1u << n) - 1u);
}

// 32 elements of a row as bf16 (fp32 inputs rounded to nearest even), lanes outside `m` zero.
BF_TARGET_AMX BF_INLINE __m512i load32_bf16(const bf16* p, __mmask32 m) { return _mm512_maskz_loadu_epi16(m, p); }
BF_TARGET_AMX BF_INLINE __m512i load32_bf16(const float* p, __mmask32 m) {
  const __m512 lo = _mm512_maskz_loadu_ps(__mmask16(m), p), hi = _mm512_maskz_loadu_ps(__mmask16(m >> 16), p + 16);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// K rows [0, len) of one head (row stride in elements) into kp; keys and dims past the end are zero.
template <typename T>
BF_TARGET_AMX BF_INLINE void amx_pack_k(const T* k, int64_t row_stride, int64_t len, int64_t d, int64_t dp,
                                        uint32_t* kp) {
  const int64_t chunks = dp / 32;
  for (int64_t t = 0; t * 16 < len; ++t) {
    for (int64_t c = 0; c < chunks; ++c) {
      const __mmask32 mask = dims_mask(d, 32 * c);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t key = 16 * t + i;
        r[i] = key < len ? _mm512_castsi512_ps(load32_bf16(k + key * row_stride + 32 * c, mask))
                         : _mm512_setzero_ps();
      }
      transpose16(r);  // moves 32-bit lanes: each lane is one (even, odd) pair of dims
      uint32_t* dst = kp + (t * chunks + c) * 256;
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(dst + 16 * i), r[i]);
    }
  }
}

// V rows [0, len) into vp as key pairs: vp[p][n][0..1] = V[2p][n], V[2p + 1][n]; zero past len up to
// `padded` keys and past d up to dp.
template <typename T>
BF_TARGET_AMX BF_INLINE void amx_pack_v(const T* v, int64_t row_stride, int64_t len, int64_t padded, int64_t d,
                                        int64_t dp, bf16* vp) {
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo_idx = _mm512_load_si512(kLo);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t p = 0; 2 * p < padded; ++p) {
    for (int64_t e0 = 0; e0 < dp; e0 += 32) {
      const __mmask32 mask = dims_mask(d, e0);
      const int64_t k0 = 2 * p, k1 = 2 * p + 1;
      const __m512i a = k0 < len ? load32_bf16(v + k0 * row_stride + e0, mask) : _mm512_setzero_si512();
      const __m512i b = k1 < len ? load32_bf16(v + k1 * row_stride + e0, mask) : _mm512_setzero_si512();
      bf16* dst = vp + (p * dp + e0) * 2;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
  }
}

// 2^x for the probabilities of the AMX path (x <= 0 there): 2^n * 2^f with f in [-0.5, 0.5] and 2^f
// by its degree-5 Taylor polynomial (relative error < 3e-6, far below the bf16 rounding of P, 4e-3).
BF_TARGET_AMX BF_INLINE __m512 exp2_512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Online softmax of one block's scores (16 rows x kn keys, unscaled in sc.s) into bf16 probabilities
// in sc.ps (zero past kn up to kAmxKeys); rescales the accumulator rows by the change of their max.
// Works in base 2: scores times scale * log2(e), so m and the exponents are in log2 units.
BF_TARGET_AMX BF_INLINE void amx_softmax_block(AmxScratch& sc, int64_t kn, int64_t dp, float scale, bool first) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), to_log2 = _mm512_set1_ps(scale * 1.44269504088896341f);
  __mmask16 masks[4];
  for (int c = 0; c < 4; ++c) {
    const int64_t valid = std::min<int64_t>(16, std::max<int64_t>(0, kn - 16 * c));
    masks[c] = valid == 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1u);
  }
  for (int64_t i = 0; i < kAmxQ; ++i) {
    const float* s = sc.s + i * kAmxKeys;
    __m512 sv[4];
    __m512 mx = _mm512_set1_ps(sc.m[i]);
    for (int c = 0; c < 4; ++c) {
      sv[c] = _mm512_mask_mul_ps(neg_inf, masks[c], _mm512_maskz_loadu_ps(masks[c], s + 16 * c), to_log2);
      mx = _mm512_max_ps(mx, sv[c]);
    }
    const float m_new = _mm512_reduce_max_ps(mx);
    const float alpha = std::exp2(sc.m[i] - m_new);  // 0 on the first block (m = -inf)
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    bf16* pr = sc.ps + i * kAmxKeys;
    for (int c = 0; c < 4; ++c) {
      const __m512 p = _mm512_maskz_mov_ps(masks[c], exp2_512(_mm512_sub_ps(sv[c], mv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * c), (__m256i)_mm512_cvtneps_pbh(p));
      sum = _mm512_add_ps(sum, p);
    }
    sc.l[i] = sc.l[i] * alpha + _mm512_reduce_add_ps(sum);
    sc.m[i] = m_new;
    if (!first) {
      float* a = sc.acc + i * dp;
      const __m512 av = _mm512_set1_ps(alpha);
      for (int64_t e = 0; e < dp; e += 16) _mm512_storeu_ps(a + e, _mm512_mul_ps(_mm512_loadu_ps(a + e), av));
    }
  }
}

// Tile products with the tile numbers the instructions need as immediates: C tile g += A(4) x B(5).
#define BF_AMX_QK(g)                                                      \
  if (groups > g) {                                                       \
    _tile_loadd(5, sc.kp.data() + ((kb / 16 + g) * chunks + c) * 256, 64); \
    _tile_dpbf16ps(g, 4, 5);                                              \
  }
#define BF_AMX_PV(g)                                                          \
  if (ngroups > g) {                                                          \
    _tile_loadd(5, sc.vp.data() + ((kb + 32 * kc) / 2 * dp + 16 * g) * 2, dp * 4); \
    _tile_dpbf16ps(g, 4, 5);                                                  \
  }

template <typename T>  // bf16, or fp32 rounded to bf16 as it is packed
BF_TARGET_AMX void attention_amx(const T* q, const T* k, const T* v, const AttnStrides& st,
                                 const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t d, float scale,
                                 T* out, std::atomic<int64_t>* next) {
  DenormalGuard ftz;
  static thread_local AmxScratch sc;
  const int64_t H = heads * d;
  const int64_t dp = d <= 32 ? 32 : 64;
  const int64_t chunks = dp / 32, ngroups = dp / 16;
  amx_load_tile_config(16);  // tmm0-3 score / output tiles, tmm4 A (Q or P), tmm5 B (K or V)
  WorkItems items{next, cu_seqlens, batch * heads, heads};
  int64_t h, start, len;
  while (items.claim(&h, &start, &len)) {
    const int64_t padded = (len + kAmxKeys - 1) / kAmxKeys * kAmxKeys;
    sc.kp.resize(padded / 16 * chunks * 256);
    sc.vp.resize(padded * dp);
    amx_pack_k(k + start * st.k_row + h * st.k_head, st.k_row, len, d, dp, sc.kp.data());
    // Key tiles past len inside the last block are read by no product (groups stops at ceil(kn / 16)).
    amx_pack_v(v + start * st.v_row + h * st.v_head, st.v_row, len, padded, d, dp, sc.vp.data());
    for (int64_t q0 = 0; q0 < len; q0 += kAmxQ) {
      const int64_t qn = std::min<int64_t>(kAmxQ, len - q0);
      for (int64_t i = 0; i < kAmxQ; ++i) {
        for (int64_t e0 = 0; e0 < dp; e0 += 32) {
          const __m512i row = i < qn ? load32_bf16(q + (start + q0 + i) * st.q_row + h * st.q_head + e0,
                                                   dims_mask(d, e0))
                                     : _mm512_setzero_si512();
          _mm512_store_si512(sc.qs + i * dp + e0, row);
        }
        sc.m[i] = -INFINITY;
        sc.l[i] = 0.f;
      }
      for (int64_t kb = 0; kb < len; kb += kAmxKeys) {
        const int64_t kn = std::min<int64_t>(kAmxKeys, len - kb);
        const int64_t groups = (kn + 15) / 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < chunks; ++c) {
          _tile_loadd(4, sc.qs + 32 * c, dp * 2);
          BF_AMX_QK(0) BF_AMX_QK(1) BF_AMX_QK(2) BF_AMX_QK(3)
        }
        _tile_stored(0, sc.s, kAmxKeys * 4);
        _tile_stored(1, sc.s + 16, kAmxKeys * 4);
        _tile_stored(2, sc.s + 32, kAmxKeys * 4);
        _tile_stored(3, sc.s + 48, kAmxKeys * 4);
        amx_softmax_block(sc, kn, dp, scale, kb == 0);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kc = 0; kc * 32 < kn; ++kc) {
          _tile_loadd(4, sc.ps + 32 * kc, kAmxKeys * 2);
          BF_AMX_PV(0) BF_AMX_PV(1) BF_AMX_PV(2) BF_AMX_PV(3)
        }
        _tile_stored(0, sc.pv, dp * 4);
        _tile_stored(1, sc.pv + 16, dp * 4);
        if (ngroups > 2) {
          _tile_stored(2, sc.pv + 32, dp * 4);
          _tile_stored(3, sc.pv + 48, dp * 4);
        }
        for (int64_t i = 0; i < kAmxQ * dp; i += 16) {
          const __m512 pv = _mm512_load_ps(sc.pv + i);
          _mm512_store_ps(sc.acc + i, kb == 0 ? pv : _mm512_add_ps(_mm512_load_ps(sc.acc + i), pv));
        }
      }
      for (int64_t i = 0; i < qn; ++i) {
        const __m512 inv = _mm512_set1_ps(1.0f / sc.l[i]);
        T* o = out + (start + q0 + i) * H + h * d;
        for (int64_t e = 0; e < d; e += 16) {
          const int64_t n = std::min<int64_t>(16, d - e);
          store16(o + e, _mm512_mul_ps(_mm512_load_ps(sc.acc + i * dp + e), inv),
                  n == 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u));
        }
      }
    }
  }
  _tile_release();
}
#undef BF_AMX_QK
#undef BF_AMX_PV
#endif

// The key tiles [*t_lo, *t_hi] that query rows [q0, q0 + qn) of a sequence of len keys visit: all of them
// without a window (w == 0), else those meeting [q0 - w, q0 + qn - 1 + w].
BF_INLINE void visited_tiles(int64_t q0, int64_t qn, int64_t len, int64_t w, int64_t* t_lo, int64_t* t_hi) {
  if (w == 0) {
    *t_lo = 0;
    *t_hi = (len - 1) / kKBlock;
  } else {
    *t_lo = std::max<int64_t>(0, q0 - w) / kKBlock;
    *t_hi = std::min<int64_t>(len - 1, q0 + qn - 1 + w) / kKBlock;
  }
}

// The n-th key tile a query block visits: its diagonal tile first (the one holding rows q0..q0 + qn - 1 as keys;
// tile 0 without a window), then [t_lo, t_hi] in order without it.
BF_INLINE int64_t tile_order(int64_t n, int64_t t_lo, int64_t t_diag) {
  if (n == 0) return t_diag;
  return t_lo + n - 1 >= t_diag ? t_lo + n : t_lo + n - 1;
}

template <typename T, typename Block>
BF_INLINE void attention_thread(const T* q, const T* k, const T* v, const AttnStrides& st,
                                const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t d, float scale,
                                T* out, std::atomic<int64_t>* next, const AttnBias* bias, int64_t window) {
  DenormalGuard ftz;
  const int64_t H = heads * d;
  const int64_t dp = (d + 15) / 16 * 16;
  // Kept per thread across calls: at small batches allocation would cost more than the attention.
  static thread_local Scratch sc;
  sc.qf.resize(kQBlock * dp);
  sc.acc.resize(kQBlock * dp);
  sc.s.resize(kQBlock * kKBlock);
  WorkItems items{next, cu_seqlens, batch * heads, heads};
  int64_t h, start, len, h_next = 0, start_next = 0, len_next = 0;
  // One item claimed ahead, so its rows can be prefetched while this one computes.
  for (bool have = items.claim(&h, &start, &len); have; h = h_next, start = start_next, len = len_next) {
    RowPrefetch pf;
    have = items.claim(&h_next, &start_next, &len_next);
    if (have) pf.start(q, k, v, out, st, heads, d, h_next, start_next, len_next);
    const int64_t tiles = (len + kKBlock - 1) / kKBlock;
    const int64_t w = window < len - 1 ? window : 0;  // a window reaching every key is no window
    int64_t runs = 0;  // (query block, key tile) pairs this item computes
    for (int64_t q0 = 0; q0 < len; q0 += kQBlock) {
      int64_t t_lo, t_hi;
      visited_tiles(q0, std::min<int64_t>(kQBlock, len - q0), len, w, &t_lo, &t_hi);
      runs += t_hi - t_lo + 1;
    }
    const int64_t rows_per_run = have ? (len_next + runs - 1) / runs : 0;
    // K transposed per key tile and V, widened once for every query block of this (sequence, head).
    // Keys past the end of a tile are masked out of the softmax and never read from V; the columns
    // of V past head_dim (to d_pad) must be zero (they are accumulated, then dropped).
    sc.kt.resize(tiles * d * kKBlock);
    sc.vf.resize(tiles * kKBlock * dp);
    Block::template load_kt<T>(k + start * st.k_row + h * st.k_head, st.k_row, len, d, sc.kt.data());
    for (int64_t j = 0; j < len; ++j) {
      const T* vs = v + (start + j) * st.v_row + h * st.v_head;
      float* vd = sc.vf.data() + j * dp;
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) vd[e] = to_float(vs[e]);
      for (int64_t e = d; e < dp; ++e) vd[e] = 0.f;
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
      std::fill(sc.qf.begin() + qn * dp, sc.qf.end(), 0.f);
      int64_t t_lo, t_hi;
      visited_tiles(q0, qn, len, w, &t_lo, &t_hi);
      const int64_t t_diag = w == 0 ? 0 : q0 / kKBlock;
      for (int64_t n = 0; n <= t_hi - t_lo; ++n) {
        const int64_t t = tile_order(n, t_lo, t_diag), k0 = t * kKBlock;
        const int64_t kn = std::min<int64_t>(kKBlock, len - k0);
        pf.step(rows_per_run);
        TileBias tb;
        if (bias != nullptr)
          tb = {bias->table + h * bias->width + (bias->width - 1) / 2, bias->pos + start + q0, bias->pos + start + k0};
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
  }
}

#if BF_X86
template <typename T>
BF_TARGET_AVX2 void attention_avx2(const T* q, const T* k, const T* v, const AttnStrides& st, const int32_t* cu,
                                   int64_t batch, int64_t heads, int64_t d, float scale, T* out,
                                   std::atomic<int64_t>* next, const AttnBias* bias, int64_t window) {
  attention_thread<T, Avx2Block>(q, k, v, st, cu, batch, heads, d, scale, out, next, bias, window);
}

template <typename T>
BF_TARGET_AVX512 void attention_avx512(const T* q, const T* k, const T* v, const AttnStrides& st, const int32_t* cu,
                                       int64_t batch, int64_t heads, int64_t d, float scale, T* out,
                                       std::atomic<int64_t>* next, const AttnBias* bias, int64_t window) {
  attention_thread<T, Avx512Block>(q, k, v, st, cu, batch, heads, d, scale, out, next, bias, window);
}
#endif

template <typename T>
void attention_generic(const T* q, const T* k, const T* v, const AttnStrides& st, const int32_t* cu, int64_t batch,
                       int64_t heads, int64_t d, float scale, T* out, std::atomic<int64_t>* next,
                       const AttnBias* bias, int64_t window) {
  attention_thread<T, GenericBlock>(q, k, v, st, cu, batch, heads, d, scale, out, next, bias, window);
}

}  // namespace

template <typename T>
void attention(const T* q, const T* k, const T* v, const AttnStrides& s, const int32_t* cu_seqlens,
               int64_t batch, int64_t heads, int64_t head_dim, float scale, T* out, bool bf16_products,
               const AttnBias* bias, int64_t window) {
  int64_t work = 0, longest = 0;  // work: score elements computed (about: boundary tiles are computed whole)
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = cu_seqlens[b + 1] - cu_seqlens[b];
    work += len * (window > 0 ? std::min(len, 2 * window + 1) : len);
    longest = std::max(longest, len);
  }
  if (window >= longest - 1) window = 0;  // it reaches every key of every sequence: global attention, any tier
  if (work == 0) return;
  // Work items are whole (sequence, head) pairs: worth a second thread from a few of them on.
  const int nt = int(std::min<int64_t>(batch * heads, threads_for(work * heads * head_dim)));
  // Every thread claims (sequence, head) items from one counter until none are left.
  std::atomic<int64_t> next{0};
#if BF_X86
  if ((sizeof(T) == 2 || bf16_products) && bias == nullptr && window == 0) {  // AMX: no position bias, no window
    if (head_dim <= 64 && active_isa() == Isa::Amx) {
      parallel_for(nt, nt, [&](int64_t) {
        attention_amx(q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out, &next);
      });
      return;
    }
  }
#endif
  parallel_for(nt, nt, [&](int64_t) {
    BF_DISPATCH(attention, q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out, &next, bias, window);
  });
}

template void attention<float>(const float*, const float*, const float*, const AttnStrides&, const int32_t*,
                               int64_t, int64_t, int64_t, float, float*, bool, const AttnBias*, int64_t);
template void attention<bf16>(const bf16*, const bf16*, const bf16*, const AttnStrides&, const int32_t*, int64_t,
                              int64_t, int64_t, float, bf16*, bool, const AttnBias*, int64_t);

}  // namespace cpu
}  // namespace bertfast
