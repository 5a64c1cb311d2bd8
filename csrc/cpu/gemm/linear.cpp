// GEMM on prepacked weights: out = act(x w^T + bias) + residual.
//
// At small M (a handful of tokens) a linear layer is bound by reading its weights once from memory; the
// packed layout makes that read one sequential stream per panel of kPanel output columns, and threads
// share the panels out so that each streams one contiguous stretch (MeetInTheMiddle, parallel.h). With
// more rows the same panels feed a compute-bound blocked GEMM (fp32: linear_blocked_f32 on AVX-512,
// linear_blocked_generic on the portable tier; bf16 on AVX-512 without AVX-512 BF16: linear_blocked_bf16);
// the AVX2 kernel streams at every M.
// fp32 weights: [panels][K][kPanel]. bf16 weights: [panels][ceil(K/2)][kPanel][2], pairs along K as
// AVX-512 BF16 dot products (vdpbf16ps) and AMX tiles want them. Accumulation is fp32; bias, activation and
// residual are applied to the fp32 accumulator and the result is rounded once.
//
// The files: linear_pack.cpp (the packed layout), linear_stream.cpp and linear_stream_avx2.cpp (streaming,
// small M), linear_blocked.cpp (larger M: fp32 on AVX-512 and portable, widened bf16), linear_amx.cpp (bf16 on
// AMX tiles); this one chooses (choose_gemm) and dispatches.
#include <omp.h>

#include <algorithm>
#include <cstdlib>

#include "cpu/gemm/amx_gemm.h"
#include "cpu/gemm/linear_impl.h"

