// Small-M GEMM streaming prepacked weights: out = act(x w^T + bias) + residual for a few rows of x.
//
// At small M (a handful of tokens) a linear layer is bound by reading its weights once from memory; the
// packed layout makes that read one sequential stream per panel of kPanel output columns, so the
// hardware prefetchers run at full speed, and each weight cache line is used by every row of x while
// it is in L1 (with up to 8 rows per sweep; more rows sweep again from L2). fp32 weights: [panels][K][kPanel]. bf16 weights: [panels][ceil(K/2)][kPanel][2], pairs
// along K as AVX-512 BF16 dot products (vdpbf16ps) want them. Accumulation is fp32; bias, activation and
// residual are applied to the fp32 accumulator and the result is rounded once.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"
#include "parallel.h"

#if BF_X86
#include <immintrin.h>
#endif

namespace bertfast {
namespace cpu {

int64_t packed_numel(int64_t n, int64_t k, bool is_bf16) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t kk = is_bf16 ? 2 * ((k + 1) / 2) : k;
  return panels * kk * kPanel;
}

template <typename T>
void pack_linear(const T* w, int64_t n, int64_t k, T* packed) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  constexpr bool kPairs = sizeof(T) == 2;
  const int64_t kk = kPairs ? 2 * ((k + 1) / 2) : k;
  std::memset(static_cast<void*>(packed), 0, sizeof(T) * panels * kk * kPanel);
  for (int64_t p = 0; p < panels; ++p) {
    T* dst = packed + p * kk * kPanel;
    for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) {
      const T* row = w + (p * kPanel + c) * k;
      for (int64_t j = 0; j < k; ++j) {
        if (kPairs)
          dst[((j / 2) * kPanel + c) * 2 + (j & 1)] = row[j];
        else
          dst[j * kPanel + c] = row[j];
      }
    }
  }
}
template void pack_linear<float>(const float*, int64_t, int64_t, float*);
template void pack_linear<bf16>(const bf16*, int64_t, int64_t, bf16*);

namespace {

constexpr int kMaxRows = 8;  // rows of x per register tile (8 rows x 3 zmm = 24 accumulators)

struct Epilogue {
  const void* bias;
  const void* residual;
  int64_t ldr;
  Act act;
  void* out;
  int64_t ldo;
};

// Writes rows [m0, m0 + mr) x columns [n0, n0 + nvalid) of the output from an fp32 tile [mr][kPanel].
template <typename T>
BF_INLINE void store_tile(const float* tile, int mr, int64_t m0, int64_t n0, int64_t nvalid, const Epilogue& ep) {
  const T* bias = static_cast<const T*>(ep.bias);
  const T* res = static_cast<const T*>(ep.residual);
  T* out = static_cast<T*>(ep.out);
  for (int r = 0; r < mr; ++r) {
    const float* c = tile + r * kPanel;
    T* o = out + (m0 + r) * ep.ldo + n0;
    const T* rr = res != nullptr ? res + (m0 + r) * ep.ldr + n0 : nullptr;
    float tmp[kPanel];
#pragma omp simd
    for (int64_t j = 0; j < nvalid; ++j) tmp[j] = c[j] + (bias != nullptr ? to_float(bias[n0 + j]) : 0.f);
    switch (ep.act) {
      case Act::Gelu:
#pragma omp simd
        for (int64_t j = 0; j < nvalid; ++j) tmp[j] = gelu_erf(tmp[j]);
        break;
      case Act::GeluTanh:
#pragma omp simd
        for (int64_t j = 0; j < nvalid; ++j) tmp[j] = gelu_tanh(tmp[j]);
        break;
      case Act::Relu:
#pragma omp simd
        for (int64_t j = 0; j < nvalid; ++j) tmp[j] = tmp[j] > 0.f ? tmp[j] : 0.f;
        break;
      case Act::Tanh:
#pragma omp simd
        for (int64_t j = 0; j < nvalid; ++j) tmp[j] = tanh_f(tmp[j]);
        break;
      default:
        break;
    }
    if (rr != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < nvalid; ++j) o[j] = from_float<T>(tmp[j] + to_float(rr[j]));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < nvalid; ++j) o[j] = from_float<T>(tmp[j]);
    }
  }
}

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

