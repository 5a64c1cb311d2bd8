// The AVX2 tier of the attention (attention.cpp): attention_thread on Avx2Block, the AVX-512 block's schedule
// on 8-wide vectors.
#include "cpu/attention/attention_impl.h"

#if BF_X86
namespace bertfast {
namespace cpu {
namespace attention_detail {
namespace {

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
  static constexpr bool kByKey = false;  // every item scored by query row (attention_thread)
  static constexpr int64_t kQueryRows = kQBlock;

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

}  // namespace

BF_ATTENTION_TIER(attention_avx2, BF_TARGET_AVX2, Avx2Block)

}  // namespace attention_detail
}  // namespace cpu
}  // namespace bertfast
#endif
