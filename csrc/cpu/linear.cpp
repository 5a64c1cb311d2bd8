// GEMM on prepacked weights: out = act(x w^T + bias) + residual.
//
// At small M (a handful of tokens) a linear layer is bound by reading its weights once from memory; the
// packed layout makes that read one sequential stream per panel of kPanel output columns, and threads
// share the panels out so that each streams one contiguous stretch (MeetInTheMiddle, parallel.h). With
// more rows (fp32 on AVX-512) the same panels feed a compute-bound blocked GEMM (linear_blocked_f32); the
// AVX2 kernel streams at every M.
// fp32 weights: [panels][K][kPanel]. bf16 weights: [panels][ceil(K/2)][kPanel][2], pairs along K as
// AVX-512 BF16 dot products (vdpbf16ps) and AMX tiles want them. Accumulation is fp32; bias, activation and
// residual are applied to the fp32 accumulator and the result is rounded once.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "isa.h"
#include "kernels.h"
#include "scalar_math.h"
#include "simd.h"
#include "vec_math.h"
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
  Activation act;
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
      case Activation::Gelu:
#pragma omp simd
        for (int64_t j = 0; j < nvalid; ++j) tmp[j] = gelu_erf(tmp[j]);
        break;
      case Activation::GeluTanh:
#pragma omp simd
        for (int64_t j = 0; j < nvalid; ++j) tmp[j] = gelu_tanh(tmp[j]);
        break;
      case Activation::Relu:
#pragma omp simd
        for (int64_t j = 0; j < nvalid; ++j) tmp[j] = tmp[j] > 0.f ? tmp[j] : 0.f;
        break;
      case Activation::Tanh:
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
                    MeetInTheMiddle::Walker& panels) {
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

#if BF_X86
// ---- AVX-512 tiles: MR rows x 48 columns in 3 x MR zmm accumulators ----

// Two regimes, by the number of passes (register tiles of up to 8 rows of x):
// - streaming, up to kPackPasses passes (M <= 32), bound by the weight stream: a panel is computed in
//   blocks of kBlockSteps<T> k steps (fp32) or k pairs (bf16) (36 / 24 KB of weights, read from memory by
//   the first pass and from L1/L2 by the others); a far prefetch keeps the memory stream running (while a
//   block is computed, the stretch as long as the block kFarBytes further along this thread's weight
//   stream is pulled into L2, a few lines per k step, spread over all passes) and a near prefetch pulls
//   the block itself into L1 just ahead of the first pass's loads; x is packed (pack_x) so that a tile's
//   rows sit at constant offsets from one pointer. bf16 always runs this way (at larger M the AMX
//   kernel or torch's oneDNN takes over).
// - blocked (fp32, more passes), compute bound: see linear_blocked_f32.
// Streaming regime, measured on Sapphire Rapids (2 threads, the 48 weights of BERT-base from memory,
// paired runs in one process against the previous kernel, which swept each pass over the whole panel
// with per-row x pointers): time x0.83-0.91 at M = 16 (15.9-17.9 -> 17.7-21.5 GB/s), x0.89 at M = 8,
// x0.95 at M = 24-32. Far distances of 16-128 KB and blocks of 64-256 steps measured alike.
constexpr int64_t kStepBytes = kPanel * 4;  // one k step (fp32) or k pair (bf16) of a panel
// fp32 blocks are the blocked regime's k blocks and sum the same way (each block from zero, then added to
// the earlier ones, same epilogue), so a row's result does not depend on how many rows share the call.
template <typename T>
constexpr int64_t kBlockSteps = sizeof(T) == 2 ? 128 : 192;
constexpr int64_t kFarBytes = 32 * 1024;
constexpr int64_t kNearBytes = 1024;

// Byte `offset` of a thread's weight stream: through the current panel (`here`), then on into the
// panel it takes next (`next`, null at the end of its run); null past both.
BF_INLINE const char* stream_at(const char* here, const char* next, int64_t panel_bytes, int64_t offset) {
  if (offset < panel_bytes) return here + offset;
  return next != nullptr && offset < 2 * panel_bytes ? next + (offset - panel_bytes) : nullptr;
}

// The far prefetch of one pass over one block: `lines` cache lines from stream offset `offset` on,
// spread evenly over the pass's `steps` k steps.
struct FarPrefetch {
  const char* here;
  const char* next;
  int64_t panel_bytes;
  int64_t offset;
  int64_t lines;
  int64_t steps;
  int64_t credit;

  // No target attribute (a prefetch is SSE): the AVX2 and AVX-512 tiles both inline it.
  BF_INLINE void step() {
    credit += lines;
    for (; credit >= steps; credit -= steps, offset += 64) {
      const char* line = stream_at(here, next, panel_bytes, offset);
      if (line != nullptr) _mm_prefetch(line, _MM_HINT_T1);
    }
  }
};

// x as the streaming regime's tiles read it: [blocks][M][kBlockSteps<T> k steps], zero past K. A row's k
// steps of one block sit at a fixed distance from the next row's, so a tile broadcasts all its rows
// from one pointer with constant offsets (with a pointer per row GCC ran out of registers and reloaded
// them from the stack on every k step). bf16 keeps k pairs together: an odd K's missing odd element
// is a zero, as the packed weight's is.
template <typename T>
constexpr int64_t kXRow = kBlockSteps<T> * (sizeof(T) == 2 ? 2 : 1);  // elements of a row per block
constexpr int64_t kPackPasses = 4;

template <typename T>
void pack_x(const T* x, int64_t ldx, int64_t M, int64_t K, T* xp) {
  const int64_t S = kXRow<T>;
  for (int64_t k0 = 0; k0 < K; k0 += S) {
    const int64_t n = std::min<int64_t>(S, K - k0);
    for (int64_t m = 0; m < M; ++m, xp += S) {
      std::memcpy(static_cast<void*>(xp), x + m * ldx + k0, sizeof(T) * n);
      std::memset(static_cast<void*>(xp + n), 0, sizeof(T) * (S - n));
    }
  }
}

// A tile's accumulators: zero (the first block of a panel), or the sums of the earlier blocks in `tile`.
template <int MR>
BF_TARGET_AVX512 BF_INLINE void load_acc(__m512 (&c)[MR][3], const float* tile, bool first) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 3; ++v) c[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(tile + r * kPanel + 16 * v);
}