template <typename T>
void linear_generic(const T* x, int64_t ldx, const T* packed, int64_t M, int64_t N, int64_t K, const Epilogue& ep,
                    int part, int parts) {
  DenormalGuard ftz;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t panel_elems = (sizeof(T) == 2 ? 2 * ((K + 1) / 2) : K) * kPanel;
  int64_t lo, hi;
  split_range(panels, part, parts, &lo, &hi);
  alignas(64) float tile[kMaxRows * kPanel];
  for (int64_t p = lo; p < hi; ++p) {
    const int64_t nvalid = std::min<int64_t>(kPanel, N - p * kPanel);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int mr = int(std::min<int64_t>(kMaxRows, M - m0));
      tile_generic(x + m0 * ldx, ldx, packed + p * panel_elems, K, mr, tile);
      store_tile<T>(tile, mr, m0, p * kPanel, nvalid, ep);
    }
  }
}

#if BF_X86
// ---- AVX-512 tiles: MR rows x 48 columns in 3 x MR zmm accumulators ----

// How far ahead (bytes) to prefetch the weight stream: the L2 streamer alone leaves bandwidth unused.
constexpr int64_t kPrefetchBytes = 2048;
// K elements per chunk of a sweep: 8 rows of x over a chunk (32 KB fp32) stay in L1.
constexpr int64_t kKChunk = 1024;

// With more rows than one register tile, a unit (a panel, or a K chunk of it) is swept once per tile:
// the first sweep streams it from memory, the others re-read it from L2 and would leave the memory
// idle. So every sweep also pulls its share (1/passes) of the *next* unit into L2, and the stream never
// stops. (Measured on Sapphire Rapids at M=16, 2 threads, with huge pages: ~17 GB/s; one 16-row sweep
// of 16-column panels is load-port bound, ~13 GB/s; small (12 KB) K chunks swept back to back, ~12 GB/s.)
struct Prefetch {
  const char* base;  // where this sweep's share of the next panel starts (null: no next panel)
  int64_t stride;    // bytes of it per k step
  BF_TARGET_AVX512 BF_INLINE void at(int64_t k) const {
    if (base == nullptr) return;
    const char* p = base + k * stride;
    _mm_prefetch(p, _MM_HINT_T1);
    _mm_prefetch(p + 64, _MM_HINT_T1);
    if (stride > 128) _mm_prefetch(p + 128, _MM_HINT_T1);
  }
  static Prefetch make(const char* next, int64_t steps, int64_t step_bytes, int64_t pass, int64_t passes) {
    if (next == nullptr) return {nullptr, 0};
    const int64_t stride = step_bytes / passes;
    return {next + pass * steps * stride, stride};
  }
};

