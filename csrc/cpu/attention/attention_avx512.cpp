// The AVX-512 tier of the attention (attention.cpp): attention_thread on Avx512Block, 4 query rows of 16-wide
// fp32 vectors at a time, or by key (item_by_key: 16 queries a vector) where an item has no position bias or window;
// also the tier above, amx, where a call cannot take the tiles (fp32 products, head_dim > 64).
#include "cpu/attention/attention_impl.h"

#if BF_X86
namespace bertfast {
namespace cpu {
namespace attention_detail {
namespace {

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
    add_bias512(sc.s.data(), bias, qn, kn);
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
        const __m512 p = _mm512_maskz_mov_ps(mask, exp512_nonpositive(_mm512_sub_ps(sv[c], mv)));
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
    accumulate_rows<false>(sc, vf, qn, kn, dp, first);
  }

  // acc += P V: 4 rows x up to 64 head_dim columns (up to 4 vectors, no more than the head has) per register block;
  // pf: the item's paced prefetch (item_by_key), told of each block's work.
  template <bool kByKey>
  BF_TARGET_AVX512 static void accumulate_rows(Scratch& sc, const float* vf, int64_t qn, int64_t kn, int64_t dp,
                                               bool first, RowPrefetch* pf = nullptr) {
    constexpr int kR = 4;
    for (int64_t i = 0; i < qn; i += kR) {
      const int rows = int(std::min<int64_t>(kR, qn - i));
      for (int64_t e0 = 0; e0 < dp; e0 += 64) {
        if (pf != nullptr) pf->work(kn * kAccumulateWork * std::min<int64_t>(4, (dp - e0) / 16));
        switch (std::min<int64_t>(4, (dp - e0) / 16)) {
          case 1: accumulate<kR, 1, kByKey>(sc, vf, i, rows, e0, kn, dp, first); break;
          case 2: accumulate<kR, 2, kByKey>(sc, vf, i, rows, e0, kn, dp, first); break;
          case 3: accumulate<kR, 3, kByKey>(sc, vf, i, rows, e0, kn, dp, first); break;
          default: accumulate<kR, 4, kByKey>(sc, vf, i, rows, e0, kn, dp, first); break;
        }
      }
    }
  }

  // ---- scores by key: the items without a position bias or a window (attention_thread) ----
  // S^T, [keys][queries], one vector per key for 16 queries: the softmax's max and sum over keys run across vectors
  // (no horizontal reductions, no scalar exp per row), K is read as rows (broadcast) and Q transposed once per query
  // block. Each score is the same sum as by query row (q . k over head_dim in order, from zero); the softmax
  // sums its probabilities in key order. Faster than by query row at MiniLM's shapes (benchmarks/results/2026-12-06-native-notes).
  static constexpr bool kByKey = true;
  // By key a query block is up to 64 queries (4 vectors), where by row it is kQBlock: a 40-token item in one block of
  // 3 vectors, not 2 and then 1 whose pass over every key computed 16 lanes for 8 queries (the same numbers: each
  // query's scores, softmax and sums do not depend on the block it is in).
  static constexpr int64_t kQBlockByKey = 64, kQueryRows = kQBlockByKey;
  // scores_by_key's keys a register tile, by query vectors (<= 24 accumulators). 3 vectors (33-48 queries) at 8 keys,
  // not 4: the faster of the two (benchmarks/results/embed-cpu).
  static constexpr int kKeysPerGroup[4] = {16, 8, 8, 4};
  // Work units (~cycles) of item_by_key's steps, for its RowPrefetch's pace: a Q transpose (16 x 16), a score group
  // per head_dim step (16 FMAs), 4 keys' exponentials (a vector each), a P V block per key and vector (4 FMAs).
  static constexpr int64_t kTransposeWork = 64, kScoreWork = 8, kExpWork = 12, kAccumulateWork = 2;

  // The units an item of len keys reports (item_by_key's loops, counted).
  static int64_t work_by_key(int64_t len, int64_t d, int64_t dp) {
    int64_t units = 0;
    for (int64_t q0 = 0; q0 < len; q0 += kQBlockByKey) {
      // Shifts, not divisions: this runs once an item, and a 12-token item computes for ~1,500 cycles.
      const int64_t qn = std::min<int64_t>(kQBlockByKey, len - q0), qv = (qn + 15) >> 4;
      const int64_t kj_log2 = qv == 1 ? 4 : qv <= 3 ? 3 : 2;  // log2 of kKeysPerGroup[qv - 1]
      units += qv * ((d + 15) >> 4) * kTransposeWork;
      for (int64_t k0 = 0; k0 < len; k0 += kKBlock) {
        const int64_t kn = std::min<int64_t>(kKBlock, len - k0);
        units += ((kn + (1 << kj_log2) - 1) >> kj_log2) * kScoreWork * d + qv * kn * kExpWork;
        for (int64_t e0 = 0; e0 < dp; e0 += 64)
          units += ((qn + 3) >> 2) * kn * kAccumulateWork * std::min<int64_t>(4, (dp - e0) >> 4);
      }
    }
    return units;
  }

