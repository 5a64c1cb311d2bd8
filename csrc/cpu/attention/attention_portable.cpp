// The portable tier of the attention (attention.cpp): attention_thread on GenericBlock, plain loops and GCC
// vector extensions that the build's baseline ISA runs (SSE2 on x86-64, NEON on aarch64).
#include <cstring>

#include "cpu/attention/attention_impl.h"

namespace bertfast {
namespace cpu {
namespace attention_detail {
namespace {

// ---- portable block: plain loops the compiler vectorizes ----
struct GenericBlock {
  static constexpr bool kByKey = false;  // every item scored by query row (attention_thread)
  static constexpr int64_t kQueryRows = kQBlock;

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

}  // namespace

BF_ATTENTION_TIER(attention_generic, , GenericBlock)

}  // namespace attention_detail
}  // namespace cpu
}  // namespace bertfast