// MR rows x 48 columns in 3 x MR zmm accumulators (MR <= 8: 24 accumulators).
// k steps [k0, k1) into the fp32 tile [MR][kPanel] (accumulated onto it unless k0 == 0).
template <int MR>
BF_TARGET_AVX512 BF_INLINE void tile_avx512_f32(const float* x, int64_t ldx, const float* wp, int64_t k0, int64_t k1,
                                                float* tile, const Prefetch& pf) {
  __m512 c[MR][3];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 3; ++v) c[r][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(tile + r * kPanel + 16 * v);
  for (int64_t k = k0; k < k1; ++k) {
    const float* w = wp + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 128, _MM_HINT_T0);
    pf.at(k - k0);
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      c[r][0] = _mm512_fmadd_ps(a, w0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(a, w1, c[r][1]);
      c[r][2] = _mm512_fmadd_ps(a, w2, c[r][2]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(tile + r * kPanel, c[r][0]);
    _mm512_storeu_ps(tile + r * kPanel + 16, c[r][1]);
    _mm512_storeu_ps(tile + r * kPanel + 32, c[r][2]);
  }
}

// One k pair of a bf16 panel against MR rows. Row r's pair (even element in the low half) is broadcast
// straight from memory, a load-port uop; a broadcast from a general register would take port 5, which
// the dot products need. Without AVX-512 BF16 (kDot false) a 32-bit lane holding a pair becomes two fp32
// values: shifted left by 16 (the even element) and masked to its high half (the odd one).
template <int MR, bool kDot, bool kTail>
BF_TARGET_AVX512BF16 BF_INLINE void bf16_step(const bf16* x, int64_t ldx, const bf16* wp, int64_t kk,
                                              __m512 (&c)[MR][3], const Prefetch& pf) {
  const bf16* w = wp + kk * kPanel * 2;
  _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 64, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 128, _MM_HINT_T0);
  pf.at(kk);  // kk counts from the chunk start here (see tile_avx512_bf16)
  const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 32), w2 = _mm512_loadu_si512(w + 64);
  const __m512i hi_mask = _mm512_set1_epi32(int(0xffff0000u));
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const bf16* xr = x + r * ldx + 2 * kk;
    // An odd K's last pair has no odd element: it is zero (the packed weight is zero there too).
    const __m512i a = kTail ? _mm512_set1_epi32(int(xr[0].bits)) : _mm512_broadcastd_epi32(_mm_loadu_si32(xr));
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

// k pairs [k0, k1) of a K-long row; the pair K / 2 of an odd K is the half tail pair.
template <int MR, bool kDot>
BF_TARGET_AVX512BF16 BF_INLINE void tile_avx512_bf16(const bf16* x, int64_t ldx, const bf16* wp, int64_t K,
                                                     int64_t k0, int64_t k1, float* tile, const Prefetch& pf) {
  __m512 c[MR][3];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 3; ++v) c[r][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(tile + r * kPanel + 16 * v);
  const int64_t full_end = std::min<int64_t>(k1, K / 2);
  // wp and pf are offset so that step kk - k0 of this chunk is at wp + kk pairs (see bf16_step).
  const Prefetch local{pf.base == nullptr ? nullptr : pf.base - k0 * pf.stride, pf.stride};
  for (int64_t kk = k0; kk < full_end; ++kk) bf16_step<MR, kDot, false>(x, ldx, wp, kk, c, local);
  if (k1 > full_end) bf16_step<MR, kDot, true>(x, ldx, wp, full_end, c, local);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(tile + r * kPanel, c[r][0]);
    _mm512_storeu_ps(tile + r * kPanel + 16, c[r][1]);
    _mm512_storeu_ps(tile + r * kPanel + 32, c[r][2]);
  }
}

template <int MR>
BF_TARGET_AVX512BF16 BF_INLINE void tile_avx512(const float* x, int64_t ldx, const float* wp, int64_t, int64_t k0,
                                                int64_t k1, float* tile, bool, const Prefetch& pf) {
  tile_avx512_f32<MR>(x, ldx, wp, k0, k1, tile, pf);
}
template <int MR>
BF_TARGET_AVX512BF16 BF_INLINE void tile_avx512(const bf16* x, int64_t ldx, const bf16* wp, int64_t K, int64_t k0,
                                                int64_t k1, float* tile, bool dot, const Prefetch& pf) {
  if (dot)
    tile_avx512_bf16<MR, true>(x, ldx, wp, K, k0, k1, tile, pf);
  else
    tile_avx512_bf16<MR, false>(x, ldx, wp, K, k0, k1, tile, pf);
}

