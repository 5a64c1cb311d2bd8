// Attention with int16 products on AVX-512 VNNI without AVX-512 BF16 (attention.cpp chooses it): the int8 path's (fp32
// q, k, v; head_dim <= 64; no position bias, no window), where AVX-512 BF16 CPUs round the products' operands to bf16
// (attention_avx512bf16.cpp). Each (sequence, head) item is scored by key as there (16 queries a vector, the softmax
// across vectors), with both products as vpdpwssd (two int16 products summed into an int32 lane):
//   S^T = K Q^T: each query's and each key's head_dim values quantized on their own scale (their largest magnitude),
//                to 13-bit codes for head_dim <= 32 and 12-bit up to 64 (head_dim x the codes' product fits int32),
//                pairs of dims in one word, summed exactly in int32, then times both scales (and scale * log2(e): the
//                softmax takes 2^x);
//   O  = P V:    P (in [0, 1] after the softmax's max) as 13-bit codes, V per head_dim column on its scale over the
//                sequence's keys as 12-bit codes, pairs of keys in one word, summed exactly in int32 per key tile
//                (64 keys x 8191 x 4095 fits int32), then in fp32 across tiles; the softmax's sum adds the same codes,
//                so the output is a weighted average of the quantized V with the quantized P's weights.
// Every code keeps 12-13 bits where bf16 keeps 8: the output is 10-25x closer to fp64 than attention on bf16-rounded
// q, k, v (tests/ops/cpu/test_attention_int16.py), and the int8 output GEMM quantizes it next to 8 bits. A non-finite
// q row, k row or v column gives NaN where it would reach in fp32 (that query's output; every output of the item; that
// column), the codes of finite values unchanged. Every scale is a query's, a key's or a V column's of one (sequence,
// head): a sequence's bits do not depend on the others in the call.
#include <cmath>
#include <memory>

#include "cpu/attention/attention_impl.h"