  template <typename T>
  BF_TARGET_AVX512 static void item_by_key(Scratch& sc, const T* q, int64_t q_row, const T* k, int64_t k_row,
                                           int64_t len, int64_t d, int64_t dp, float scale, T* out, int64_t H,
                                           RowPrefetch& pf) {
    // K's rows widened, zero past head_dim and past the last key up to a multiple of 16 (a score group's keys).
    const int64_t rows16 = (len + 15) / 16 * 16;
    sc.kt.resize(rows16 * dp);
    for (int64_t j = 0; j < rows16; ++j) {
      float* kd = sc.kt.data() + j * dp;
      for (int64_t e0 = 0; e0 < dp; e0 += 16) {
        const __mmask16 mask = j < len ? tail_mask(d - e0) : 0;
        _mm512_storeu_ps(kd + e0, load16(k + j * k_row + e0, mask));
      }
    }
    float* qt = sc.qf.data();
    pf.pace(work_by_key(len, d, dp));
    for (int64_t q0 = 0; q0 < len; q0 += kQBlockByKey) {
      const int64_t qn = std::min<int64_t>(kQBlockByKey, len - q0);
      const int qv = int((qn + 15) / 16);  // query vectors
      // Q^T [d][kQBlockByKey], pre-scaled (as by row: each q times scale), queries past qn zero.
      for (int c = 0; c < qv; ++c) {
        for (int64_t e0 = 0; e0 < d; e0 += 16) {
          const __mmask16 mask = tail_mask(d - e0);
          __m512 r[16];
          for (int i = 0; i < 16; ++i) {
            const int64_t row = 16 * c + i;
            r[i] = row < qn ? _mm512_mul_ps(load16(q + (q0 + row) * q_row + e0, mask), _mm512_set1_ps(scale))
                            : _mm512_setzero_ps();
          }
          transpose16(r);
          for (int64_t e = 0; e < std::min<int64_t>(16, d - e0); ++e)
            _mm512_storeu_ps(qt + (e0 + e) * kQBlockByKey + 16 * c, r[e]);
          pf.work(kTransposeWork);
        }
      }
      __m512 m[4], l[4];
      for (int c = 0; c < 4; ++c) m[c] = _mm512_set1_ps(-INFINITY), l[c] = _mm512_setzero_ps();
      for (int64_t k0 = 0; k0 < len; k0 += kKBlock) {
        const int64_t kn = std::min<int64_t>(kKBlock, len - k0);
        const bool first = k0 == 0;
        switch (qv) {
          case 1: scores_by_key<1>(qt, sc.kt.data() + k0 * dp, kn, d, dp, sc.s.data(), pf); break;
          case 2: scores_by_key<2>(qt, sc.kt.data() + k0 * dp, kn, d, dp, sc.s.data(), pf); break;
          case 3: scores_by_key<3>(qt, sc.kt.data() + k0 * dp, kn, d, dp, sc.s.data(), pf); break;
          default: scores_by_key<4>(qt, sc.kt.data() + k0 * dp, kn, d, dp, sc.s.data(), pf); break;
        }
        alignas(64) float alpha[kQBlockByKey];
        for (int c = 0; c < qv; ++c) {
          float* s = sc.s.data() + 16 * c;
          // Four chains of maxima, key j in chain j % 4 (the same maximum, sooner), unrolled so they stay in registers
          // (indexed by j % 4 they went through the stack: ~9% of this function's samples on that loop's store).
          __m512 mx0 = m[c], mx1 = m[c], mx2 = m[c], mx3 = m[c];
          int64_t j4 = 0;
          for (; j4 + 4 <= kn; j4 += 4) {
            mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(s + j4 * kQBlockByKey));
            mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(s + (j4 + 1) * kQBlockByKey));
            mx2 = _mm512_max_ps(mx2, _mm512_loadu_ps(s + (j4 + 2) * kQBlockByKey));
            mx3 = _mm512_max_ps(mx3, _mm512_loadu_ps(s + (j4 + 3) * kQBlockByKey));
          }
          if (j4 < kn) mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(s + j4 * kQBlockByKey));
          if (j4 + 1 < kn) mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(s + (j4 + 1) * kQBlockByKey));
          if (j4 + 2 < kn) mx2 = _mm512_max_ps(mx2, _mm512_loadu_ps(s + (j4 + 2) * kQBlockByKey));
          const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx0, mx1), _mm512_max_ps(mx2, mx3));
          // Unused on the first tile (l and acc start there).
          const __m512 a = exp512_nonpositive(_mm512_sub_ps(m[c], mx));
          __m512 sum = _mm512_setzero_ps();
          for (int64_t j = 0; j < kn; ++j) {
            const __m512 p = exp512_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j * kQBlockByKey), mx));
            _mm512_storeu_ps(s + j * kQBlockByKey, p);
            sum = _mm512_add_ps(sum, p);
            if (j % 4 == 3) pf.work(4 * kExpWork);
          }
          l[c] = first ? sum : _mm512_add_ps(_mm512_mul_ps(l[c], a), sum);
          m[c] = mx;
          _mm512_store_ps(alpha + 16 * c, a);
        }
        if (!first) rescale_rows(sc.acc.data(), alpha, qn, dp);
        accumulate_rows<true>(sc, sc.vf.data() + k0 * dp, qn, kn, dp, first, &pf);
      }
      alignas(64) float inv[kQBlockByKey];
      for (int c = 0; c < qv; ++c) _mm512_store_ps(inv + 16 * c, _mm512_div_ps(_mm512_set1_ps(1.0f), l[c]));
      for (int64_t i = 0; i < qn; ++i) {
        const float* a = sc.acc.data() + i * dp;
        T* o = out + (q0 + i) * H;
        const __m512 iv = _mm512_set1_ps(inv[i]);
        for (int64_t e0 = 0; e0 < d; e0 += 16)
          store16(o + e0, _mm512_mul_ps(_mm512_loadu_ps(a + e0), iv), tail_mask(d - e0));
      }
    }
  }

  // s [keys][kQBlockByKey] = K Q^T for a tile's kn keys (rounded up to a group) and kQV vectors of queries: a
  // register tile of kKeysPerGroup keys x kQV vectors, one FMA per head_dim step and key, in head_dim order from zero.
  template <int kQV>
  BF_TARGET_AVX512 __attribute__((noinline)) static void scores_by_key(const float* qt, const float* kf, int64_t kn,
                                                                       int64_t d, int64_t dp, float* s,
                                                                       RowPrefetch& pf) {
    constexpr int kJ = kKeysPerGroup[kQV - 1];
    for (int64_t j0 = 0; j0 < kn; j0 += kJ) {
      __m512 a[kJ][kQV];
      for (int r = 0; r < kJ; ++r)
        for (int c = 0; c < kQV; ++c) a[r][c] = _mm512_setzero_ps();
      const float* kr = kf + j0 * dp;
      for (int64_t e = 0; e < d; ++e) {
        __m512 qv[kQV];
        for (int c = 0; c < kQV; ++c) qv[c] = _mm512_loadu_ps(qt + e * kQBlockByKey + 16 * c);
        for (int r = 0; r < kJ; ++r) {
          const __m512 kb = _mm512_set1_ps(kr[r * dp + e]);
          for (int c = 0; c < kQV; ++c) a[r][c] = _mm512_fmadd_ps(qv[c], kb, a[r][c]);
        }
      }
      for (int r = 0; r < kJ; ++r)
        for (int c = 0; c < kQV; ++c) _mm512_storeu_ps(s + (j0 + r) * kQBlockByKey + 16 * c, a[r][c]);
      pf.work(kScoreWork * d);
    }
  }

  // Rows [i, i + rows) x head_dim columns [e0, e0 + 16 * kV) of acc += P V (acc = P V on the first key tile).
  // kV is a template argument so a 32-wide head (MiniLM) runs 2 vectors a row, not 4 with 2 of zeros.
  // kByKey: P is [keys][kQBlockByKey] (item_by_key), else [kQBlock][kKBlock].
  template <int kR, int kV, bool kByKey = false>
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
        const __m512 p = _mm512_set1_ps(kByKey ? sc.s[j * kQBlockByKey + i + r] : sc.s[(i + r) * kKBlock + j]);
        for (int c = 0; c < kV; ++c) a[r][c] = _mm512_fmadd_ps(p, vv[c], a[r][c]);
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < kV; ++c) _mm512_storeu_ps(sc.acc.data() + (i + r) * dp + e0 + 16 * c, a[r][c]);
  }
};

}  // namespace

BF_ATTENTION_TIER(attention_avx512, BF_TARGET_AVX512, Avx512Block)

}  // namespace attention_detail
}  // namespace cpu
}  // namespace bertfast
#endif
