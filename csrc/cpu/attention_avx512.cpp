// The AVX-512 tier of the attention (attention.cpp): attention_thread on Avx512Block, 4 query rows of 16-wide
// fp32 vectors at a time; also the tier above, amx, where a call cannot take the tiles (fp32 products,
// head_dim > 64).
#include "attention_impl.h"

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

}  // namespace

BF_ATTENTION_TIER(attention_avx512, BF_TARGET_AVX512, Avx512Block)

}  // namespace attention_detail
}  // namespace cpu
}  // namespace bertfast
#endif
