// The streaming regime of the GEMM (few rows: bound by reading the weights once), portable and AVX-512 tiles
// (the AVX2 ones: linear_stream_avx2.cpp). Threads share the panels out (MeetInTheMiddle, parallel.h); each
// claimed panel is computed for all M rows and goes through the epilogue.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "cpu/gemm/linear_impl.h"

namespace bertfast {
namespace cpu {
namespace linear_detail {
namespace {

// ---- portable tiles: plain loops over the panel's columns (the compiler vectorizes them) ----

BF_INLINE void tile_generic(const float* x, int64_t ldx, const float* wp, int64_t K, int mr, float* tile) {
  std::fill(tile, tile + mr * kPanel, 0.f);
  for (int64_t k = 0; k < K; ++k) {
    const float* w = wp + k * kPanel;
    for (int r = 0; r < mr; ++r) {
      const float a = x[r * ldx + k];
      float* c = tile + r * kPanel;
#pragma omp simd
      for (int j = 0; j < kPanel; ++j) c[j] += a * w[j];
    }
  }
}

BF_INLINE void tile_generic(const bf16* x, int64_t ldx, const bf16* wp, int64_t K, int mr, float* tile) {
  std::fill(tile, tile + mr * kPanel, 0.f);
  const int64_t K2 = (K + 1) / 2;
  for (int64_t kk = 0; kk < K2; ++kk) {
    const bf16* w = wp + kk * kPanel * 2;
    float w0[kPanel], w1[kPanel];
#pragma omp simd
    for (int j = 0; j < kPanel; ++j) {
      w0[j] = to_float(w[2 * j]);
      w1[j] = to_float(w[2 * j + 1]);
    }
    for (int r = 0; r < mr; ++r) {
      const float a0 = to_float(x[r * ldx + 2 * kk]);
      const float a1 = 2 * kk + 1 < K ? to_float(x[r * ldx + 2 * kk + 1]) : 0.f;
      float* c = tile + r * kPanel;
#pragma omp simd
      for (int j = 0; j < kPanel; ++j) c[j] += a0 * w0[j] + a1 * w1[j];
    }
  }
}

}  // namespace

template <typename T>
void linear_stream_generic(const T* x, int64_t ldx, const T* packed, int64_t M, int64_t N, int64_t K,
                           const Epilogue& ep, MeetInTheMiddle::Walker& panels) {
  DenormalGuard ftz;
  const int64_t panel_elems = (sizeof(T) == 2 ? 2 * ((K + 1) / 2) : K) * kPanel;
  alignas(64) float tile[kMaxRows * kPanel];
  for (int64_t p = panels.claim(); p >= 0; p = panels.claim()) {
    const int64_t nvalid = std::min<int64_t>(kPanel, N - p * kPanel);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int mr = int(std::min<int64_t>(kMaxRows, M - m0));
      tile_generic(x + m0 * ldx, ldx, packed + p * panel_elems, K, mr, tile);
      store_tile<T>(tile, mr, m0, p * kPanel, nvalid, ep);
    }
  }
}

template void linear_stream_generic<float>(const float*, int64_t, const float*, int64_t, int64_t, int64_t,
                                           const Epilogue&, MeetInTheMiddle::Walker&);
template void linear_stream_generic<bf16>(const bf16*, int64_t, const bf16*, int64_t, int64_t, int64_t,
                                          const Epilogue&, MeetInTheMiddle::Walker&);

#if BF_X86
namespace {


// MR rows x 48 columns in 3 x MR zmm accumulators (MR <= 8: 24 accumulators): `steps` k steps of one
// block, x packed (row r at x + r * kXRow), w from the block's first step; summed from zero, then added
// onto the fp32 tile [MR][kPanel] unless `first` (the order of tile_blocked).
template <int MR>
BF_TARGET_AVX512 BF_INLINE void tile_avx512_f32(const float* x, const float* w, int64_t steps, float* tile, bool first,
                                                FarPrefetch pf, bool near) {
  constexpr int64_t S = kXRow<float>;
  __m512 c[MR][3];
  load_acc<MR>(c, tile, true);
  for (int64_t k = 0; k < steps; ++k, w += kPanel) {
    if (near) near_prefetch(w);
    pf.step();
    fma_step<MR>(c, w, [&](int r) { return x[r * S + k]; });
  }
  if (!first) add_earlier<MR>(c, tile);
  store_acc<MR>(c, tile);
}

// The same for bf16, a k pair per step. Row r's pair (even element in the low half) is broadcast
// straight from memory, a load-port uop; a broadcast from a general register would take port 5, which
// the dot products need. Without AVX-512 BF16 (kDot false) a 32-bit lane holding a pair becomes two fp32
// values: shifted left by 16 (the even element) and masked to its high half (the odd one).
// (bf16 x is always packed: the zero pad makes an odd K's last pair whole.)
template <int MR, bool kDot>
BF_TARGET_AVX512BF16 BF_INLINE void tile_avx512_bf16(const bf16* x, const bf16* w, int64_t steps, float* tile,
                                                     bool first, FarPrefetch pf, bool near) {
  constexpr int64_t S = kXRow<bf16>;
  __m512 c[MR][3];
  load_acc<MR>(c, tile, first);
  const __m512i hi_mask = _mm512_set1_epi32(int(0xffff0000u));
  for (int64_t kk = 0; kk < steps; ++kk, w += kPanel * 2) {
    if (near) near_prefetch(w);
    pf.step();
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 32), w2 = _mm512_loadu_si512(w + 64);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512i a = _mm512_broadcastd_epi32(_mm_loadu_si32(x + r * S + 2 * kk));
      if constexpr (kDot) {
        c[r][0] = _mm512_dpbf16_ps(c[r][0], (__m512bh)a, (__m512bh)w0);
        c[r][1] = _mm512_dpbf16_ps(c[r][1], (__m512bh)a, (__m512bh)w1);
        c[r][2] = _mm512_dpbf16_ps(c[r][2], (__m512bh)a, (__m512bh)w2);
      } else {
        const __m512 a0 = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
        const __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(a, hi_mask));
        const __m512i ws[3] = {w0, w1, w2};
#pragma GCC unroll 3
        for (int v = 0; v < 3; ++v) {
          const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(ws[v], 16));
          const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(ws[v], hi_mask));
          c[r][v] = _mm512_fmadd_ps(a1, odd, _mm512_fmadd_ps(a0, even, c[r][v]));
        }
      }
    }
  }
  store_acc<MR>(c, tile);
}

