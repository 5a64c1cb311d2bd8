// Internals shared by the fp32/bf16 GEMM's files (linear*.cpp): epilogue, streaming schedule, tile steps, entries.
//
// The epilogue, the streaming schedule with its prefetches, the AVX-512 register-tile steps, and each regime's
// entry point (the dispatch is linear.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/common/activation.h"
#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/common/scalar_math.h"
#include "cpu/common/simd.h"
#include "cpu/common/vec_math.h"
#include "cpu/gemm/amx_gemm.h"
#include "cpu/gemm/lora.h"

namespace bertfast {
namespace cpu {

// The fp32/bf16 GEMM kernels, one per path (linear.cpp dispatches on choose_gemm's answer).
enum class GemmPath : int {
  StreamPortable,      // streaming, plain loops (linear_stream.cpp)
  StreamAvx2,          // streaming on AVX2 (linear_stream_avx2.cpp)
  StreamAvx512,        // streaming on AVX-512, bf16 on vdpbf16ps where present (linear_stream.cpp)
  BlockedPortable,     // fp32 blocked, plain loops (linear_blocked.cpp)
  BlockedAvx512,       // fp32 blocked on AVX-512 (linear_blocked.cpp)
  BlockedBf16,         // bf16 blocked on AVX-512 without AVX-512 BF16, widened to fp32 (linear_blocked.cpp)
  AmxStream,           // bf16 on AMX tiles, streaming (linear_amx.cpp)
  AmxStreamEmulated,   // the same with the tiles emulated (the amx_emulated tier)
  AmxBlocked,          // bf16 on AMX tiles, blocked (linear_amx.cpp, amx_gemm.cpp)
  AmxBlockedEmulated,  // the same with the tiles emulated
};
const char* gemm_path_name(GemmPath path);
// Whether a path runs on AMX tiles, emulated or not: the paths that take LoRA factors in tile form (lora_tile_rows).
inline bool on_tiles(GemmPath p) {
  return p == GemmPath::AmxStream || p == GemmPath::AmxStreamEmulated || p == GemmPath::AmxBlocked ||
         p == GemmPath::AmxBlockedEmulated;
}

// What the choice reads: the operands' dtype, the call's M and K (the same choice for every N) and the tier.
struct GemmCall {
  bool bf16;         // bf16 operands (else fp32)
  int64_t m, k;
  Isa isa;           // the tier (active_isa())
  bool avx512_bf16;  // AVX-512 BF16 present and not hidden (has_avx512_bf16())
  AmxGemm amx_mode;  // the AMX kernels' forced choice, or Auto (amx_gemm())
};
GemmPath choose_gemm(const GemmCall& call);

namespace linear_detail {

constexpr int kMaxRows = 8;  // rows of x per register tile (8 rows x 3 zmm = 24 accumulators)
// Rows of x in one item of the blocked regimes (linear_blocked.cpp; BlockedItems, linear.cpp).
constexpr int64_t kBlockRows = 128;
// Passes of kMaxRows rows up to which fp32 streams (choose_gemm); more take a blocked regime, on the portable tier
// from 3 passes (M > 16), where its blocked regime overtakes streaming (benchmarks/results/2026-12-06-native-notes).
constexpr int64_t kPackPasses = 4;
constexpr int64_t kPortablePackPasses = 2;

// bias has the operands' type; residual and out too, except `wide` (bf16 operands only): then both are fp32, the
// residual stream of a bf16 forward (linear_packed_wide). lora: the rows' LoRA terms (lora.h) added before the
// activation, act(c + bias + lora) + residual, or null; terms: lora's terms of the rows being stored, computed
// beforehand (the AMX kernels' lora_expand_amx), or null.
struct Epilogue {
  const void* bias;
  const void* residual;
  int64_t ldr;
  Activation act;
  void* out;
  int64_t ldo;
  bool wide = false;
  const LoraTerm* lora = nullptr;
  const LoraBlock* terms = nullptr;
};

template <typename T, typename O, bool kAvx512, bool kAvx2>
BF_INLINE void store_rows(const float* tile, int mr, int64_t m0, int64_t n0, int64_t nvalid, const Epilogue& ep);

// The lines of the residual the epilogue of rows [m0, m0 + mr) x columns [n0, n0 + n) reads and of the output it
// writes (operands of type T; residual and output fp32 where `wide`), requested (the output for writing) before those
// rows' last k block, so they arrive while it computes: the hardware does not follow these strided rows.
template <typename T>
BF_INLINE void prefetch_epilogue(const Epilogue& ep, int64_t m0, int64_t mr, int64_t n0, int64_t n) {
  const int64_t size = ep.wide ? 4 : int64_t(sizeof(T));
  const auto* res = static_cast<const char*>(ep.residual);
  const auto* out = static_cast<const char*>(ep.out);
  for (int64_t r = m0; r < m0 + mr; ++r) {
    for (int64_t b = 0; b < n * size; b += 64) {
      if (res != nullptr) __builtin_prefetch(res + (r * ep.ldr + n0) * size + b, 0, 3);
      __builtin_prefetch(out + (r * ep.ldo + n0) * size + b, 1, 3);
    }
  }
  if (ep.lora != nullptr) lora_prefetch(*ep.lora, m0, mr, n0, n);
}

#if BF_X86
// store_rows on 16 lanes, for no activation or erf-GELU: the same operations in the same order (c + bias, GELU,
// + residual, one rounding), so the same bits. A call, as store_tile has no target. The scalar loops it replaces
// cost the AMX FFN-in GEMM (GELU) about twice its tile work.
template <typename T, typename O>
BF_TARGET_AVX512 void store_rows512(const float* tile, int mr, int64_t m0, int64_t n0, int64_t nvalid,
                                    const Epilogue& ep) {
  const T* bias = static_cast<const T*>(ep.bias);
  const O* res = static_cast<const O*>(ep.residual);
  O* out = static_cast<O*>(ep.out);
  __mmask16 mk[3];
  __m512 b[3];
  for (int v = 0; v < 3; ++v) {
    mk[v] = tail_mask(nvalid - 16 * v);
    b[v] = bias != nullptr ? load16(bias + n0 + 16 * v, mk[v]) : _mm512_setzero_ps();
  }
  const bool gelu = ep.act == Activation::Gelu;
  alignas(64) float terms[kMaxRows][64];
  const float* term[kMaxRows] = {};
  for (int r = 0; r < mr; ++r) {
    if (ep.terms != nullptr) {
      term[r % kMaxRows] = ep.terms->term[m0 + r - ep.terms->m0];
    } else if (ep.lora != nullptr && r % kMaxRows == 0) {  // the next rows' terms at once: they share each B^T load
      std::fill(term, term + kMaxRows, nullptr);
      lora_terms_rows(*ep.lora, m0 + r, std::min(kMaxRows, mr - r), n0, nvalid, terms, term);
    }
    const float* c = tile + r * kPanel;
    O* o = out + (m0 + r) * ep.ldo + n0;
    const O* rr = res != nullptr ? res + (m0 + r) * ep.ldr + n0 : nullptr;
    __m512 y[3];
    for (int v = 0; v < 3; ++v) y[v] = _mm512_add_ps(_mm512_maskz_loadu_ps(mk[v], c + 16 * v), b[v]);
    lora_add48_terms(term[r % kMaxRows], mk, y);
    for (int v = 0; v < 3 && mk[v] != 0; ++v) {
      if (gelu) y[v] = gelu_erf512(y[v]);
      if (rr != nullptr) y[v] = _mm512_add_ps(y[v], load16(rr + 16 * v, mk[v]));
      store16(o + 16 * v, y[v], mk[v]);
    }
  }
}
#endif

// Writes rows [m0, m0 + mr) x columns [n0, n0 + nvalid) of the output from an fp32 tile [mr][kPanel]. kAvx512: the
// caller is AVX-512 code (16-lane epilogue for no activation and erf-GELU, store_rows512; activate512 otherwise);
// kAvx2: the avx2 tier's (activate256).
template <typename T, bool kAvx512 = false, bool kAvx2 = false>
BF_INLINE void store_tile(const float* tile, int mr, int64_t m0, int64_t n0, int64_t nvalid, const Epilogue& ep) {
#if BF_X86
  if constexpr (kAvx512) {
    if (ep.act == Activation::None || ep.act == Activation::Gelu) {
      if (sizeof(T) == 2 && ep.wide) return store_rows512<T, float>(tile, mr, m0, n0, nvalid, ep);
      return store_rows512<T, T>(tile, mr, m0, n0, nvalid, ep);
    }
  }
#endif
  if (sizeof(T) == 2 && ep.wide) return store_rows<T, float, kAvx512, kAvx2>(tile, mr, m0, n0, nvalid, ep);
  store_rows<T, T, kAvx512, kAvx2>(tile, mr, m0, n0, nvalid, ep);
}

// store_tile's rows: bias of the operands' type T, residual and out of type O.
template <typename T, typename O, bool kAvx512, bool kAvx2>
BF_INLINE void store_rows(const float* tile, int mr, int64_t m0, int64_t n0, int64_t nvalid, const Epilogue& ep) {
  const T* bias = static_cast<const T*>(ep.bias);
  const O* res = static_cast<const O*>(ep.residual);
  O* out = static_cast<O*>(ep.out);
  for (int r = 0; r < mr; ++r) {
    const float* c = tile + r * kPanel;
    O* o = out + (m0 + r) * ep.ldo + n0;
    const O* rr = res != nullptr ? res + (m0 + r) * ep.ldr + n0 : nullptr;
    float tmp[kPanel];
#pragma omp simd
    for (int64_t j = 0; j < nvalid; ++j) tmp[j] = c[j] + (bias != nullptr ? to_float(bias[n0 + j]) : 0.f);
    if (ep.terms == nullptr) {
      lora_add(ep.lora, m0 + r, n0, nvalid, tmp);
    } else if (const float* term = ep.terms->term[m0 + r - ep.terms->m0]) {
      for (int64_t j = 0; j < nvalid; ++j) tmp[j] += term[j];
    }
    activate_lanes<kAvx512 ? Lanes::Avx512 : (kAvx2 ? Lanes::Avx2 : Lanes::Generic)>(tmp, nvalid, ep.act);
    if (rr != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < nvalid; ++j) o[j] = from_float<O>(tmp[j] + to_float(rr[j]));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < nvalid; ++j) o[j] = from_float<O>(tmp[j]);
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

// c = (the sums of the earlier k blocks in `tile`) + c: a block's sums onto those before it.
template <int MR>
BF_TARGET_AVX512 BF_INLINE void add_earlier(__m512 (&c)[MR][3], const float* tile) {
  __m512 sum[MR][3];
  load_acc<MR>(sum, tile, false);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 3; ++v) c[r][v] = _mm512_add_ps(sum[r][v], c[r][v]);
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

// The streaming schedule (linear_stream_avx512 and linear_stream_avx2): each claimed panel in blocks of
// kBlockSteps<T> k steps (k pairs for bf16); per block, passes of up to `rows` rows (pass 0 near-prefetches the
// block and every pass takes its share of the far prefetch) add onto the panel's fp32 sums `acc` (M x kPanel);
// each pass of the last block then runs its rows through the epilogue (`pass.store`). xp: x packed by the tier
// ([blocks][M][kXRow<T>] of XT). `pass` runs one pass; it is a functor whose call is not force-inlined, so this
// untargeted template can serve both targets (a call per pass of up to kBlockSteps<T> k steps).
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
        const int64_t m0 = i * rows, mr = std::min<int64_t>(rows, M - m0);
        const int64_t l0 = far_lines * i / passes, l1 = far_lines * (i + 1) / passes;
        const FarPrefetch pf{base + p * panel_bytes, p_next >= 0 ? base + p_next * panel_bytes : nullptr, panel_bytes,
                             k0 * kStepBytes + kFarBytes + l0 * 64, l1 - l0, n, 0};
        // In the last k block the pass's rows then go through the epilogue while their sums are in L1.
        const bool last = kb + 1 == blocks;
        const int64_t n0 = p * kPanel, nvalid = std::min<int64_t>(kPanel, N - n0);
        if (last) prefetch_epilogue<T>(ep, m0, mr, n0, nvalid);
        pass(xp + (kb * M + m0) * kXRow<T>, wp + k0 * (kStepBytes / sizeof(T)), n, int(mr), acc + m0 * kPanel,
             kb == 0, pf, i == 0);
        for (int64_t r = m0; last && r < m0 + mr; r += kMaxRows)
          pass.store(acc + r * kPanel, int(std::min<int64_t>(kMaxRows, m0 + mr - r)), r, n0, nvalid, ep);
      }
    }
  }
}