#if BF_X86
namespace bertfast {
namespace cpu {
namespace attention_detail {
namespace {

constexpr int64_t kMaxDims = 64;
constexpr int64_t kBlock = 64;  // queries a block: up to 4 vectors (a ~40-token item in one block of 3)
constexpr int32_t kRangeP = 8191, kRangeV = 4095;  // P's and V's largest codes
static_assert(kKBlock * int64_t(kRangeP) * kRangeV <= INT32_MAX, "a key tile's P V sums fit int32");
constexpr float kTiny = 1e-30f;  // a row or column below this magnitude is all zero codes (its range would overflow)
// Keys a score register tile, by query vectors (<= 24 int32 accumulators), as attention_avx512.cpp's by key.
constexpr int kKeysPerTile[4] = {16, 8, 8, 4};

// Q's and K's largest code for head_dim padded to dp: dp x range^2 fits int32.
BF_INLINE int32_t qk_range(int64_t dp) { return dp <= 32 ? 8191 : 4095; }
static_assert(32 * 8191LL * 8191 <= INT32_MAX && kMaxDims * 4095LL * 4095 <= INT32_MAX, "a score's sum fits int32");

// Buffers of one thread. dp = head_dim rounded up to 32 (zero dims past head_dim), dw = dp / 2 words a row.
struct Int16Scratch {
  std::vector<uint32_t> k2;  // [keys rounded to 16][dw]: K's codes, word w = dims (2w, 2w + 1)
  std::vector<float> ks;     // [keys rounded to 16]: K's row scales (0 past the last key)
  std::vector<uint32_t> v2;  // [key pairs][dp]: word (p, e) = V's codes (2p, e), (2p + 1, e)
  alignas(64) float qf[kMaxDims * kBlock];        // [dp][kBlock]: Q transposed, 16 queries a vector
  alignas(64) uint32_t qt[kMaxDims / 2 * kBlock];  // [dw][kBlock]: Q's codes as words
  alignas(64) float s[kKBlock * kBlock];           // [keys][kBlock]: scores (log2 units)
  alignas(64) uint32_t pw[kKBlock / 2 * kBlock];   // [key pairs][kBlock]: word = P's codes (2p, i), (2p + 1, i)
  alignas(64) float acc[kBlock * kMaxDims];        // [kBlock][dp]: P V in code units
};

BF_TARGET_VNNI BF_INLINE __m512i codes(__m512 x, __m512 inv) {
  return _mm512_cvt_roundps_epi32(_mm512_mul_ps(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// acc += a . b per pair of int16 words. Inline asm as int8_linear_impl.h's dpbusd: GCC 12's builtin does not tie the
// accumulator to the destination, and a tile of them was copied and spilled around every instruction.
BF_TARGET_VNNI BF_INLINE void dpwssd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// 16 words (a[i], b[i]) of two vectors of int16-range codes.
BF_TARGET_VNNI BF_INLINE __m512i words(__m512i a, __m512i b) {
  return _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(b, 16));
}

// Magnitudes as the bits of |x|: their unsigned integer maximum is the float maximum where all are finite, and from
// the bits of infinity on (NaN above them) where any is not: one max a vector, no compare.
BF_TARGET_VNNI BF_INLINE __m512i magnitude(__m512 x) {
  return _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
}
BF_TARGET_VNNI BF_INLINE __mmask16 not_finite(__m512i largest) {
  return _mm512_cmpge_epu32_mask(largest, _mm512_set1_epi32(0x7f800000));
}

// range / the largest magnitude where that is from kTiny on and finite, else 0 (all codes 0).
BF_TARGET_VNNI BF_INLINE __m512 code_inverse(__m512i largest, int32_t range) {
  const __m512 top = _mm512_castsi512_ps(largest);
  const __mmask16 ok = _mm512_cmp_ps_mask(top, _mm512_set1_ps(kTiny), _CMP_GE_OQ) & ~not_finite(largest);
  return _mm512_maskz_div_ps(ok, _mm512_set1_ps(float(range)), top);
}

// s [keys][kBlock] = (K Q^T) in log2 units for kn keys (rounded up to a register tile) and kQV vectors of queries: a
// register tile of kKeysPerTile keys x kQV vectors, one vpdpwssd per dim pair and key, then each sum times its query's
// scale (qsc: with scale * log2(e)) and its key's (ks).
template <int kQV>
BF_TARGET_VNNI __attribute__((noinline)) void scores(const uint32_t* qt, const uint32_t* k2, const float* ks,
                                                     int64_t kn, int64_t pairs, int64_t dw, const __m512* qsc,
                                                     float* s, RowPrefetch& pf) {
  constexpr int kJ = kKeysPerTile[kQV - 1];
  for (int64_t j0 = 0; j0 < kn; j0 += kJ) {
    __m512i a[kJ][kQV];
#pragma GCC unroll 16
    for (int r = 0; r < kJ; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < kQV; ++c) a[r][c] = _mm512_setzero_si512();
    const uint32_t* kr = k2 + j0 * dw;
    for (int64_t w = 0; w < pairs; ++w) {
      __m512i qv[kQV];
#pragma GCC unroll 4
      for (int c = 0; c < kQV; ++c) qv[c] = _mm512_load_si512(qt + w * kBlock + 16 * c);
#pragma GCC unroll 16
      for (int r = 0; r < kJ; ++r) {
        const __m512i kb = _mm512_set1_epi32(int(kr[r * dw + w]));
#pragma GCC unroll 4
        for (int c = 0; c < kQV; ++c) dpwssd(a[r][c], qv[c], kb);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < kJ; ++r) {
      const __m512 kscale = _mm512_set1_ps(ks[j0 + r]);
#pragma GCC unroll 4
      for (int c = 0; c < kQV; ++c)
        _mm512_store_ps(s + (j0 + r) * kBlock + 16 * c,
                        _mm512_mul_ps(_mm512_cvtepi32_ps(a[r][c]), _mm512_mul_ps(qsc[c], kscale)));
    }
    pf.work(pairs * kJ * kQV / 2);
  }
}

// Rows [i, i + rows) of acc (+)= P V over a tile's key pairs, kR <= rows rows of kV vectors of 16 dims (dp = 16 kV):
// int32 sums in registers, added to acc in fp32.
template <int kR, int kV>
BF_TARGET_VNNI __attribute__((noinline)) void accumulate(Int16Scratch& sc, const uint32_t* v2, int64_t i, int rows,
                                                         int64_t key_pairs, bool first) {
  constexpr int dp = 16 * kV;
  __m512i a[kR][kV];
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kV; ++c) a[r][c] = _mm512_setzero_si512();
  for (int64_t p = 0; p < key_pairs; ++p) {
    __m512i vv[kV];
#pragma GCC unroll 4
    for (int c = 0; c < kV; ++c) vv[c] = _mm512_loadu_si512(v2 + p * dp + 16 * c);
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      const __m512i pb = _mm512_set1_epi32(int(sc.pw[p * kBlock + i + r]));
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) dpwssd(a[r][c], pb, vv[c]);
    }
  }
  // Unrolled to kR with a test, not a loop to rows: a runtime index kept the whole tile in memory.
#pragma GCC unroll 8
  for (int r = 0; r < kR; ++r) {
    if (r >= rows) break;
#pragma GCC unroll 4
    for (int c = 0; c < kV; ++c) {
      float* o = sc.acc + (i + r) * dp + 16 * c;
      const __m512 f = _mm512_cvtepi32_ps(a[r][c]);
      _mm512_store_ps(o, first ? f : _mm512_add_ps(_mm512_load_ps(o), f));
    }
  }
}

// K's rows as codes on their own scales (ks), rows past len zero up to a multiple of 16; whether any value is not
// finite (then every output of the item is NaN: the codes do not matter). 16 rows at a time: their largest magnitudes
// transposed into one vector (no horizontal reduction a row).
// kV: vectors of 16 dims a row (dp = 16 kV); dm: their lanes below head_dim.
template <int kV>
BF_TARGET_VNNI bool quantize_keys(Int16Scratch& sc, const float* k, int64_t k_row, int64_t len, const __mmask16* dm) {
  constexpr int64_t dp = 16 * kV, dw = dp / 2;
  const int64_t rows16 = (len + 15) / 16 * 16;
  const __m512 range = _mm512_set1_ps(float(qk_range(dp)));
  sc.k2.resize(rows16 * dw);
  sc.ks.resize(rows16);
  __mmask16 bad = 0;
  for (int64_t j0 = 0; j0 < rows16; j0 += 16) {
    __m512 top[16];
    for (int i = 0; i < 16; ++i) {
      __m512i m = _mm512_setzero_si512();
      if (j0 + i < len)
        for (int c = 0; c < kV; ++c) m = _mm512_max_epu32(m, magnitude(load16(k + (j0 + i) * k_row + 16 * c, dm[c])));
      top[i] = _mm512_castsi512_ps(m);
    }
    transpose16(top);
    __m512i largest = _mm512_castps_si512(top[0]);
    for (int i = 1; i < 16; ++i) largest = _mm512_max_epu32(largest, _mm512_castps_si512(top[i]));
    bad |= not_finite(largest);
    alignas(64) float inv[16];
    const __m512 iv = code_inverse(largest, qk_range(dp));
    _mm512_store_ps(inv, iv);
    _mm512_storeu_ps(sc.ks.data() + j0, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(iv, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                            _mm512_castsi512_ps(largest), range));
    for (int i = 0; i < 16; ++i) {
      const float* row = k + (j0 + i) * k_row;
      const __mmask16 live = j0 + i < len ? 0xffff : 0;
      const __m512 iv_i = _mm512_set1_ps(inv[i]);
      for (int c = 0; c < kV; c += 2) {
        const __m256i lo = _mm512_cvtepi32_epi16(codes(load16(row + 16 * c, dm[c] & live), iv_i));
        const __m256i hi = _mm512_cvtepi32_epi16(codes(load16(row + 16 * c + 16, dm[c + 1] & live), iv_i));
        _mm512_storeu_si512(sc.k2.data() + (j0 + i) * dw + 8 * c,
                            _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
      }
    }
  }
  return bad != 0;
}

// V's columns as codes on their own scales over the item's keys, in pairs of keys (an odd last key paired with zero);
// vscale: each column's scale (NaN for a column with a non-finite value).
template <int kV>
BF_TARGET_VNNI void quantize_values(Int16Scratch& sc, const float* v, int64_t v_row, int64_t len, const __mmask16* dm,
                                    __m512* vscale) {
  constexpr int64_t dp = 16 * kV;
  __m512i largest[kV];
  __m512 inv[kV];
  for (int c = 0; c < kV; ++c) largest[c] = _mm512_setzero_si512();
  for (int64_t j = 0; j < len; ++j)
    for (int c = 0; c < kV; ++c)
      largest[c] = _mm512_max_epu32(largest[c], magnitude(load16(v + j * v_row + 16 * c, dm[c])));
  for (int c = 0; c < kV; ++c) {
    inv[c] = code_inverse(largest[c], kRangeV);
    const __mmask16 coded = _mm512_cmp_ps_mask(inv[c], _mm512_setzero_ps(), _CMP_GT_OQ);
    vscale[c] = _mm512_mask_mov_ps(
        _mm512_maskz_div_ps(coded, _mm512_castsi512_ps(largest[c]), _mm512_set1_ps(float(kRangeV))),
        not_finite(largest[c]), _mm512_set1_ps(NAN));
  }
  const int64_t key_pairs = (len + 1) / 2;
  sc.v2.resize(key_pairs * dp);
  for (int64_t p = 0; p < key_pairs; ++p) {
    const float* v0 = v + 2 * p * v_row;
    const __mmask16 second = 2 * p + 1 < len ? 0xffff : 0;
    for (int c = 0; c < kV; ++c)
      _mm512_storeu_si512(sc.v2.data() + p * dp + 16 * c, words(codes(load16(v0 + 16 * c, dm[c]), inv[c]),
                                                                codes(load16(v0 + v_row + 16 * c, dm[c] & second),
                                                                      inv[c])));
  }
}

// Queries [q0, q0 + qn) (qv vectors) transposed and quantized into qt, each on its own scale: qsc, with scale (in log2
// units), 0 for a query with a non-finite value, which `bad` marks.
template <int kV>
BF_TARGET_VNNI void quantize_queries(Int16Scratch& sc, const float* q, int64_t q_row, int64_t q0, int64_t qn, int qv,
                                     const __mmask16* dm, float scale2, __m512* qsc, __mmask16* bad) {
  constexpr int64_t dp = 16 * kV;
  const int32_t range = qk_range(dp);
  for (int c = 0; c < qv; ++c) {
    __m512i largest = _mm512_setzero_si512();
    for (int e0 = 0; e0 < kV; ++e0) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = load16(q + (q0 + 16 * c + i) * q_row + 16 * e0, 16 * c + i < qn ? dm[e0] : 0);
      transpose16(r);
      for (int e = 0; e < 16; ++e) {
        _mm512_store_ps(sc.qf + (16 * e0 + e) * kBlock + 16 * c, r[e]);
        largest = _mm512_max_epu32(largest, magnitude(r[e]));
      }
    }
    bad[c] = not_finite(largest);
    const __m512 inv = code_inverse(largest, range);
    const __mmask16 coded = _mm512_cmp_ps_mask(inv, _mm512_setzero_ps(), _CMP_GT_OQ);
    qsc[c] = _mm512_maskz_mul_ps(coded, _mm512_castsi512_ps(largest), _mm512_set1_ps(scale2 / float(range)));
    for (int w = 0; w < dp / 2; ++w)
      _mm512_store_si512(sc.qt + w * kBlock + 16 * c, words(codes(_mm512_load_ps(sc.qf + 2 * w * kBlock + 16 * c), inv),
                                                            codes(_mm512_load_ps(sc.qf + (2 * w + 1) * kBlock + 16 * c),
                                                                  inv)));
  }
}

// Work units (~cycles) of an item's steps, for its RowPrefetch's pace (item_by_key's in attention_avx512.cpp): a
// score tile's vpdpwssd (two a cycle), a key's exponential (a vector), a P V block's vpdpwssd.
constexpr int64_t kExpWork = 12;

int64_t work_units(int64_t len, int64_t d) {
  const int64_t dp = (d + 31) / 32 * 32, pairs = (d + 1) / 2, rows = dp == 32 ? 8 : 4;
  int64_t units = 0;
  for (int64_t q0 = 0; q0 < len; q0 += kBlock) {
    const int64_t qn = std::min<int64_t>(kBlock, len - q0), qv = (qn + 15) / 16, kj = kKeysPerTile[qv - 1];
    for (int64_t k0 = 0; k0 < len; k0 += kKBlock) {
      const int64_t kn = std::min<int64_t>(kKBlock, len - k0);
      units += (kn + kj - 1) / kj * pairs * kj * qv / 2 + qv * kn * kExpWork;
      units += (qn + rows - 1) / rows * (kn + 1) / 2 * rows * (dp / 16) / 2;
    }
  }
  return units;
}

// One (sequence, head) item: q, k, v and out at its first row; kV = dp / 16 (2 or 4).
template <int kV>
BF_TARGET_VNNI void item(Int16Scratch& sc, const float* q, const float* k, const float* v, const AttnStrides& st,
                         int64_t len, int64_t d, float scale, float* out, int64_t H, RowPrefetch& pf) {
  constexpr int64_t dp = 16 * kV, dw = dp / 2;
  const int64_t pairs = (d + 1) / 2;
  __mmask16 dm[kV];  // lanes below head_dim of each vector of a row
  for (int c = 0; c < kV; ++c) dm[c] = tail_mask(d - 16 * c);
  pf.pace(work_units(len, d));
  const bool k_bad = quantize_keys<kV>(sc, k, st.k_row, len, dm);
  __m512 vscale[kV];
  quantize_values<kV>(sc, v, st.v_row, len, dm, vscale);
  for (int64_t q0 = 0; q0 < len; q0 += kBlock) {
    const int64_t qn = std::min<int64_t>(kBlock, len - q0);
    const int qv = int((qn + 15) / 16);  // query vectors
    __m512 qsc[4];
    __mmask16 q_bad[4];
    quantize_queries<kV>(sc, q, st.q_row, q0, qn, qv, dm, scale * kLog2e, qsc, q_bad);
    __m512 m[4], l[4];
    for (int c = 0; c < 4; ++c) m[c] = _mm512_set1_ps(-INFINITY), l[c] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < len; k0 += kKBlock) {
      const int64_t kn = std::min<int64_t>(kKBlock, len - k0);
      const bool first = k0 == 0;
      const uint32_t* k2 = sc.k2.data() + k0 * dw;
      const float* ks = sc.ks.data() + k0;
      switch (qv) {
        case 1: scores<1>(sc.qt, k2, ks, kn, pairs, dw, qsc, sc.s, pf); break;
        case 2: scores<2>(sc.qt, k2, ks, kn, pairs, dw, qsc, sc.s, pf); break;
        case 3: scores<3>(sc.qt, k2, ks, kn, pairs, dw, qsc, sc.s, pf); break;
        default: scores<4>(sc.qt, k2, ks, kn, pairs, dw, qsc, sc.s, pf); break;
      }
      // The online softmax over the tile's keys, per vector of queries: P = 2^(s - max) as codes, paired by keys
      // into words as they are computed (an odd last key paired with zero), and summed as codes.
      alignas(64) float alpha[kBlock];
      const __m512 range_p = _mm512_set1_ps(float(kRangeP));
      for (int c = 0; c < qv; ++c) {
        const float* s = sc.s + 16 * c;
        __m512 mx0 = m[c], mx1 = m[c];
        int64_t j = 0;
        for (; j + 2 <= kn; j += 2) {
          mx0 = _mm512_max_ps(mx0, _mm512_load_ps(s + j * kBlock));
          mx1 = _mm512_max_ps(mx1, _mm512_load_ps(s + (j + 1) * kBlock));
        }
        if (j < kn) mx0 = _mm512_max_ps(mx0, _mm512_load_ps(s + j * kBlock));
        const __m512 mx = _mm512_max_ps(mx0, mx1);
        const __m512 a = exp2_512(_mm512_sub_ps(m[c], mx));  // unused on the first tile (l and acc start there)
        __m512i sum = _mm512_setzero_si512();
        for (j = 0; j < kn; j += 2) {
          const __m512i p0 = codes(exp2_512(_mm512_sub_ps(_mm512_load_ps(s + j * kBlock), mx)), range_p);
          const __m512i p1 = j + 1 < kn ? codes(exp2_512(_mm512_sub_ps(_mm512_load_ps(s + (j + 1) * kBlock), mx)),
                                                range_p)
                                        : _mm512_setzero_si512();
          sum = _mm512_add_epi32(sum, _mm512_add_epi32(p0, p1));
          _mm512_store_si512(sc.pw + (j / 2) * kBlock + 16 * c, _mm512_or_si512(p0, _mm512_slli_epi32(p1, 16)));
          pf.work(2 * kExpWork);
        }
        const __m512 tile_sum = _mm512_cvtepi32_ps(sum);
        l[c] = first ? tile_sum : _mm512_add_ps(_mm512_mul_ps(l[c], a), tile_sum);
        m[c] = mx;
        _mm512_store_ps(alpha + 16 * c, a);
      }
      if (!first) rescale_rows(sc.acc, alpha, qn, dp);
      const uint32_t* v2 = sc.v2.data() + (k0 / 2) * dp;
      const int64_t tile_pairs = (kn + 1) / 2;
      constexpr int kRows = 8;  // rows a register block: 16 accumulators for head_dim <= 32, 32 up to 64 (4 rows)
      constexpr int kR = kV == 2 ? kRows : kRows / 2;
      for (int64_t i = 0; i < qn; i += kR) {
        pf.work(tile_pairs * kRows * kV / 2);
        accumulate<kR, kV>(sc, v2, i, int(std::min<int64_t>(kR, qn - i)), tile_pairs, first);
      }
    }
    // 1 / the sum of P's codes, NaN for a query (or every query, for a key) with a non-finite value.
    alignas(64) float inv[kBlock];
    for (int c = 0; c < qv; ++c)
      _mm512_store_ps(inv + 16 * c, _mm512_mask_mov_ps(_mm512_div_ps(_mm512_set1_ps(1.0f), l[c]),
                                                       k_bad ? __mmask16(0xffff) : q_bad[c], _mm512_set1_ps(NAN)));
    for (int64_t i = 0; i < qn; ++i) {
      const __m512 iv = _mm512_set1_ps(inv[i]);
      float* o = out + (q0 + i) * H;
      for (int c = 0; c < kV; ++c)
        store16(o + 16 * c, _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(sc.acc + i * dp + 16 * c), iv), vscale[c]),
                dm[c]);
    }
  }
}

}  // namespace