template <int MR>
BF_TARGET_AVX512BF16 BF_INLINE void tile_avx512(const float* x, const float* w, int64_t steps, float* tile, bool first,
                                                bool, const FarPrefetch& pf, bool near) {
  tile_avx512_f32<MR>(x, w, steps, tile, first, pf, near);
}
template <int MR>
BF_TARGET_AVX512BF16 BF_INLINE void tile_avx512(const bf16* x, const bf16* w, int64_t steps, float* tile, bool first,
                                                bool dot, const FarPrefetch& pf, bool near) {
  if (dot)
    tile_avx512_bf16<MR, true>(x, w, steps, tile, first, pf, near);
  else
    tile_avx512_bf16<MR, false>(x, w, steps, tile, first, pf, near);
}

template <typename T>
BF_TARGET_AVX512BF16 BF_INLINE void tile_avx512_rows(const T* x, const T* w, int64_t steps, int mr, float* tile,
                                                     bool first, bool dot, const FarPrefetch& pf, bool near) {
  switch (mr) {
    case 1: tile_avx512<1>(x, w, steps, tile, first, dot, pf, near); break;
    case 2: tile_avx512<2>(x, w, steps, tile, first, dot, pf, near); break;
    case 3: tile_avx512<3>(x, w, steps, tile, first, dot, pf, near); break;
    case 4: tile_avx512<4>(x, w, steps, tile, first, dot, pf, near); break;
    case 5: tile_avx512<5>(x, w, steps, tile, first, dot, pf, near); break;
    case 6: tile_avx512<6>(x, w, steps, tile, first, dot, pf, near); break;
    case 7: tile_avx512<7>(x, w, steps, tile, first, dot, pf, near); break;
    default: tile_avx512<8>(x, w, steps, tile, first, dot, pf, near); break;
  }
}

