// The streaming regime of the GEMM on the Avx2 tier (every M there): linear_stream.cpp's schedule on 16 ymm
// registers.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "cpu/gemm/linear_impl.h"

namespace bertfast {
namespace cpu {
namespace linear_detail {

#if BF_X86
namespace {

// ---- AVX2 + FMA (Avx2 tier): the streaming schedule above on 16 ymm registers ----
//
// The schedule of linear_stream_avx512 at every M: a panel in blocks of kBlockSteps<T> k steps (fp32) or k pairs
// (bf16), read from memory by the first pass and from L1 by the others, with the same far and near
// prefetch, and fp32 accumulators of the whole panel kept between blocks. A pass of rows covers the panel's
// 48 columns in register tiles of at most 12 accumulators (pass_avx2_rows has the shapes). AVX2 has no
// embedded broadcast, so x is packed already widened to fp32 (pack_x_f32) and each row's value is one
// broadcast load; bf16 weights are widened in registers (widen_pairs), so bf16 streams half the bytes.
// No AVX2 sibling of linear_blocked_f32: up to the 256 fp32 rows the cpu backend runs here on this tier,
// x stays in L2 and a weight block in L1 with this schedule too, and MKL takes larger M.
template <typename T>
void pack_x_f32(const T* x, int64_t ldx, int64_t M, int64_t K, float* xp) {
  if constexpr (sizeof(T) == 4) {
    pack_x<float>(x, ldx, M, K, xp);
  } else {
    const int64_t S = kXRow<T>;
    for (int64_t k0 = 0; k0 < K; k0 += S) {
      const int64_t n = std::min<int64_t>(S, K - k0);
      for (int64_t m = 0; m < M; ++m, xp += S) {
        const T* src = x + m * ldx + k0;
        for (int64_t j = 0; j < n; ++j) xp[j] = to_float(src[j]);
        std::fill(xp + n, xp + S, 0.f);
      }
    }
  }
}

// An empty asm that claims to change v: GCC then keeps a weight vector in a register instead of folding
// its load into every FMA that uses it (which doubled the loads of a k step).
BF_TARGET_AVX2 BF_INLINE void in_register(__m256& v) { __asm__("" : "+x"(v)); }

// 8 bf16 k pairs (8 columns) as fp32: the even elements shifted up, the odd ones already in the high
// halves, whose low halves are cleared by blending in the shifted vector's zeros (no mask register: the
// 5-row tile uses all 16).
BF_TARGET_AVX2 BF_INLINE void widen_pairs(const bf16* w, __m256& even, __m256& odd) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i lo = _mm256_slli_epi32(wv, 16);
  even = _mm256_castsi256_ps(lo);
  odd = _mm256_castsi256_ps(_mm256_blend_epi16(wv, lo, 0x55));
}

// MR rows x 8 * NV columns of one block: x packed (row r at x + r * kXRow<T>, fp32), w from the block's
// first step at the tile's first column; onto the fp32 tile (rows kPanel apart) unless `first`.
// With NV < MR a k step's weights stay in registers and each row's x is broadcast once and used for all
// NV vectors; otherwise a weight vector is used for all MR rows, whose broadcasts stay in registers.
template <int MR, int NV, typename T>
BF_TARGET_AVX2 BF_INLINE void tile_avx2(const float* x, const T* w, int64_t steps, float* tile, bool first,
                                        FarPrefetch pf, bool near) {
  constexpr int64_t S = kXRow<T>;
  constexpr bool kRowsOuter = NV < MR;
  __m256 c[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) c[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(tile + r * kPanel + 8 * v);
  for (int64_t k = 0; k < steps; ++k, w += kStepBytes / sizeof(T)) {
    if (near) near_prefetch(w);
    pf.step();
    if constexpr (sizeof(T) == 2) {
      if constexpr (kRowsOuter) {
        __m256 even[NV], odd[NV];
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) widen_pairs(w + 16 * v, even[v], odd[v]);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m256 a0 = _mm256_broadcast_ss(x + r * S + 2 * k), a1 = _mm256_broadcast_ss(x + r * S + 2 * k + 1);
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) c[r][v] = _mm256_fmadd_ps(a1, odd[v], _mm256_fmadd_ps(a0, even[v], c[r][v]));
        }
      } else {
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) {
          __m256 even, odd;
          widen_pairs(w + 16 * v, even, odd);
#pragma GCC unroll 8
          for (int r = 0; r < MR; ++r) {
            const float* xr = x + r * S + 2 * k;
            c[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), odd,
                                      _mm256_fmadd_ps(_mm256_broadcast_ss(xr), even, c[r][v]));
          }
        }
      }
    } else if constexpr (kRowsOuter) {
      __m256 wv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        wv[v] = _mm256_loadu_ps(w + 8 * v);
        in_register(wv[v]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * S + k);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) c[r][v] = _mm256_fmadd_ps(a, wv[v], c[r][v]);
      }
    } else {
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        __m256 wv = _mm256_loadu_ps(w + 8 * v);
        in_register(wv);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) c[r][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * S + k), wv, c[r][v]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(tile + r * kPanel + 8 * v, c[r][v]);
}