template <typename T>
BF_TARGET_AVX512BF16 BF_INLINE void tile_avx512_rows(const T* x, int64_t ldx, const T* wp, int64_t K, int64_t k0,
                                                     int64_t k1, int mr, float* tile, bool dot, const Prefetch& pf) {
  switch (mr) {
    case 1: tile_avx512<1>(x, ldx, wp, K, k0, k1, tile, dot, pf); break;
    case 2: tile_avx512<2>(x, ldx, wp, K, k0, k1, tile, dot, pf); break;
    case 3: tile_avx512<3>(x, ldx, wp, K, k0, k1, tile, dot, pf); break;
    case 4: tile_avx512<4>(x, ldx, wp, K, k0, k1, tile, dot, pf); break;
    case 5: tile_avx512<5>(x, ldx, wp, K, k0, k1, tile, dot, pf); break;
    case 6: tile_avx512<6>(x, ldx, wp, K, k0, k1, tile, dot, pf); break;
    case 7: tile_avx512<7>(x, ldx, wp, K, k0, k1, tile, dot, pf); break;
    default: tile_avx512<8>(x, ldx, wp, K, k0, k1, tile, dot, pf); break;
  }
}

// The whole AVX-512 path is compiled with the BF16 target so one function holds both variants; the
// dot-product one runs only when the CPU has AVX-512 BF16 (`dot`).
template <typename T>
BF_TARGET_AVX512BF16 void linear_avx512(const T* x, int64_t ldx, const T* packed, int64_t M, int64_t N, int64_t K,
                                        const Epilogue& ep, int part, int parts) {
  const bool dot = has_avx512_bf16();
  DenormalGuard ftz;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  constexpr bool kPairs = sizeof(T) == 2;
  const int64_t steps = kPairs ? (K + 1) / 2 : K;  // k steps (bf16: k pairs) per sweep
  const int64_t panel_elems = (kPairs ? 2 * steps : K) * kPanel;
  int64_t lo, hi;
  split_range(panels, part, parts, &lo, &hi);
  const int64_t passes = (M + kMaxRows - 1) / kMaxRows;
  std::vector<float> acc(passes * kMaxRows * kPanel);
  // A panel is processed in K chunks so the rows of x a sweep reads (8 x kKChunk) stay in L1; the
  // unit of streaming is one chunk of one panel, and units are contiguous in memory.
  const int64_t chunk = kKChunk / (kPairs ? 2 : 1);  // in k steps
  for (int64_t p = lo; p < hi; ++p) {
    const T* wp = packed + p * panel_elems;
    for (int64_t k0 = 0; k0 < steps; k0 += chunk) {
      const int64_t k1 = std::min<int64_t>(steps, k0 + chunk);
      // The next unit: this panel's next chunk, else the next panel's first.
      const char* next = k1 < steps ? reinterpret_cast<const char*>(wp + k1 * kPanel * (kPairs ? 2 : 1))
                         : p + 1 < hi ? reinterpret_cast<const char*>(packed + (p + 1) * panel_elems)
                                      : nullptr;
      const int64_t next_steps = k1 < steps ? std::min<int64_t>(steps, k1 + chunk) - k1 : std::min(steps, chunk);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int mr = int(std::min<int64_t>(kMaxRows, M - m0));
        // One k step (fp32) or k pair (bf16) of a panel is kPanel * 4 bytes either way.
        const Prefetch pf = Prefetch::make(next, std::min(next_steps, k1 - k0), kPanel * 4, m0 / kMaxRows, passes);
        tile_avx512_rows<T>(x + m0 * ldx, ldx, wp, K, k0, k1, mr, acc.data() + m0 * kPanel, dot, pf);
      }
    }
    const int64_t nvalid = std::min<int64_t>(kPanel, N - p * kPanel);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
      store_tile<T>(acc.data() + m0 * kPanel, int(std::min<int64_t>(kMaxRows, M - m0)), m0, p * kPanel, nvalid, ep);
  }
}