template <typename T>
struct Avx512Pass {
  bool dot;
  BF_TARGET_AVX512BF16 void operator()(const T* x, const T* w, int64_t steps, int mr, float* tile, bool first,
                                       const FarPrefetch& pf, bool near) const {
    tile_avx512_rows<T>(x, w, steps, mr, tile, first, dot, pf, near);
  }
  void store(const float* tile, int mr, int64_t m0, int64_t n0, int64_t nvalid, const Epilogue& ep) const;
};

// The streaming regime's epilogue: fp32 through the blocked regime's (the same vector activation), bf16
// and the activations without a 16-lane form through store_tile.
template <typename T>
BF_TARGET_AVX512BF16 void Avx512Pass<T>::store(const float* tile, int mr, int64_t m0, int64_t n0, int64_t nvalid,
                                              const Epilogue& ep) const {
  if constexpr (sizeof(T) == 4) {
    if (ep.act == Activation::None || ep.act == Activation::Gelu || ep.act == Activation::Relu) {
      alignas(64) float terms[kMaxRows][64];
      const float* term[kMaxRows] = {};
      if (ep.lora != nullptr)  // the tile's terms at once: its rows share each B^T load
        lora_terms_rows(*ep.lora, m0, mr, n0, nvalid, terms, term);
      for (int r = 0; r < mr; ++r) {
        __m512 acc[1][3];
        load_acc<1>(acc, tile + r * kPanel, false);
        const TileOut to{nullptr, &ep, m0 + r, n0, nvalid, ep.lora != nullptr ? term + r : nullptr};
        if (ep.act == Activation::Gelu)
          finish_tile<1, Activation::Gelu>(acc, to);
        else if (ep.act == Activation::Relu)
          finish_tile<1, Activation::Relu>(acc, to);
        else
          finish_tile<1, Activation::None>(acc, to);
      }
      return;
    }
  }
  store_tile<T, true>(tile, mr, m0, n0, nvalid, ep);
}

}  // namespace

// The whole AVX-512 path is compiled with the BF16 target so one function holds both variants; the
// dot-product one runs only when the CPU has AVX-512 BF16 (`dot`).
template <typename T>
BF_TARGET_AVX512BF16 void linear_stream_avx512(const T* x, int64_t ldx, const T* packed, int64_t M, int64_t N,
                                               int64_t K, const Epilogue& ep, MeetInTheMiddle::Walker& panels) {
  DenormalGuard ftz;
  // Per thread, reused across calls: the packed x and the fp32 accumulators of a panel.
  thread_local std::vector<T> xp;
  thread_local std::vector<float> acc;
  xp.resize(stream_blocks<T>(K) * M * kXRow<T>);
  pack_x(x, ldx, M, K, xp.data());
  acc.resize(M * kPanel);
  stream_panels(xp.data(), packed, M, N, K, kMaxRows, ep, panels, acc.data(), Avx512Pass<T>{has_avx512_bf16()});
}

template BF_TARGET_AVX512BF16 void linear_stream_avx512<float>(const float*, int64_t, const float*, int64_t, int64_t,
                                                               int64_t, const Epilogue&, MeetInTheMiddle::Walker&);
template BF_TARGET_AVX512BF16 void linear_stream_avx512<bf16>(const bf16*, int64_t, const bf16*, int64_t, int64_t,
                                                              int64_t, const Epilogue&, MeetInTheMiddle::Walker&);
#endif

}  // namespace linear_detail
}  // namespace cpu
}  // namespace bertfast