// Number of k blocks of the streaming schedule: the packed x holds [blocks][M][kXRow<T>].
template <typename T>
int64_t stream_blocks(int64_t K) {
  const int64_t steps = sizeof(T) == 2 ? (K + 1) / 2 : K;
  return (steps + kBlockSteps<T> - 1) / kBlockSteps<T>;
}

// Where a tile's sums go after a k block: into `sums` (rows kPanel apart), or, when `ep` is set (the
// last k block, an activation act512 has), through the epilogue straight from the registers into the
// output rows m0.. and columns [n0, n0 + nvalid).
struct TileOut {
  float* sums;
  const Epilogue* ep;
  int64_t m0, n0, nvalid;
  const float* const* terms = nullptr;  // the rows' LoRA terms computed beforehand (lora_terms_rows; null: none)
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
    __m512 ys[3] = {_mm512_add_ps(acc[r][0], b[0]), _mm512_add_ps(acc[r][1], b[1]), _mm512_add_ps(acc[r][2], b[2])};
    if (to.terms == nullptr)
      lora_add48(ep.lora, to.m0 + r, to.n0, mk, ys);
    else
      lora_add48_terms(to.terms[r], mk, ys);
    for (int v = 0; v < 3; ++v) {
      __m512 y = act512<ACT>(ys[v]);
      if (rr != nullptr) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mk[v], rr + 16 * v));
      _mm512_mask_storeu_ps(out + r * ep.ldo + 16 * v, mk[v], y);
    }
  }
}