namespace bertfast {
namespace cpu {

using namespace linear_detail;

namespace {

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

}  // namespace

const char* gemm_path_name(GemmPath path) {
  switch (path) {
    case GemmPath::StreamPortable: return "StreamPortable";
    case GemmPath::StreamAvx2: return "StreamAvx2";
    case GemmPath::StreamAvx512: return "StreamAvx512";
    case GemmPath::BlockedPortable: return "BlockedPortable";
    case GemmPath::BlockedAvx512: return "BlockedAvx512";
    case GemmPath::BlockedBf16: return "BlockedBf16";
    case GemmPath::AmxStream: return "AmxStream";
    case GemmPath::AmxStreamEmulated: return "AmxStreamEmulated";
    case GemmPath::AmxBlocked: return "AmxBlocked";
    case GemmPath::AmxBlockedEmulated: return "AmxBlockedEmulated";
  }
  return "?";
}

// The one rule. Batch invariance: M chooses only between kernels of one tier that give a row the same bits whatever
// M (streaming and blocked sum the same k blocks in the same order, each from zero, with the same epilogue:
// docs/cpu-gemm.md#batch-invariance). Thresholds: past kPackPasses passes of kMaxRows rows (portable fp32:
// kPortablePackPasses) the blocked regime where the tier has one (fp32 on AVX-512 and portable, bf16 on AVX-512
// without AVX-512 BF16; AVX2 streams at every M); bf16 with K % kAmxK == 0 on the AMX tiers, blocked from
// amx_blocked's rows.
GemmPath choose_gemm(const GemmCall& c) {
  if (c.bf16 && amx_kernels(c.isa) && c.k % kAmxK == 0) {
    const bool emulated = c.isa == Isa::AmxEmulated;
    if (amx_blocked(c.m, false, c.amx_mode)) return emulated ? GemmPath::AmxBlockedEmulated : GemmPath::AmxBlocked;
    return emulated ? GemmPath::AmxStreamEmulated : GemmPath::AmxStream;
  }
  const int64_t passes = (c.m + kMaxRows - 1) / kMaxRows;
  if (!c.bf16 && c.isa >= Isa::Avx512Vnni && passes > kPackPasses) return GemmPath::BlockedAvx512;
  if (!c.bf16 && c.isa == Isa::Portable && passes > kPortablePackPasses) return GemmPath::BlockedPortable;
  if (c.bf16 && c.isa == Isa::Avx512Vnni && !c.avx512_bf16 && passes > kPackPasses) return GemmPath::BlockedBf16;
  if (c.isa >= Isa::Avx512Vnni) return GemmPath::StreamAvx512;
  return c.isa == Isa::Avx2 ? GemmPath::StreamAvx2 : GemmPath::StreamPortable;
}

// The GEMM of linear_packed / linear_packed_wide: its path, threads and items; `ep` says where results go.
template <typename T>
void run_linear(const T* x, int64_t ldx, const T* packed, int64_t m, int64_t n, int64_t k, const Epilogue& call) {
  if (m == 0 || n == 0) return;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int nt = int(std::min<int64_t>(panels, threads_for(m * n * k / 4)));
  const GemmPath path = choose_gemm({sizeof(T) == 2, m, k, active_isa(), has_avx512_bf16(), amx_gemm()});
  const LoraTerm lora = call.lora != nullptr ? lora_tile_rows(*call.lora, on_tiles(path), m, n) : LoraTerm{};
  Epilogue ep = call;
  if (call.lora != nullptr) ep.lora = &lora;
  switch (path) {
    case GemmPath::AmxBlocked:
    case GemmPath::AmxBlockedEmulated:
#if BF_X86
      if constexpr (sizeof(T) == 2)
        return linear_amx_blocked_gemm(x, ldx, packed, m, n, k, ep, nt, path == GemmPath::AmxBlockedEmulated);
#endif
      std::abort();  // choose_gemm gives the AMX paths to bf16 operands on x86 only
    case GemmPath::BlockedPortable:
    case GemmPath::BlockedAvx512:
    case GemmPath::BlockedBf16: {
      const BlockedItems items(m, panels, nt);
      parallel_for(nt, items.count(), [&](int64_t i) {
        const int64_t rb = i / items.runs, run = i % items.runs, r0 = rb * items.rows_per;
        const int64_t rows = std::min(items.rows_per, m - r0);
        const int64_t q0 = items.first_panel(run), q1 = items.first_panel(run + 1);
        if constexpr (sizeof(T) == 2) {
#if BF_X86
          linear_blocked_bf16(x, ldx, packed, n, k, ep, r0, rows, q0, q1);
#endif
        } else {
#if BF_X86
          if (path == GemmPath::BlockedAvx512) return linear_blocked_f32(x, ldx, packed, m, n, k, ep, r0, rows, q0, q1);
#endif
          linear_blocked_generic(x, ldx, packed, n, k, ep, r0, rows, q0, q1);
        }
      });
      return;
    }
    default:
      break;
  }
  // Streaming: one part per thread, each a contiguous stretch of panels, meeting its partner's.
  const MeetInTheMiddle shared(panels, nt);
  parallel_for(nt, nt, [&](int64_t part) {
    MeetInTheMiddle::Walker mine = shared.walker(int(part));
    switch (path) {
#if BF_X86
      case GemmPath::AmxStream:
      case GemmPath::AmxStreamEmulated:
        if constexpr (sizeof(T) == 2) {
          path == GemmPath::AmxStream ? linear_amx(x, ldx, packed, m, n, k, ep, mine)
                                      : linear_amx_emulated(x, ldx, packed, m, n, k, ep, mine);
          return;
        }
        std::abort();
      case GemmPath::StreamAvx512:
        return linear_stream_avx512(x, ldx, packed, m, n, k, ep, mine);
      case GemmPath::StreamAvx2:
        return linear_stream_avx2(x, ldx, packed, m, n, k, ep, mine);
#endif
      default:
        return linear_stream_generic(x, ldx, packed, m, n, k, ep, mine);
    }
  });
}

template <typename T>
void linear_packed(const T* x, int64_t ldx, const T* packed, const T* bias, const T* residual, int64_t ldr,
                    int64_t m, int64_t n, int64_t k, Activation act, T* out, int64_t ldo, const LoraTerm* lora) {
  run_linear<T>(x, ldx, packed, m, n, k, Epilogue{bias, residual, ldr, act, out, ldo, false, lora});
}

void linear_packed_wide(const bf16* x, int64_t ldx, const bf16* packed, const bf16* bias, const float* residual,
                        int64_t ldr, int64_t m, int64_t n, int64_t k, Activation act, float* out, int64_t ldo,
                        const LoraTerm* lora) {
  run_linear<bf16>(x, ldx, packed, m, n, k, Epilogue{bias, residual, ldr, act, out, ldo, true, lora});
}

template void linear_packed<float>(const float*, int64_t, const float*, const float*, const float*, int64_t,
                                    int64_t, int64_t, int64_t, Activation, float*, int64_t, const LoraTerm*);
template void linear_packed<bf16>(const bf16*, int64_t, const bf16*, const bf16*, const bf16*, int64_t, int64_t,
                                   int64_t, int64_t, Activation, bf16*, int64_t, const LoraTerm*);

}  // namespace cpu
}  // namespace bertfast
