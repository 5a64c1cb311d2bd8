// Attention on AVX-512 BF16 without AMX (attention.cpp chooses it) for the int8 path (fp32 q / k / v, or bf16 from
// int8_linear_bf16) and the bf16 dtype: head_dim <= 64, no position bias; a sliding window for the bf16 dtype. Each
// (sequence, head) item is scored by key as in attention_avx512.cpp (16 queries a vector, the softmax across
// vectors), with both products as vdpbf16ps:
//   S^T = K Q^T: Q and K rounded to bf16 (RNE; bf16 inputs as they are), pairs of head dims in one 32-bit word, the
//                products accumulated in fp32 over the pairs in order from zero, then times scale * log2(e) (the
//                softmax takes 2^x);
//   O  = P V:    P (fp32 after the softmax) and V rounded to bf16, pairs of keys in one word, accumulated in fp32.
// That halves the score multiply-adds of the fp32 kernel, and K and V are read once into half-size copies. On the
// int8 path P is rounded to bf16 once, as torch's bf16 flash attention rounds it: the output is quantized to int8
// right after (the output GEMM's operand), an error far above P's rounding. The bf16 dtype (kSplit) carries P in two
// bf16 parts, hi = bf16(P) and lo = bf16(P - hi), as the AMX tiles do: P V as two vdpbf16ps per key pair, the output
// as close to fp32 as its own rounding to bf16 allows, faster than the fp32-math kernel on bf16 inputs
// (benchmarks/results/embed-cpu). The blocking depends on the item's own length alone, so a sequence's bits do not
// depend on the others in the call.
#include <memory>

#include "cpu/attention/attention_impl.h"

#if BF_X86
namespace bertfast {
namespace cpu {
namespace attention_detail {
namespace {

constexpr int64_t kMaxDims = 64;

// Buffers of one thread. dp = head_dim rounded up to 32 (zero dims past head_dim), dw = dp / 2 words a row.
struct Bf16Scratch {
  std::vector<uint32_t> k2;  // [keys rounded to 16][dw]: K's rows in bf16, word w = dims (2w, 2w + 1)
  std::vector<uint32_t> v2;  // [key pairs][dp]: word (p, e) = (V[2p][e], V[2p + 1][e]) in bf16
  alignas(64) uint32_t qt[kMaxDims / 2 * kQBlock];    // [dw][kQBlock]: Q's words transposed, 16 queries a vector
  alignas(64) float s[kKBlock * kQBlock];             // [keys][kQBlock]: scores, then probabilities
  alignas(64) uint32_t pw[kKBlock / 2 * kQBlock];     // [key pairs][kQBlock]: word = (P[2p][i], P[2p + 1][i])
  alignas(64) uint32_t pw_lo[kKBlock / 2 * kQBlock];  // the same of P - bf16(P) (kSplit)
  alignas(64) float acc[kQBlock * kMaxDims];          // [kQBlock][dp]
};

// 16 words (a[i], b[i]) in bf16: a's and b's lanes rounded (RNE) and interleaved.
BF_TARGET_AVX512BF16 BF_INLINE __m512i pair_words(__m512 a, __m512 b) {
  alignas(64) static const int16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // bf16 lanes 0..15: a, 16..31: b
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), ab);
}

// 32 consecutive floats from p (lanes past `left` zero) as 16 bf16 words, in memory order.
template <typename T>
BF_TARGET_AVX512BF16 BF_INLINE __m512i row_words(const T* p, int64_t left) {
  return (__m512i)_mm512_cvtne2ps_pbh(load16(p + 16, tail_mask(left - 16)), load16(p, tail_mask(left)));
}

// The same from bf16: 32 consecutive values (lanes past `left` zero) as they are.
BF_TARGET_AVX512BF16 BF_INLINE __m512i row_words(const bf16* p, int64_t left) {
  const __mmask32 m = left >= 32 ? ~__mmask32(0) : left <= 0 ? __mmask32(0) : __mmask32((1u << left) - 1u);
  return _mm512_maskz_loadu_epi16(m, p);
}

// s [keys][kQBlock] = (K Q^T) * scale for kn keys (rounded up to a register tile) and kQV vectors of queries: a
// register tile of 16 / kQV keys x kQV vectors, one vdpbf16ps per dim pair and key.
template <int kQV>
BF_TARGET_AVX512BF16 __attribute__((noinline)) void scores(const uint32_t* qt, const uint32_t* k2, int64_t kn,
                                                           int64_t pairs, int64_t dw, float scale, float* s) {
  constexpr int kJ = 16 / kQV;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < kn; j0 += kJ) {
    __m512 a[kJ][kQV];
    for (int r = 0; r < kJ; ++r)
      for (int c = 0; c < kQV; ++c) a[r][c] = _mm512_setzero_ps();
    const uint32_t* kr = k2 + j0 * dw;
    for (int64_t w = 0; w < pairs; ++w) {
      __m512bh qv[kQV];
      for (int c = 0; c < kQV; ++c) qv[c] = (__m512bh)_mm512_load_si512(qt + w * kQBlock + 16 * c);
      for (int r = 0; r < kJ; ++r) {
        const __m512bh kb = (__m512bh)_mm512_set1_epi32(int(kr[r * dw + w]));
        for (int c = 0; c < kQV; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], qv[c], kb);
      }
    }
    for (int r = 0; r < kJ; ++r)
      for (int c = 0; c < kQV; ++c) _mm512_store_ps(s + (j0 + r) * kQBlock + 16 * c, _mm512_mul_ps(a[r][c], sv));
  }
}