template <int MR>
BF_TARGET_AVX512 BF_INLINE void store_acc(const __m512 (&c)[MR][3], float* tile) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 3; ++v) _mm512_storeu_ps(tile + r * kPanel + 16 * v, c[r][v]);
}

// One fp32 k step of an MR x 48 tile: the step's 48 weights times row r's x value `x_at(r)`.
template <int MR, typename XAt>
BF_TARGET_AVX512 BF_INLINE void fma_step(__m512 (&c)[MR][3], const float* w, const XAt& x_at) {
  const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(x_at(r));
    c[r][0] = _mm512_fmadd_ps(a, w0, c[r][0]);
    c[r][1] = _mm512_fmadd_ps(a, w1, c[r][1]);
    c[r][2] = _mm512_fmadd_ps(a, w2, c[r][2]);
  }
}

// The near prefetch: the three cache lines of the k step kNearBytes ahead of w, into L1.
// Untargeted like FarPrefetch::step, for the AVX2 and AVX-512 tiles alike.
BF_INLINE void near_prefetch(const void* w) {
  const char* p = static_cast<const char*>(w) + kNearBytes;
  _mm_prefetch(p, _MM_HINT_T0);
  _mm_prefetch(p + 64, _MM_HINT_T0);
  _mm_prefetch(p + 128, _MM_HINT_T0);
}

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
  if (!first) {
    __m512 sum[MR][3];
    load_acc<MR>(sum, tile, false);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 3; ++v) c[r][v] = _mm512_add_ps(sum[r][v], c[r][v]);
  }
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