#endif

// ---- each regime's entry point: the claimed panels (streaming, AMX) or one item (blocked) of a call ----

// Blocked, fp32, portable (linear_blocked.cpp): output rows [r0, r0 + rows) x panels [p0, p1).
void linear_blocked_generic(const float* x, int64_t ldx, const float* packed, int64_t N, int64_t K, const Epilogue& ep,
                            int64_t r0, int64_t rows, int64_t p0, int64_t p1);
// Streaming, every tier (linear_stream.cpp: portable and AVX-512; linear_stream_avx2.cpp).
template <typename T>
void linear_stream_generic(const T* x, int64_t ldx, const T* packed, int64_t M, int64_t N, int64_t K,
                           const Epilogue& ep, MeetInTheMiddle::Walker& panels);
#if BF_X86
template <typename T>
BF_TARGET_AVX512BF16 void linear_stream_avx512(const T* x, int64_t ldx, const T* packed, int64_t M, int64_t N,
                                               int64_t K, const Epilogue& ep, MeetInTheMiddle::Walker& panels);
template <typename T>
BF_TARGET_AVX2 void linear_stream_avx2(const T* x, int64_t ldx, const T* packed, int64_t M, int64_t N, int64_t K,
                                       const Epilogue& ep, MeetInTheMiddle::Walker& panels);