// Rows [i, i + rows) of acc (+)= P V over a tile's key pairs, kR <= rows rows of kV vectors of 16 dims (dp = 16 kV)
// in registers.
template <int kR, int kV, bool kSplit>
BF_TARGET_AVX512BF16 __attribute__((noinline)) void accumulate(Bf16Scratch& sc, const uint32_t* v2, int64_t i,
                                                               int rows, int64_t key_pairs, bool first) {
  constexpr int dp = 16 * kV;
  __m512 a[kR][kV];
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kV; ++c)
      a[r][c] = (!first && r < rows) ? _mm512_load_ps(sc.acc + (i + r) * dp + 16 * c) : _mm512_setzero_ps();
  for (int64_t p = 0; p < key_pairs; ++p) {
    __m512bh vv[kV];
    for (int c = 0; c < kV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v2 + p * dp + 16 * c);
    for (int r = 0; r < kR; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(int(sc.pw[p * kQBlock + i + r]));
      for (int c = 0; c < kV; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pb, vv[c]);
      if constexpr (kSplit) {
        const __m512bh pl = (__m512bh)_mm512_set1_epi32(int(sc.pw_lo[p * kQBlock + i + r]));
        for (int c = 0; c < kV; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pl, vv[c]);
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < kV; ++c) _mm512_store_ps(sc.acc + (i + r) * dp + 16 * c, a[r][c]);
}

// The query lanes 16c..16c+15 of a block that key j of a tile sees in a sliding window w: |j + off - i| <= w, off =
// the tile's first key minus the block's first query.
BF_INLINE __mmask16 window_lanes(int64_t j, int c, int64_t off, int64_t w) {
  const int64_t lo = std::max<int64_t>(j + off - w - 16 * c, 0), hi = std::min<int64_t>(j + off + w - 16 * c, 15);
  return lo > hi ? __mmask16(0) : __mmask16(((2u << hi) - 1u) & ~((1u << lo) - 1u));
}

// x rounded to bf16 (RNE, as pair_words rounds) and back to fp32.
BF_TARGET_AVX512BF16 BF_INLINE __m512 bf16_rounded(__m512 x) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One (sequence, head) item: q, k, v and out at its first row.
// w > 0: a sliding window (the bf16 dtype's, ModernBERT's local layers): each query block visits only the key tiles
// its rows' windows meet, its diagonal tile first (every row then has a key from the first tile on), as
// attention_thread does; keys outside a row's window are left out of its max and its probabilities.
template <typename T, typename O, bool kSplit>
BF_TARGET_AVX512BF16 void item(Bf16Scratch& sc, const T* q, const T* k, const T* v, const AttnStrides& st,
                               int64_t len, int64_t d, float scale, O* out, int64_t H, RowPrefetch& pf,
                               int64_t rows_per_run, int64_t w) {
  const int64_t dp = (d + 31) / 32 * 32, dw = dp / 2, pairs = (d + 1) / 2;
  const float scale2 = scale * kLog2e;  // the scores in log2 units, for exp2
  // K's rows as words, zero past the last key up to a multiple of 16 (the score tiles' keys).
  const int64_t rows16 = (len + 15) / 16 * 16;
  sc.k2.resize(rows16 * dw);
  for (int64_t j = 0; j < rows16; ++j)
    for (int64_t e0 = 0; e0 < dp; e0 += 32)
      _mm512_storeu_si512(sc.k2.data() + j * dw + e0 / 2,
                          j < len ? row_words(k + j * st.k_row + e0, d - e0) : _mm512_setzero_si512());
  // V's rows in pairs; an odd last key is paired with zeros.
  const int64_t key_pairs = (len + 1) / 2;
  sc.v2.resize(key_pairs * dp);
  for (int64_t p = 0; p < key_pairs; ++p) {
    const T* v0 = v + 2 * p * st.v_row;
    for (int64_t e0 = 0; e0 < dp; e0 += 16) {
      const __mmask16 m = tail_mask(d - e0);
      const __m512 b = 2 * p + 1 < len ? load16(v0 + st.v_row + e0, m) : _mm512_setzero_ps();
      _mm512_storeu_si512(sc.v2.data() + p * dp + e0, pair_words(load16(v0 + e0, m), b));
    }
  }
  for (int64_t q0 = 0; q0 < len; q0 += kQBlock) {
    const int64_t qn = std::min<int64_t>(kQBlock, len - q0);
    const int qv = int((qn + 15) / 16);  // query vectors
    // Q^T as words [dw][kQBlock], queries past qn zero.
    for (int c = 0; c < qv; ++c) {
      for (int64_t e0 = 0; e0 < dp; e0 += 32) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) {
          const int64_t row = 16 * c + i;
          r[i] = row < qn ? _mm512_castsi512_ps(row_words(q + (q0 + row) * st.q_row + e0, d - e0))
                          : _mm512_setzero_ps();
        }
        transpose16(r);
        for (int w = 0; w < 16; ++w) _mm512_store_ps(reinterpret_cast<float*>(sc.qt + (e0 / 2 + w) * kQBlock) + 16 * c, r[w]);
      }
    }
    __m512 m[2], l[2];
    for (int c = 0; c < 2; ++c) m[c] = _mm512_set1_ps(-INFINITY), l[c] = _mm512_setzero_ps();
    const TileWalk walk(q0, qn, len, w);
    for (int64_t n = 0; n < walk.count(); ++n) {
      const int64_t k0 = walk.tile(n) * kKBlock;
      const int64_t kn = std::min<int64_t>(kKBlock, len - k0);
      const bool first = n == 0;
      // Only a tile some row's window leaves part of is masked.
      const bool masked = w > 0 && (k0 + kn - 1 - q0 > w || q0 + qn - 1 - k0 > w);
      pf.step(rows_per_run);
      if (qv == 1) scores<1>(sc.qt, sc.k2.data() + k0 * dw, kn, pairs, dw, scale2, sc.s);
      else scores<2>(sc.qt, sc.k2.data() + k0 * dw, kn, pairs, dw, scale2, sc.s);
      // The online softmax over the tile's keys, per vector of queries (the scores are in log2 units: 2^x), P
      // paired by keys into bf16 words as it is computed; an odd last key is paired with zero.
      alignas(64) float alpha[kQBlock];
      for (int c = 0; c < qv; ++c) {
        const float* s = sc.s + 16 * c;
        const auto lanes = [&](int64_t j) { return masked ? window_lanes(j, c, k0 - q0, w) : __mmask16(0xffff); };
        __m512 mx = m[c];
        for (int64_t j = 0; j < kn; ++j)
          mx = _mm512_mask_max_ps(mx, lanes(j), mx, _mm512_load_ps(s + j * kQBlock));
        const __m512 a = exp2_512(_mm512_sub_ps(m[c], mx));  // unused on the first tile (l and acc start there)
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < kn; j += 2) {
          // Keys outside a row's window: 0 (2^x is clamped at 2^-126, not 0).
          const __m512 p0 = _mm512_maskz_mov_ps(lanes(j), exp2_512(_mm512_sub_ps(_mm512_load_ps(s + j * kQBlock), mx)));
          const __m512 p1 = j + 1 < kn ? _mm512_maskz_mov_ps(lanes(j + 1), exp2_512(_mm512_sub_ps(
                                             _mm512_load_ps(s + (j + 1) * kQBlock), mx)))
                                       : _mm512_setzero_ps();
          sum = _mm512_add_ps(_mm512_add_ps(sum, p0), p1);
          _mm512_store_si512(sc.pw + (j / 2) * kQBlock + 16 * c, pair_words(p0, p1));
          if constexpr (kSplit)  // what rounding P to bf16 dropped, in bf16 too: P = hi + lo to ~16 bits
            _mm512_store_si512(sc.pw_lo + (j / 2) * kQBlock + 16 * c,
                               pair_words(_mm512_sub_ps(p0, bf16_rounded(p0)), _mm512_sub_ps(p1, bf16_rounded(p1))));
        }
        l[c] = first ? sum : _mm512_add_ps(_mm512_mul_ps(l[c], a), sum);
        m[c] = mx;
        _mm512_store_ps(alpha + 16 * c, a);
      }
      if (!first) rescale_rows(sc.acc, alpha, qn, dp);
      const uint32_t* v2 = sc.v2.data() + (k0 / 2) * dp;
      const int64_t tile_pairs = (kn + 1) / 2;
      constexpr int kRows = 8;  // rows a register block: 16 accumulators for head_dim <= 32, 32 up to 64 (4 rows)
      for (int64_t i = 0; i < qn; i += dp == 32 ? kRows : kRows / 2) {
        if (dp == 32)
          accumulate<kRows, 2, kSplit>(sc, v2, i, int(std::min<int64_t>(kRows, qn - i)), tile_pairs, first);
        else
          accumulate<kRows / 2, 4, kSplit>(sc, v2, i, int(std::min<int64_t>(kRows / 2, qn - i)), tile_pairs, first);
      }
    }
    alignas(64) float inv[kQBlock];
    for (int c = 0; c < qv; ++c) _mm512_store_ps(inv + 16 * c, _mm512_div_ps(_mm512_set1_ps(1.0f), l[c]));
    for (int64_t i = 0; i < qn; ++i) {
      const __m512 iv = _mm512_set1_ps(inv[i]);
      O* o = out + (q0 + i) * H;
      for (int64_t e0 = 0; e0 < d; e0 += 16)
        store16(o + e0, _mm512_mul_ps(_mm512_load_ps(sc.acc + i * dp + e0), iv), tail_mask(d - e0));
    }
  }
}

}  // namespace