BF_TARGET_VNNI void attention_avx512int16(const float* q, const float* k, const float* v, const AttnStrides& st,
                                          const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t d,
                                          float scale, float* out, std::atomic<int64_t>* next) {
  DenormalGuard ftz;
  const int64_t H = heads * d;
  // Per thread across calls, reached through a pointer read once (as attention_avx512bf16's).
  static thread_local std::unique_ptr<Int16Scratch> tls;
  if (!tls) tls = std::make_unique<Int16Scratch>();
  Int16Scratch& sc = *tls.get();
  WorkItems items{next, cu_seqlens, batch * heads, heads};
  for_each_item(items, q, k, v, out, st, d, [&](int64_t h, int64_t start, int64_t len, RowPrefetch& pf) {
    const float *qi = q + start * st.q_row + h * st.q_head, *ki = k + start * st.k_row + h * st.k_head;
    const float* vi = v + start * st.v_row + h * st.v_head;
    float* oi = out + start * H + h * d;
    if (d <= 32)
      item<2>(sc, qi, ki, vi, st, len, d, scale, oi, H, pf);
    else
      item<4>(sc, qi, ki, vi, st, len, d, scale, oi, H, pf);
  });
}

}  // namespace attention_detail
}  // namespace cpu
}  // namespace bertfast
#endif