// Blocked, fp32 on AVX-512 (linear_blocked.cpp): output rows [r0, r0 + rows) x panels [p0, p1) of an M-row output.
BF_TARGET_AVX512 void linear_blocked_f32(const float* x, int64_t ldx, const float* packed, int64_t M, int64_t N,
                                         int64_t K, const Epilogue& ep, int64_t r0, int64_t rows, int64_t p0,
                                         int64_t p1);
// Blocked, bf16 on AVX-512 without AVX-512 BF16 (linear_blocked.cpp): operands widened to fp32 per k block.
BF_TARGET_AVX512 void linear_blocked_bf16(const bf16* x, int64_t ldx, const bf16* packed, int64_t N, int64_t K,
                                          const Epilogue& ep, int64_t r0, int64_t rows, int64_t p0, int64_t p1);
// AMX, bf16 with K a multiple of kAmxK (linear_amx.cpp); the same kernel with the tiles emulated
// (linear_amx.cpp built with BF_AMX_EMULATED, the amx_emulated tier).
BF_TARGET_AMX void linear_amx(const bf16* x, int64_t ldx, const bf16* packed, int64_t M, int64_t N, int64_t K,
                              const Epilogue& ep, MeetInTheMiddle::Walker& panels);
BF_TARGET_AVX512 void linear_amx_emulated(const bf16* x, int64_t ldx, const bf16* packed, int64_t M, int64_t N,
                                          int64_t K, const Epilogue& ep, MeetInTheMiddle::Walker& panels);
// AMX blocked (linear_amx.cpp, amx_gemm.h): output rows [r0, r0 + rows) x panels [p0, p1), bit-identical to
// linear_amx; and with the tiles emulated. linear_amx_blocked_gemm (amx_gemm.cpp) runs a whole call on nt threads.
BF_TARGET_AMX void linear_amx_blocked(const bf16* x, int64_t ldx, const bf16* packed, int64_t N, int64_t K,
                                      const Epilogue& ep, int64_t r0, int64_t rows, int64_t p0, int64_t p1);
BF_TARGET_AVX512 void linear_amx_blocked_emulated(const bf16* x, int64_t ldx, const bf16* packed, int64_t N,
                                                  int64_t K, const Epilogue& ep, int64_t r0, int64_t rows,
                                                  int64_t p0, int64_t p1);
void linear_amx_blocked_gemm(const bf16* x, int64_t ldx, const bf16* packed, int64_t M, int64_t N, int64_t K,
                             const Epilogue& ep, int nt, bool emulated);
#endif

}  // namespace linear_detail
}  // namespace cpu
}  // namespace bertfast
