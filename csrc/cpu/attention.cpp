// Varlen fused attention on packed tokens: softmax(q k^T * scale) v per sequence and head, tiled over
// queries (kQBlock rows) and keys (kKBlock keys) with an online softmax, so no score buffer is larger
// than one [kQBlock, kKBlock] tile. Q/K/V are read in place through row/head strides (views of the
// fused [T, 3H] QKV output). A work item is one (sequence, head): its K (transposed, per key tile) and V
// are widened to fp32 once and reused by all its query blocks; all math is fp32.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "common.h"
#include "parallel.h"


namespace bertfast {
namespace cpu {
namespace {

constexpr int64_t kQBlock = 32;
constexpr int64_t kKBlock = 64;

// Buffers of one thread, in fp32. d_pad = head_dim rounded up to 16 (zero columns), so vector code
// needs no tail handling along head_dim.
struct Scratch {
  std::vector<float> qf;   // [kQBlock][d_pad], pre-scaled, rows past the block end zero
  std::vector<float> kt;   // [key tiles][d][kKBlock], K transposed per tile, keys past the end zero
  std::vector<float> vf;   // [keys rounded to kKBlock][d_pad]
  std::vector<float> acc;  // [kQBlock][d_pad]
  std::vector<float> s;    // [kQBlock][kKBlock] scores, then probabilities
  float m[kQBlock], l[kQBlock];
};

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

  // One key tile (kn keys) against the query block (qn rows): online softmax update of acc/m/l.
  BF_INLINE static void run(Scratch& sc, const float* kt, const float* vf, int64_t qn, int64_t kn, int64_t d,
                            int64_t dp, bool first) {
    for (int64_t i = 0; i < qn; ++i) {
      const float* qi = sc.qf.data() + i * dp;
      float* s = sc.s.data() + i * kKBlock;
#pragma omp simd
      for (int64_t j = 0; j < kn; ++j) s[j] = 0.f;
      for (int64_t e = 0; e < d; ++e) {
        const float qe = qi[e];
        const float* kr = kt + e * kKBlock;
#pragma omp simd
        for (int64_t j = 0; j < kn; ++j) s[j] += qe * kr[j];
      }
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
      float* a = sc.acc.data() + i * dp;
      if (!first) {
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) a[e] *= alpha;
      }
      for (int64_t j = 0; j < kn; ++j) {
        const float p = s[j];
        const float* vr = vf + j * dp;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) a[e] += p * vr[e];
      }
    }
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
                                   int64_t dp, bool first) {
    switch ((kn + 15) / 16) {
      case 1: run_cols<1>(sc, kt, vf, qn, kn, d, dp, first); break;
      case 2: run_cols<2>(sc, kt, vf, qn, kn, d, dp, first); break;
      case 3: run_cols<3>(sc, kt, vf, qn, kn, d, dp, first); break;
      default: run_cols<kKBlock / 16>(sc, kt, vf, qn, kn, d, dp, first); break;
    }
  }

  template <int kC>  // score vectors per row (16 keys each), kC * 16 >= kn
  BF_TARGET_AVX512 __attribute__((noinline)) static void run_cols(Scratch& sc, const float* kt, const float* vf,
                                                                  int64_t qn, int64_t kn, int64_t d, int64_t dp,
                                                                  bool first) {
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
    // acc += P V: 4 rows x 64 head_dim columns (4 vectors) per register block.
    for (int64_t i = 0; i < qn; i += kR) {
      const int rows = int(std::min<int64_t>(kR, qn - i));
      for (int64_t e0 = 0; e0 < dp; e0 += 64) {
        const int nv = int(std::min<int64_t>(4, (dp - e0) / 16));
        __m512 a[kR][4];
        for (int r = 0; r < kR; ++r)
          for (int c = 0; c < 4; ++c)
            a[r][c] = (r < rows && c < nv) ? _mm512_loadu_ps(sc.acc.data() + (i + r) * dp + e0 + 16 * c)
                                           : _mm512_setzero_ps();
        for (int64_t j = 0; j < kn; ++j) {
          const float* vr = vf + j * dp + e0;
          __m512 vv[4];
          for (int c = 0; c < 4; ++c) vv[c] = c < nv ? _mm512_loadu_ps(vr + 16 * c) : _mm512_setzero_ps();
          for (int r = 0; r < kR; ++r) {
            const __m512 p = _mm512_set1_ps(sc.s[(i + r) * kKBlock + j]);
            for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(p, vv[c], a[r][c]);
          }
        }
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < nv; ++c) _mm512_storeu_ps(sc.acc.data() + (i + r) * dp + e0 + 16 * c, a[r][c]);
      }
    }
  }
};
#endif