// One pass of MR rows over the panel's 48 columns in 48 / (8 * NV) tiles, each with its share of the
// pass's far prefetch; the near one (pass 0) goes with the first tile, the first to read the block.
template <int MR, int NV, typename T>
BF_TARGET_AVX2 BF_INLINE void pass_avx2(const float* x, const T* w, int64_t steps, float* tile, bool first,
                                        const FarPrefetch& pf, bool near) {
  constexpr int kGroups = int(kPanel / (8 * NV));
  static_assert(kGroups * 8 * NV == kPanel, "a pass's tiles must cover the panel");
  constexpr int64_t kGroupElems = kStepBytes / sizeof(T) / kGroups;  // a tile's columns of one k step
#pragma GCC unroll 6
  for (int g = 0; g < kGroups; ++g) {
    const int64_t l0 = pf.lines * g / kGroups, l1 = pf.lines * (g + 1) / kGroups;
    const FarPrefetch share{pf.here, pf.next, pf.panel_bytes, pf.offset + l0 * 64, l1 - l0, pf.steps, 0};
    tile_avx2<MR, NV, T>(x, w + g * kGroupElems, steps, tile + g * 8 * NV, first, share, near && g == 0);
  }
}

// The tile shape of a pass of `mr` rows: fp32 2 x 48 keeps the weights in registers; bf16 needs 2 widened vectors
// per weight vector, so 5 x 16 (weights in registers, 10 accumulators) where 2 x 48's accumulators spill.
// Passes of few rows keep enough accumulators in flight (1 x 48, 2 x 24) to stay off the FMA latency.
constexpr int kAvx2RowsF32 = 2;
constexpr int kAvx2RowsBf16 = 5;

template <typename T>
BF_TARGET_AVX2 void pass_avx2_rows(int mr, const float* x, const T* w, int64_t steps, float* tile, bool first,
                                   const FarPrefetch& pf, bool near) {
  if constexpr (sizeof(T) == 4) {
    if (mr == 1)
      pass_avx2<1, 6, T>(x, w, steps, tile, first, pf, near);
    else
      pass_avx2<2, 6, T>(x, w, steps, tile, first, pf, near);
  } else {
    switch (mr) {
      case 1: pass_avx2<1, 6, T>(x, w, steps, tile, first, pf, near); break;
      case 2: pass_avx2<2, 3, T>(x, w, steps, tile, first, pf, near); break;
      case 3: pass_avx2<3, 2, T>(x, w, steps, tile, first, pf, near); break;
      case 4: pass_avx2<4, 2, T>(x, w, steps, tile, first, pf, near); break;
      default: pass_avx2<5, 2, T>(x, w, steps, tile, first, pf, near); break;
    }
  }
}

template <typename T>
struct Avx2Pass {
  BF_TARGET_AVX2 void operator()(const float* x, const T* w, int64_t steps, int mr, float* tile, bool first,
                                 const FarPrefetch& pf, bool near) const {
    pass_avx2_rows<T>(mr, x, w, steps, tile, first, pf, near);
  }
  void store(const float* tile, int mr, int64_t m0, int64_t n0, int64_t nvalid, const Epilogue& ep) const {
    store_tile<T, false, true>(tile, mr, m0, n0, nvalid, ep);
  }
};

}  // namespace

template <typename T>
BF_TARGET_AVX2 void linear_stream_avx2(const T* x, int64_t ldx, const T* packed, int64_t M, int64_t N, int64_t K,
                                       const Epilogue& ep, MeetInTheMiddle::Walker& panels) {
  DenormalGuard ftz;
  // Per thread, reused across calls: the packed x (fp32) and the fp32 accumulators of a panel.
  thread_local std::vector<float> xp, acc;
  xp.resize(stream_blocks<T>(K) * M * kXRow<T>);
  pack_x_f32(x, ldx, M, K, xp.data());
  acc.resize(M * kPanel);
  stream_panels(xp.data(), packed, M, N, K, sizeof(T) == 4 ? kAvx2RowsF32 : kAvx2RowsBf16, ep, panels, acc.data(),
                Avx2Pass<T>{});
}

template BF_TARGET_AVX2 void linear_stream_avx2<float>(const float*, int64_t, const float*, int64_t, int64_t, int64_t,
                                                       const Epilogue&, MeetInTheMiddle::Walker&);
template BF_TARGET_AVX2 void linear_stream_avx2<bf16>(const bf16*, int64_t, const bf16*, int64_t, int64_t, int64_t,
                                                      const Epilogue&, MeetInTheMiddle::Walker&);
#endif

}  // namespace linear_detail
}  // namespace cpu
}  // namespace bertfast