// The streaming schedule (linear_avx512 and linear_avx2): each claimed panel in blocks of kBlockSteps<T> k
// steps (k pairs for bf16); per block, passes of up to `rows` rows (pass 0 near-prefetches the block and
// every pass takes its share of the far prefetch) add onto the panel's fp32 sums `acc` (M x kPanel); then
// the epilogue (`pass.store`). xp: x packed by the tier ([blocks][M][kXRow<T>] of XT). `pass` runs one pass;
// it is a functor whose call is not force-inlined, so this untargeted template can serve both targets (a
// call per pass of up to kBlockSteps<T> k steps).
template <typename T, typename XT, typename Pass>
BF_INLINE void stream_panels(const XT* xp, const T* packed, int64_t M, int64_t N, int64_t K, int64_t rows,
                             const Epilogue& ep, MeetInTheMiddle::Walker& panels, float* acc, const Pass& pass) {
  const int64_t steps = sizeof(T) == 2 ? (K + 1) / 2 : K;  // k steps (bf16: k pairs) per panel
  const int64_t panel_bytes = steps * kStepBytes;
  const int64_t passes = (M + rows - 1) / rows;
  const int64_t blocks = (steps + kBlockSteps<T> - 1) / kBlockSteps<T>;
  const char* base = reinterpret_cast<const char*>(packed);
  for (int64_t p = panels.claim(); p >= 0; p = panels.claim()) {
    const T* wp = packed + p * (panel_bytes / sizeof(T));
    const int64_t p_next = panels.peek();
    for (int64_t kb = 0; kb < blocks; ++kb) {
      const int64_t k0 = kb * kBlockSteps<T>, n = std::min<int64_t>(kBlockSteps<T>, steps - k0);
      // The far prefetch covers as many bytes as the block, kFarBytes ahead of it, a share per pass.
      const int64_t far_lines = n * kStepBytes / 64;
      for (int64_t i = 0; i < passes; ++i) {
        const int64_t m0 = i * rows;
        const int64_t l0 = far_lines * i / passes, l1 = far_lines * (i + 1) / passes;
        const FarPrefetch pf{base + p * panel_bytes, p_next >= 0 ? base + p_next * panel_bytes : nullptr, panel_bytes,
                             k0 * kStepBytes + kFarBytes + l0 * 64, l1 - l0, n, 0};
        pass(xp + (kb * M + m0) * kXRow<T>, wp + k0 * (kStepBytes / sizeof(T)), n, int(std::min<int64_t>(rows, M - m0)),
             acc + m0 * kPanel, kb == 0, pf, i == 0);
      }
    }
    const int64_t nvalid = std::min<int64_t>(kPanel, N - p * kPanel);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
      pass.store(acc + m0 * kPanel, int(std::min<int64_t>(kMaxRows, M - m0)), m0, p * kPanel, nvalid, ep);
  }
}

// Number of k blocks of the streaming schedule: the packed x holds [blocks][M][kXRow<T>].
template <typename T>
int64_t stream_blocks(int64_t K) {
  const int64_t steps = sizeof(T) == 2 ? (K + 1) / 2 : K;
  return (steps + kBlockSteps<T> - 1) / kBlockSteps<T>;
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

// The whole AVX-512 path is compiled with the BF16 target so one function holds both variants; the
// dot-product one runs only when the CPU has AVX-512 BF16 (`dot`).
template <typename T>
BF_TARGET_AVX512BF16 void linear_avx512(const T* x, int64_t ldx, const T* packed, int64_t M, int64_t N, int64_t K,
                                        const Epilogue& ep, MeetInTheMiddle::Walker& panels) {
  DenormalGuard ftz;
  // Per thread, reused across calls: the packed x and the fp32 accumulators of a panel.
  thread_local std::vector<T> xp;
  thread_local std::vector<float> acc;
  xp.resize(stream_blocks<T>(K) * M * kXRow<T>);
  pack_x(x, ldx, M, K, xp.data());
  acc.resize(M * kPanel);
  stream_panels(xp.data(), packed, M, N, K, kMaxRows, ep, panels, acc.data(), Avx512Pass<T>{has_avx512_bf16()});
}

// ---- AVX2 + FMA (Avx2 tier): the streaming schedule above on 16 ymm registers ----
//
// The schedule of linear_avx512 at every M: a panel in blocks of kBlockSteps<T> k steps (fp32) or k pairs
// (bf16), read from memory by the first pass and from L1 by the others, with the same far and near
// prefetch, and fp32 accumulators of the whole panel kept between blocks. A pass of rows covers the panel's
// 48 columns in register tiles of at most 12 accumulators (pass_avx2_rows has the shapes). AVX2 has no
// embedded broadcast, so x is packed already widened to fp32 (pack_x_f32) and each row's value is one
// broadcast load; bf16 weights are widened in registers (widen_pairs), so bf16 streams half the bytes.
// No AVX2 sibling of linear_blocked_f32: up to the 256 fp32 rows the cpu backend runs here on this tier,
// x stays in L2 and a weight block in L1 with this schedule too (fp32 at 128 rows took x1.02 the time of
// the AVX-512 kernel's blocked regime, 1 thread), and MKL takes larger M.
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

// The tile shape of a pass of `mr` rows, measured on Zen 4 (1 thread, 768 x 2304): fp32 2 x 48 with the
// weights kept in registers matched the AVX-512 kernel's time at 128 rows (6 x 16: x1.18, 4 x 24: x1.04).
// bf16 needs 2 widened vectors per weight vector: 5 x 16 (weights in registers, 10 accumulators) took
// x0.70 the time of 2 x 48 (whose accumulators spilled), x0.62 of 4 x 16, x0.76 of 2 x 24 at 128 rows.
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
    store_tile<T>(tile, mr, m0, n0, nvalid, ep);
  }
};