template <typename T, typename Block>
BF_INLINE void attention_thread(const T* q, const T* k, const T* v, const AttnStrides& st,
                                const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t d, float scale,
                                T* out, std::atomic<int64_t>* next) {
  DenormalGuard ftz;
  const int64_t H = heads * d;
  const int64_t dp = (d + 15) / 16 * 16;
  // Kept per thread across calls: at small batches allocation would cost more than the attention.
  static thread_local Scratch sc;
  sc.qf.resize(kQBlock * dp);
  sc.acc.resize(kQBlock * dp);
  sc.s.resize(kQBlock * kKBlock);
  const int64_t total = batch * heads;
  for (;;) {
    // Dynamic schedule: sequences differ in length, so items differ in cost.
    const int64_t w = next->fetch_add(1, std::memory_order_relaxed);
    if (w >= total) break;
    const int64_t b = w / heads, h = w % heads;
    const int64_t start = cu_seqlens[b];
    const int64_t len = cu_seqlens[b + 1] - start;
    if (len == 0) continue;
    const int64_t tiles = (len + kKBlock - 1) / kKBlock;
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
      std::fill(sc.qf.begin(), sc.qf.end(), 0.f);
      for (int64_t i = 0; i < qn; ++i) {
        const T* src = q + (start + q0 + i) * st.q_row + h * st.q_head;
        float* dst = sc.qf.data() + i * dp;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) dst[e] = to_float(src[e]) * scale;
        sc.m[i] = -INFINITY;
        sc.l[i] = 0.f;
      }
      std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t kn = std::min<int64_t>(kKBlock, len - t * kKBlock);
        Block::run(sc, sc.kt.data() + t * d * kKBlock, sc.vf.data() + t * kKBlock * dp, qn, kn, d, dp, t == 0);
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
BF_TARGET_AVX512 void attention_avx512(const T* q, const T* k, const T* v, const AttnStrides& st, const int32_t* cu,
                                       int64_t batch, int64_t heads, int64_t d, float scale, T* out,
                                       std::atomic<int64_t>* next) {
  attention_thread<T, Avx512Block>(q, k, v, st, cu, batch, heads, d, scale, out, next);
}
#endif

template <typename T>
void attention_generic(const T* q, const T* k, const T* v, const AttnStrides& st, const int32_t* cu, int64_t batch,
                       int64_t heads, int64_t d, float scale, T* out, std::atomic<int64_t>* next) {
  attention_thread<T, GenericBlock>(q, k, v, st, cu, batch, heads, d, scale, out, next);
}

}  // namespace

template <typename T>
void attention(const T* q, const T* k, const T* v, const AttnStrides& s, const int32_t* cu_seqlens,
               int64_t batch, int64_t heads, int64_t head_dim, float scale, T* out) {
  int64_t work = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = cu_seqlens[b + 1] - cu_seqlens[b];
    work += len * len;
  }
  if (work == 0) return;
  // Work items are whole (sequence, head) pairs: worth a second thread from a few of them on.
  const int nt = int(std::min<int64_t>(batch * heads, threads_for(work * heads * head_dim)));
  // Every thread claims (sequence, head) items from one counter until none are left.
  std::atomic<int64_t> next{0};
  parallel_for(nt, nt, [&](int64_t) {
    BF_DISPATCH(attention, q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out, &next);
  });
}

template void attention<float>(const float*, const float*, const float*, const AttnStrides&, const int32_t*,
                               int64_t, int64_t, int64_t, float, float*);
template void attention<bf16>(const bf16*, const bf16*, const bf16*, const AttnStrides&, const int32_t*, int64_t,
                              int64_t, int64_t, float, bf16*);

}  // namespace cpu
}  // namespace bertfast
