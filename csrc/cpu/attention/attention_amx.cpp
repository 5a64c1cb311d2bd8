// The AMX tier of the attention (attention.cpp): bf16 Q K^T and P V on tiles, the online softmax on AVX-512,
// for calls with bf16 products and head_dim <= 64, with or without a position bias (MPNet's table, DeBERTa-v2's
// c2p / p2c) and a sliding window (ModernBERT). Compiled a second time, the tiles emulated, with
// -DBF_AMX_EMULATED=1 (setup.py; the amx_emulated tier: amx_tiles.h).
#include <memory>

#include "cpu/common/amx_tiles.h"
#include "cpu/attention/attention_impl.h"

#if BF_X86
namespace bertfast {
namespace cpu {
namespace attention_detail {
namespace {

// ---- AMX-BF16 (bf16, head_dim <= 64): Q K^T and P V as tile products, softmax on AVX-512 ----
//
// A work item is one (sequence, head), as in attention.cpp. K is packed once per item as AMX B tiles: for 16 keys
// and 32 head dims, B row r holds the pair of dims (2r, 2r + 1) of every key, i.e. the 16 x 16 transpose
// of K viewed as 32-bit pairs. V is packed as pairs of keys (row p holds keys 2p and 2p + 1 interleaved
// per column), the B layout of P V. Per block of 16 queries and 64 keys: S = Q K^T in four fp32 tiles,
// the online softmax in fp32 (scale applied there), P V into fresh tiles added to the fp32 accumulator. P is
// split into two bf16 parts, P = hi + lo with hi = bf16(P) and lo = bf16(P - hi), and P V is the sum of the two
// tile products: P carries ~16 significant bits into the product instead of bf16's 8 (torch's bf16 flash
// attention rounds P to bf16 once, which put BERT-base's max bf16 error at 5.1-5.3e-3 of the fp32 output where
// the other tiers, P fp32, measure 4.6-4.8e-3), for one more A tile and four more tile products per 16 x 64 block.
// Head dims are zero-padded to 32 or 64 in the packed copies, so any head_dim <= 64 works.
//
// A position bias is added to the fp32 score tile after the Q K^T product, the scores scaled first (add_bias of
// attention_impl.h: the fp32-math tiers' code and order). A window is the fp32-math tiers' too: a query block
// visits only the key blocks meeting its rows' windows, its diagonal block first (TileWalk), and
// inside a block only the 16-key score tiles meeting them; keys outside a row's window leave its softmax (P = 0).
// The blocking depends on the sequence alone (its length, the window), never on the other sequences of the call.
constexpr int64_t kAmxQ = 16;     // query rows per block (tile rows)
constexpr int64_t kAmxKeys = 64;  // keys per block (four 16-key score tiles)
static_assert(kAmxKeys == kKBlock, "the window's tile walk and add_bias's row stride are attention_impl.h's");
static_assert(kAmxKeys % kAmxQ == 0, "a query block lies inside one key block (its diagonal block)");

struct AmxScratch {
  std::vector<uint32_t> kp;  // [key tiles of 16][dp / 32][16 dim pairs][16 keys]
  std::vector<bf16> vp;      // [keys rounded to kAmxKeys / 2][dp][2]
  alignas(64) bf16 qs[kAmxQ * 64];
  alignas(64) float s[kAmxQ * kAmxKeys];
  alignas(64) bf16 ps[kAmxQ * kAmxKeys];     // P's high part, bf16(P)
  alignas(64) bf16 ps_lo[kAmxQ * kAmxKeys];  // and its low part, bf16(P - bf16(P))
  alignas(64) float pv[kAmxQ * 64];
  alignas(64) float acc[kAmxQ * 64];
  float m[kAmxQ], l[kAmxQ];
};

BF_TARGET_TILES_BF16 BF_INLINE __mmask32 dims_mask(int64_t d, int64_t e0) {
  const int64_t n = std::min<int64_t>(32, std::max<int64_t>(0, d - e0));
  return n == 32 ? __mmask32(0xffffffffu) : __mmask32((1u << n) - 1u);
}

// 32 elements of a row as bf16 (fp32 inputs rounded to nearest even), lanes outside `m` zero.
BF_TARGET_TILES_BF16 BF_INLINE __m512i load32_bf16(const bf16* p, __mmask32 m) {
  return _mm512_maskz_loadu_epi16(m, p);
}
BF_TARGET_TILES_BF16 BF_INLINE __m512i load32_bf16(const float* p, __mmask32 m) {
  const __m512 lo = _mm512_maskz_loadu_ps(__mmask16(m), p), hi = _mm512_maskz_loadu_ps(__mmask16(m >> 16), p + 16);
  return BF_CVTNE2PS_BF16(hi, lo);
}

// K rows [0, len) of one head (row stride in elements) into kp; keys and dims past the end are zero.
template <typename T>
BF_TARGET_TILES_BF16 BF_INLINE void amx_pack_k(const T* k, int64_t row_stride, int64_t len, int64_t d, int64_t dp,
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
BF_TARGET_TILES_BF16 BF_INLINE void amx_pack_v(const T* v, int64_t row_stride, int64_t len, int64_t padded, int64_t d,
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

// Bits [lo, hi) of a 64-bit key mask, 0 <= lo <= hi <= 64.
BF_INLINE uint64_t key_bits(int64_t lo, int64_t hi) {
  const auto below = [](int64_t n) { return n >= 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1; };
  return below(hi) & ~below(lo);
}

// Online softmax of one block's scores (rows [0, qn) x kn keys in sc.s, times `factor` for the scale) into
// probabilities split in two bf16 parts, sc.ps and sc.ps_lo (zero past kn up to kAmxKeys, and outside each row's
// window `win`, the fp32-math tiers' mask_window); rescales the accumulator rows by the change of their max. Works
// in base 2: scores times factor * log2(e), so m and the exponents are in log2 units. A row's first block (its
// diagonal one with a window) holds its own key, so its max is finite from then on.
BF_TARGET_TILES_BF16 BF_INLINE void amx_softmax_block(AmxScratch& sc, int64_t qn, int64_t kn, int64_t dp, float factor,
                                               const TileWindow& win, bool first) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), to_log2 = _mm512_set1_ps(factor * 1.44269504088896341f);
  for (int64_t i = 0; i < qn; ++i) {
    uint64_t keys = key_bits(0, kn);
    if (win.window > 0) {
      const int64_t lo = std::clamp<int64_t>(i - win.offset - win.window, 0, kn);
      keys = key_bits(lo, std::clamp<int64_t>(i - win.offset + win.window + 1, lo, kn));
    }
    __mmask16 masks[4];
    for (int c = 0; c < 4; ++c) masks[c] = __mmask16(keys >> (16 * c));
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
    bf16* pr_lo = sc.ps_lo + i * kAmxKeys;
    for (int c = 0; c < 4; ++c) {
      const __m512 p = _mm512_maskz_mov_ps(masks[c], exp2_512(_mm512_sub_ps(sv[c], mv)));
      const __m256i hi = BF_CVTNEPS_BF16(p);
      const __m512 lo = _mm512_sub_ps(p, widen_bf16(hi));  // exact: hi is p's leading bits
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * c), hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr_lo + 16 * c), BF_CVTNEPS_BF16(lo));
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

// Tile products with the tile numbers the instructions need as immediates: C tile g += A(4) x B(5), and for P V
// also C tile g += A(6) x B(5) (P's low part).
#define BF_AMX_QK(g)                                                      \
  if (g >= g_lo && g < g_hi) {                                            \
    BF_TILE_LOADD(5, sc.kp.data() + ((kb / 16 + g) * chunks + c) * 256, 64); \
    BF_TILE_DPBF16PS(g, 4, 5);                                              \
  }
#define BF_AMX_PV(g)                                                          \
  if (ngroups > g) {                                                          \
    BF_TILE_LOADD(5, sc.vp.data() + ((kb + 32 * kc) / 2 * dp + 16 * g) * 2, dp * 4); \
    BF_TILE_DPBF16PS(g, 4, 5);                                                  \
    BF_TILE_DPBF16PS(g, 6, 5);                                                  \
  }

}  // namespace

template <typename T>  // bf16, or fp32 rounded to bf16 as it is packed
BF_TARGET_TILES_BF16 void BF_TILES(attention_amx)(const T* q, const T* k, const T* v, const AttnStrides& st,
                                                   const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t d,
                                                   float scale, T* out, std::atomic<int64_t>* next,
                                                   const AttnBias* bias, int64_t window) {
  DenormalGuard ftz;
  // Per thread across calls, reached through a reference made once: a reference to the thread_local itself had its
  // address looked up again (__tls_get_addr) at each use after a call, 30 times in this function.
  static thread_local std::unique_ptr<AmxScratch> tls;
  if (!tls) tls.reset(new AmxScratch);
  AmxScratch& sc = *tls;
  const int64_t H = heads * d;
  const int64_t dp = d <= 32 ? 32 : 64;
  const int64_t chunks = dp / 32, ngroups = dp / 16;
  amx_load_tile_config(16);  // tmm0-3 score / output tiles, tmm4 A (Q or P's high part), tmm5 B (K or V), tmm6 A
                             // (P's low part)
  WorkItems items{next, cu_seqlens, batch * heads, heads};
  int64_t h, start, len;
  while (items.claim(&h, &start, &len)) {
    const int64_t w = window < len - 1 ? window : 0;  // a window reaching every key is no window
    const int64_t padded = (len + kAmxKeys - 1) / kAmxKeys * kAmxKeys;
    sc.kp.resize(padded / 16 * chunks * 256);
    sc.vp.resize(padded * dp);
    amx_pack_k(k + start * st.k_row + h * st.k_head, st.k_row, len, d, dp, sc.kp.data());
    // Key tiles past len inside the last block are read by no product (g_hi stops at ceil(kn / 16)).
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
      // The softmax writes rows [0, qn) of P: the rows past them stay zero, so P V adds nothing to theirs.
      std::memset(static_cast<void*>(sc.ps + qn * kAmxKeys), 0, (kAmxQ - qn) * kAmxKeys * sizeof(bf16));
      std::memset(static_cast<void*>(sc.ps_lo + qn * kAmxKeys), 0, (kAmxQ - qn) * kAmxKeys * sizeof(bf16));
      const TileWalk walk(q0, qn, len, w);
      for (int64_t n = 0; n < walk.count(); ++n) {
        const int64_t kb = walk.tile(n) * kAmxKeys;
        const int64_t kn = std::min<int64_t>(kAmxKeys, len - kb);
        // The 16-key score tiles [g_lo, g_hi) meeting some row's window; those outside stay zero and are masked.
        int64_t g_lo = 0, g_hi = (kn + 15) / 16;
        TileWindow tw;
        if (w > 0) {
          g_lo = std::max<int64_t>(0, q0 - w - kb) / 16;
          g_hi = std::min<int64_t>(kn - 1, q0 + qn - 1 + w - kb) / 16 + 1;
          tw = {w, kb - q0};
        }
        BF_TILE_ZERO(0);
        BF_TILE_ZERO(1);
        BF_TILE_ZERO(2);
        BF_TILE_ZERO(3);
        for (int64_t c = 0; c < chunks; ++c) {
          BF_TILE_LOADD(4, sc.qs + 32 * c, dp * 2);
          BF_AMX_QK(0) BF_AMX_QK(1) BF_AMX_QK(2) BF_AMX_QK(3)
        }
        BF_TILE_STORED(0, sc.s, kAmxKeys * 4);
        BF_TILE_STORED(1, sc.s + 16, kAmxKeys * 4);
        BF_TILE_STORED(2, sc.s + 32, kAmxKeys * 4);
        BF_TILE_STORED(3, sc.s + 48, kAmxKeys * 4);
        float factor = scale;
        if (bias != nullptr) {  // the bias is on the scale of the scaled scores: scale first, then add it
          for (int64_t i = 0; i < qn; ++i) {
            float* si = sc.s + i * kAmxKeys;
#pragma omp simd
            for (int64_t j = 0; j < kn; ++j) si[j] *= scale;
          }
          add_bias512(sc.s, tile_bias(*bias, heads, h, start, q0, kb), qn, kn);
          factor = 1.f;
        }
        amx_softmax_block(sc, qn, kn, dp, factor, tw, n == 0);
        BF_TILE_ZERO(0);
        BF_TILE_ZERO(1);
        BF_TILE_ZERO(2);
        BF_TILE_ZERO(3);
        // Pairs of score tiles with no key in any row's window have P = 0: skipped.
        for (int64_t kc = g_lo / 2; kc < (g_hi + 1) / 2; ++kc) {
          BF_TILE_LOADD(4, sc.ps + 32 * kc, kAmxKeys * 2);
          BF_TILE_LOADD(6, sc.ps_lo + 32 * kc, kAmxKeys * 2);
          BF_AMX_PV(0) BF_AMX_PV(1) BF_AMX_PV(2) BF_AMX_PV(3)
        }
        BF_TILE_STORED(0, sc.pv, dp * 4);
        BF_TILE_STORED(1, sc.pv + 16, dp * 4);
        if (ngroups > 2) {
          BF_TILE_STORED(2, sc.pv + 32, dp * 4);
          BF_TILE_STORED(3, sc.pv + 48, dp * 4);
        }
        for (int64_t i = 0; i < kAmxQ * dp; i += 16) {
          const __m512 pv = _mm512_load_ps(sc.pv + i);
          _mm512_store_ps(sc.acc + i, n == 0 ? pv : _mm512_add_ps(_mm512_load_ps(sc.acc + i), pv));
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
  BF_TILE_RELEASE();
}
#undef BF_AMX_QK
#undef BF_AMX_PV

template BF_TARGET_TILES_BF16 void BF_TILES(attention_amx)<float>(const float*, const float*, const float*,
                                                                  const AttnStrides&, const int32_t*, int64_t,
                                                                  int64_t, int64_t, float, float*,
                                                                  std::atomic<int64_t>*, const AttnBias*, int64_t);
template BF_TARGET_TILES_BF16 void BF_TILES(attention_amx)<bf16>(const bf16*, const bf16*, const bf16*,
                                                                 const AttnStrides&, const int32_t*, int64_t, int64_t,
                                                                 int64_t, float, bf16*, std::atomic<int64_t>*,
                                                                 const AttnBias*, int64_t);

}  // namespace attention_detail
}  // namespace cpu
}  // namespace bertfast
#endif