template <typename T>
BF_TARGET_AVX2 void linear_avx2(const T* x, int64_t ldx, const T* packed, int64_t M, int64_t N, int64_t K,
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

// ---- blocked regime (fp32, more than kPackPasses passes): compute bound ----
//
// Goto-style blocking. The output is cut into items: row blocks of up to kBlockRows rows times one
// run of panels per thread (BlockedItems), claimed one at a time (at 576 rows 10 items for 2 threads;
// blocks of 192 rows, 6 items, took x1.00-1.03 the time). An item runs K in blocks of kBlockK steps:
// the block of x is packed as the tiles read it (pack_x_tiles: a k step's 8 rows in 32 contiguous
// bytes) into L2, then for each panel of the run its kBlockK x 48 block of weights (36 KB) comes from
// memory once and stays in L1 while every tile of 8 rows runs over it. A tile sums each k block from
// zero and adds that to the sums of the earlier blocks, which wait in a per-thread buffer (a tile's
// 1.5 KB in one place); the weight block the item runs next is pulled into L2 a share per tile, a line
// every 4 k steps. The last k block keeps the sums in registers for the epilogue (bias, activation,
// residual): nothing runs over the output a second time.
// Measured on Sapphire Rapids (2 threads, the four BERT-base GEMM shapes, paired in one process with
// torch.addmm = MKL's sgemm, interleaved): at M = 576 time x0.95-0.97 of MKL's when the host runs fast
// (~320 GFLOP/s for MKL), x0.98-1.0 when it runs slow (~210); at M = 48-256 x0.65-0.90, as the
// register-tile sweep it replaced (which reached only x0.98-1.06 of MKL at 576). Summing by blocks also
// makes it more accurate than one running sum over K: max error 1.6e-6 against 1.0e-5 (MKL 2.2e-6) for
// 576 x 3072 by 3072 x 768 against float64.
constexpr int64_t kBlockRows = 128;
constexpr int64_t kBlockK = kBlockSteps<float>;

// dst[k][r] = src[r][k] for an 8 x 8 block (rows of src `ld` apart).
BF_TARGET_AVX512 BF_INLINE void transpose_8x8(const float* src, int64_t ld, float* dst) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // r_i[0] r_i+1[0] r_i[1] r_i+1[1] | same for 4..5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // columns 2, 3 | 6, 7
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);      // column 0 of rows i..i+3 | column 4
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);  // column 1 | 5
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + 8 * j, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
    _mm256_storeu_ps(dst + 8 * (j + 4), _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
  }
}

// x rows [0, rows) x k steps [k0, k0 + kc) as tiles of 8 rows: [tiles][kc][8], rows past `rows` zero.
BF_TARGET_AVX512 void pack_x_tiles(const float* x, int64_t ldx, int64_t rows, int64_t k0, int64_t kc, float* xt) {
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows, xt += kc * kMaxRows) {
    const float* src = x + m0 * ldx + k0;
    int64_t k = 0;
    if (m0 + kMaxRows <= rows)
      for (; k + 8 <= kc; k += 8) transpose_8x8(src + k, ldx, xt + k * kMaxRows);
    for (; k < kc; ++k)
      for (int r = 0; r < kMaxRows; ++r) xt[k * kMaxRows + r] = m0 + r < rows ? src[r * ldx + k] : 0.f;
  }
}

// Where a tile's sums go after a k block: into `sums` (rows kPanel apart), or, when `ep` is set (the
// last k block, an activation act512 has), through the epilogue straight from the registers into the
// output rows m0.. and columns [n0, n0 + nvalid).
struct TileOut {
  float* sums;
  const Epilogue* ep;
  int64_t m0, n0, nvalid;
};