template <typename T, typename O, bool kSplit>
BF_TARGET_AVX512BF16 void attention_avx512bf16(const T* q, const T* k, const T* v, const AttnStrides& st,
                                               const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t d,
                                               float scale, O* out, std::atomic<int64_t>* next, int64_t window) {
  DenormalGuard ftz;
  const int64_t H = heads * d;
  // Per thread across calls (at small batches allocation would cost more), reached through a pointer read once: a
  // reference to the thread_local itself had its address looked up again (__tls_get_addr) at every use after a call.
  static thread_local std::unique_ptr<Bf16Scratch> tls;
  if (!tls) tls = std::make_unique<Bf16Scratch>();
  Bf16Scratch& sc = *tls.get();
  WorkItems items{next, cu_seqlens, batch * heads, heads};
  for_each_item(items, q, k, v, out, st, d, [&](int64_t h, int64_t start, int64_t len, RowPrefetch& pf) {
    const int64_t runs = ((len + kQBlock - 1) / kQBlock) * ((len + kKBlock - 1) / kKBlock);
    const int64_t rows_per_run = (pf.rows + runs - 1) / runs;  // the next item's rows (none after the last)
    item<T, O, kSplit>(sc, q + start * st.q_row + h * st.q_head, k + start * st.k_row + h * st.k_head,
            v + start * st.v_row + h * st.v_head, st, len, d, scale, out + start * H + h * d, H, pf, rows_per_run,
            window < len - 1 ? window : 0);  // a window reaching every key is no window
  });
}

template BF_TARGET_AVX512BF16 void attention_avx512bf16<float, float, false>(
    const float*, const float*, const float*, const AttnStrides&, const int32_t*, int64_t, int64_t, int64_t, float,
    float*, std::atomic<int64_t>*, int64_t);
template BF_TARGET_AVX512BF16 void attention_avx512bf16<bf16, float, false>(
    const bf16*, const bf16*, const bf16*, const AttnStrides&, const int32_t*, int64_t, int64_t, int64_t, float, float*,
    std::atomic<int64_t>*, int64_t);
template BF_TARGET_AVX512BF16 void attention_avx512bf16<bf16, bf16, true>(
    const bf16*, const bf16*, const bf16*, const AttnStrides&, const int32_t*, int64_t, int64_t, int64_t, float, bf16*,
    std::atomic<int64_t>*, int64_t);

}  // namespace attention_detail
}  // namespace cpu
}  // namespace bertfast
#endif