// ---- AMX (bf16, K a multiple of 32): 16 rows x 48 columns per sweep in three tile accumulators ----
//
// At small M the GEMM is bound by streaming the weights, and AMX leaves the cores nearly idle while the
// stream runs (one TDPBF16PS does 16 x 16 x 32 multiply-adds). The packed bf16 panel is already AMX's B
// layout: 16 consecutive k pairs of 16 columns are 16 rows of 64 bytes, kPanel * 4 bytes apart.
constexpr int kAmxRows = 16;
constexpr int64_t kAmxK = 32;                           // bf16 elements of K per tile step
constexpr int64_t kAmxPrefetch = 2 * 16 * kPanel * 4;  // bytes ahead in the weight stream: two steps


BF_TARGET_AMX void linear_amx(const bf16* x, int64_t ldx, const bf16* packed, int64_t M, int64_t N, int64_t K,
                              const Epilogue& ep, int part, int parts) {
  static_assert(kPanel == 48, "the AMX kernel holds a panel in three 16-column tiles");
  DenormalGuard ftz;
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t panel_elems = K * kPanel;  // K is even here
  int64_t lo, hi;
  split_range(panels, part, parts, &lo, &hi);
  alignas(64) float tile[kAmxRows * kPanel];
  int configured = -1;
  for (int64_t p = lo; p < hi; ++p) {
    const int64_t nvalid = std::min<int64_t>(kPanel, N - p * kPanel);
    const bf16* wp = packed + p * panel_elems;
    for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
      const int mr = int(std::min<int64_t>(kAmxRows, M - m0));
      if (mr != configured) {
        amx_load_tile_config(mr);
        configured = mr;
      }
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      const bf16* xa = x + m0 * ldx;
      for (int64_t k0 = 0; k0 < K; k0 += kAmxK) {
        const bf16* b = wp + (k0 / 2) * kPanel * 2;  // 16 k pairs x kPanel columns x 2
        // The thread's panels are contiguous: prefetching past this one warms the next.
        const char* ahead = reinterpret_cast<const char*>(b) + kAmxPrefetch;
        for (int l = 0; l < 16 * kPanel * 4; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
        _tile_loadd(3, xa + k0, ldx * 2);
        _tile_loadd(4, b, kPanel * 4);
        _tile_loadd(5, b + 32, kPanel * 4);
        _tile_loadd(6, b + 64, kPanel * 4);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
      }
      _tile_stored(0, tile, kPanel * 4);
      _tile_stored(1, tile + 16, kPanel * 4);
      _tile_stored(2, tile + 32, kPanel * 4);
      store_tile<bf16>(tile, mr, m0, p * kPanel, nvalid, ep);
    }
  }
  if (configured >= 0) _tile_release();
}

#endif

}  // namespace

template <typename T>
void linear_small_m(const T* x, int64_t ldx, const T* packed, const T* bias, const T* residual, int64_t ldr,
                    int64_t m, int64_t n, int64_t k, Act act, T* out, int64_t ldo) {
  if (m == 0 || n == 0) return;
  const Epilogue ep{bias, residual, ldr, act, out, ldo};
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int nt = int(std::min<int64_t>(panels, threads_for(m * n * k / 4)));
#if BF_X86
  const bool amx = sizeof(T) == 2 && active_isa() == Isa::Avx512 && k % kAmxK == 0 && amx_bf16_usable() && amx_enabled();
#endif
  // One part per thread: each streams a contiguous range of panels.
  parallel_for(nt, nt, [&](int64_t part) {
#if BF_X86
    if constexpr (sizeof(T) == 2) {
      if (amx) {
        linear_amx(x, ldx, packed, m, n, k, ep, int(part), nt);
        return;
      }
    }
#endif
    BF_DISPATCH(linear, x, ldx, packed, m, n, k, ep, int(part), nt);
  });
}

template void linear_small_m<float>(const float*, int64_t, const float*, const float*, const float*, int64_t,
                                    int64_t, int64_t, int64_t, Act, float*, int64_t);
template void linear_small_m<bf16>(const bf16*, int64_t, const bf16*, const bf16*, const bf16*, int64_t, int64_t,
                                   int64_t, int64_t, Act, bf16*, int64_t);

}  // namespace cpu
}  // namespace bertfast