template <int MR, Activation ACT>
BF_TARGET_AVX512 BF_INLINE void finish_tile(const __m512 (&acc)[MR][3], const TileOut& to) {
  const Epilogue& ep = *to.ep;
  const float* bias = static_cast<const float*>(ep.bias);
  const float* res = static_cast<const float*>(ep.residual);
  float* out = static_cast<float*>(ep.out) + to.m0 * ep.ldo + to.n0;
  __mmask16 mk[3];
  __m512 b[3];
  for (int v = 0; v < 3; ++v) {
    mk[v] = tail_mask(to.nvalid - 16 * v);
    b[v] = bias != nullptr ? _mm512_maskz_loadu_ps(mk[v], bias + to.n0 + 16 * v) : _mm512_setzero_ps();
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const float* rr = res != nullptr ? res + (to.m0 + r) * ep.ldr + to.n0 : nullptr;
    for (int v = 0; v < 3; ++v) {
      __m512 y = act512<ACT>(_mm512_add_ps(acc[r][v], b[v]));
      if (rr != nullptr) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mk[v], rr + 16 * v));
      _mm512_mask_storeu_ps(out + r * ep.ldo + 16 * v, mk[v], y);
    }
  }
}

// One tile of MR rows over one k block: x tile [kc][8], weights [kc][48]. The block is summed from
// zero and then added to the earlier blocks' sums in `c` unless `first` (a sum of K/kBlockK partial
// sums of kBlockK terms each, whose rounding error grows with kBlockK + K/kBlockK rather than with
// K); the total goes to `to`. Every 4 k steps one cache line from `pf` on is pulled into L2 (the weight
// block the item runs next; prefetches never fault, so running past its end is harmless). Paired with
// the previous schedule (a prefetch credit counted every k step, plus the next tile's sums pulled into
// L1): x0.96-0.98 the time at 128-1024 rows; without any prefetch x1.09-1.16.
template <int MR>
BF_TARGET_AVX512 BF_INLINE void tile_blocked(const float* xt, const float* w, int64_t kc, const float* c, bool first,
                                             const char* pf, const TileOut& to) {
  __m512 acc[MR][3];
  load_acc<MR>(acc, c, true);
  const auto x_at = [&](int r) { return xt[r]; };
  int64_t k = 0;
  for (; k + 4 <= kc; k += 4, pf += 64) {
    _mm_prefetch(pf, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u, w += kPanel, xt += kMaxRows) fma_step<MR>(acc, w, x_at);
  }
  for (; k < kc; ++k, w += kPanel, xt += kMaxRows) fma_step<MR>(acc, w, x_at);
  if (!first) {
    __m512 sum[MR][3];
    load_acc<MR>(sum, c, false);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_add_ps(sum[r][v], acc[r][v]);
  }
  if (to.ep == nullptr)
    store_acc<MR>(acc, to.sums);
  else if (to.ep->act == Activation::Gelu)
    finish_tile<MR, Activation::Gelu>(acc, to);
  else if (to.ep->act == Activation::Relu)
    finish_tile<MR, Activation::Relu>(acc, to);
  else
    finish_tile<MR, Activation::None>(acc, to);
}

BF_TARGET_AVX512 void tile_blocked_rows(int mr, const float* xt, const float* w, int64_t kc, const float* c, bool first,
                                        const char* pf, const TileOut& to) {
  switch (mr) {
    case 1: tile_blocked<1>(xt, w, kc, c, first, pf, to); break;
    case 2: tile_blocked<2>(xt, w, kc, c, first, pf, to); break;
    case 3: tile_blocked<3>(xt, w, kc, c, first, pf, to); break;
    case 4: tile_blocked<4>(xt, w, kc, c, first, pf, to); break;
    case 5: tile_blocked<5>(xt, w, kc, c, first, pf, to); break;
    case 6: tile_blocked<6>(xt, w, kc, c, first, pf, to); break;
    case 7: tile_blocked<7>(xt, w, kc, c, first, pf, to); break;
    default: tile_blocked<8>(xt, w, kc, c, first, pf, to); break;
  }
}

// The streaming regime's epilogue: fp32 through the blocked regime's (the same vector activation), bf16
// and the activations without a 16-lane form through store_tile.
template <typename T>
BF_TARGET_AVX512BF16 void Avx512Pass<T>::store(const float* tile, int mr, int64_t m0, int64_t n0, int64_t nvalid,
                                              const Epilogue& ep) const {
  if constexpr (sizeof(T) == 4) {
    if (ep.act == Activation::None || ep.act == Activation::Gelu || ep.act == Activation::Relu) {
      for (int r = 0; r < mr; ++r) {
        __m512 acc[1][3];
        load_acc<1>(acc, tile + r * kPanel, false);
        const TileOut to{nullptr, &ep, m0 + r, n0, nvalid};
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
  store_tile<T>(tile, mr, m0, n0, nvalid, ep);
}

// One item: output rows [r0, r0 + rows) x panels [p0, p1).
BF_TARGET_AVX512 void linear_blocked_f32(const float* x, int64_t ldx, const float* packed, int64_t N, int64_t K,
                                         const Epilogue& ep, int64_t r0, int64_t rows, int64_t p0, int64_t p1) {
  DenormalGuard ftz;
  thread_local std::vector<float> xt, sums;
  xt.resize(((kBlockRows + kMaxRows - 1) / kMaxRows) * kMaxRows * kBlockK);
  const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
  // The sums between k blocks: [panels][tiles][8][kPanel], a tile's in 1.5 KB at one place.
  sums.resize((p1 - p0) * tiles * kMaxRows * kPanel);
  alignas(64) float tile[kMaxRows * kPanel];
  const bool in_registers = ep.act == Activation::None || ep.act == Activation::Gelu || ep.act == Activation::Relu;  // act512 has them
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t kc = std::min(kBlockK, K - k0);
    const bool first = k0 == 0, last = k0 + kc == K;
    pack_x_tiles(x + r0 * ldx, ldx, rows, k0, kc, xt.data());
    for (int64_t p = p0; p < p1; ++p) {
      const float* w = packed + (p * K + k0) * kPanel;
      // The weight block this item runs next: the next panel's, or its first panel's next k block.
      const float* w_after = p + 1 < p1 ? w + K * kPanel : (last ? nullptr : packed + (p0 * K + k0 + kc) * kPanel);
      const int64_t lines = kc * kStepBytes / 64;  // of a weight block
      const int64_t n0 = p * kPanel, nvalid = std::min<int64_t>(kPanel, N - n0);
      float* c = sums.data() + (p - p0) * tiles * kMaxRows * kPanel;
      for (int64_t t = 0; t < tiles; ++t) {
        // The next weight block into L2 from this tile's share of its lines on (the current block, already
        // in L1, when there is no next one).
        const char* pf = w_after != nullptr ? reinterpret_cast<const char*>(w_after) + (lines * t / tiles) * 64
                                            : reinterpret_cast<const char*>(w);
        const int64_t m0 = t * kMaxRows;
        const int mr = int(std::min<int64_t>(kMaxRows, rows - m0));
        float* ct = c + m0 * kPanel;
        const float* xs = xt.data() + t * kc * kMaxRows;
        if (!last) {
          tile_blocked_rows(mr, xs, w, kc, ct, first, pf, TileOut{ct, nullptr, 0, 0, 0});
        } else if (in_registers) {
          tile_blocked_rows(mr, xs, w, kc, ct, first, pf, TileOut{nullptr, &ep, r0 + m0, n0, nvalid});
        } else {
          tile_blocked_rows(mr, xs, w, kc, ct, first, pf, TileOut{tile, nullptr, 0, 0, 0});
          store_tile<float>(tile, mr, r0 + m0, n0, nvalid, ep);
        }
      }
    }
  }
}

// The items of an M x N output: row blocks of equal size (a multiple of 8, at most kBlockRows) times
// `runs` equal runs of panels (one per thread: each packs a block of x once for its whole run).
struct BlockedItems {
  int64_t rows_per, row_blocks, panels, runs;
  BlockedItems(int64_t M, int64_t panels_, int64_t runs_) : panels(panels_), runs(runs_) {
    row_blocks = (M + kBlockRows - 1) / kBlockRows;
    rows_per = ((M + row_blocks - 1) / row_blocks + kMaxRows - 1) / kMaxRows * kMaxRows;
    row_blocks = (M + rows_per - 1) / rows_per;
  }
  int64_t count() const { return row_blocks * runs; }
  int64_t first_panel(int64_t run) const { return panels * run / runs; }
};

// ---- AMX (bf16, K a multiple of 32): 16 rows x 48 columns per sweep in three tile accumulators ----
//
// At small M the GEMM is bound by streaming the weights, and AMX leaves the cores nearly idle while the
// stream runs (one TDPBF16PS does 16 x 16 x 32 multiply-adds). The packed bf16 panel is already AMX's B
// layout: 16 consecutive k pairs of 16 columns are 16 rows of 64 bytes, kPanel * 4 bytes apart.
constexpr int kAmxRows = 16;
constexpr int64_t kAmxK = 32;                           // bf16 elements of K per tile step
constexpr int64_t kAmxPrefetch = 2 * 16 * kPanel * 4;  // bytes ahead in the weight stream: two steps


BF_TARGET_AMX void linear_amx(const bf16* x, int64_t ldx, const bf16* packed, int64_t M, int64_t N, int64_t K,
                              const Epilogue& ep, MeetInTheMiddle::Walker& panels) {
  static_assert(kPanel == 48, "the AMX kernel holds a panel in three 16-column tiles");
  DenormalGuard ftz;
  const int64_t panel_bytes = K * kPanel * 2;  // K is even here
  alignas(64) float tile[kAmxRows * kPanel];
  int configured = -1;
  for (int64_t p = panels.claim(); p >= 0; p = panels.claim()) {
    const int64_t nvalid = std::min<int64_t>(kPanel, N - p * kPanel);
    const bf16* wp = packed + p * (panel_bytes / 2);
    const int64_t p_next = panels.peek();
    const char* here = reinterpret_cast<const char*>(wp);
    const char* next = p_next >= 0 ? reinterpret_cast<const char*>(packed) + p_next * panel_bytes : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
      const int mr = int(std::min<int64_t>(kAmxRows, M - m0));
      amx_begin_block(mr, &configured);
      const bf16* xa = x + m0 * ldx;
      for (int64_t k0 = 0; k0 < K; k0 += kAmxK) {
        const bf16* b = wp + (k0 / 2) * kPanel * 2;  // 16 k pairs x kPanel columns x 2
        // Two steps ahead along the thread's stream.
        const char* pf = stream_at(here, next, panel_bytes, k0 * kPanel * 2 + kAmxPrefetch);
        if (pf != nullptr)
          for (int l = 0; l < 16 * kPanel * 4; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
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
void linear_packed(const T* x, int64_t ldx, const T* packed, const T* bias, const T* residual, int64_t ldr,
                    int64_t m, int64_t n, int64_t k, Activation act, T* out, int64_t ldo) {
  if (m == 0 || n == 0) return;
  const Epilogue ep{bias, residual, ldr, act, out, ldo};
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int nt = int(std::min<int64_t>(panels, threads_for(m * n * k / 4)));
#if BF_X86
  const bool amx = sizeof(T) == 2 && active_isa() == Isa::Amx && k % kAmxK == 0;
#endif
#if BF_X86
  if constexpr (sizeof(T) == 4) {
    if (active_isa() >= Isa::Avx512Vnni && (m + kMaxRows - 1) / kMaxRows > kPackPasses) {
      const BlockedItems items(m, panels, nt);
      parallel_for(nt, items.count(), [&](int64_t i) {
        const int64_t rb = i / items.runs, run = i % items.runs, r0 = rb * items.rows_per;
        linear_blocked_f32(x, ldx, packed, n, k, ep, r0, std::min(items.rows_per, m - r0), items.first_panel(run),
                           items.first_panel(run + 1));
      });
      return;
    }
  }
#endif
  // One part per thread: each streams a contiguous stretch of panels, meeting its partner's.
  const MeetInTheMiddle shared(panels, nt);
  parallel_for(nt, nt, [&](int64_t part) {
    MeetInTheMiddle::Walker mine = shared.walker(int(part));
#if BF_X86
    if constexpr (sizeof(T) == 2) {
      if (amx) {
        linear_amx(x, ldx, packed, m, n, k, ep, mine);
        return;
      }
    }
#endif
    BF_DISPATCH(linear, x, ldx, packed, m, n, k, ep, mine);
  });
}

template void linear_packed<float>(const float*, int64_t, const float*, const float*, const float*, int64_t,
                                    int64_t, int64_t, int64_t, Activation, float*, int64_t);
template void linear_packed<bf16>(const bf16*, int64_t, const bf16*, const bf16*, const bf16*, int64_t, int64_t,
                                   int64_t, int64_t, Activation, bf16*, int64_t);

}  // namespace cpu
}  // namespace bertfast
