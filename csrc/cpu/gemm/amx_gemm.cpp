// The AMX GEMMs' kernel choice (BERTFAST_AMX_GEMM, set_amx_gemm: amx_gemm.h) and the bf16 blocked kernel's call: its
// work items (a block of rows x a run of units) shared out to the threads (amx_for_items; int8's: int8_linear.cpp).
#include "cpu/gemm/amx_gemm.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cpu/gemm/linear_impl.h"

namespace bertfast {
namespace cpu {

namespace {

constexpr const char* kNames[] = {"auto", "stream", "blocked"};

AmxGemm initial_mode() {
  AmxGemm mode = AmxGemm::Auto;
  const char* env = std::getenv("BERTFAST_AMX_GEMM");
  if (env != nullptr && *env != '\0' && !parse_amx_gemm(env, &mode))
    std::fprintf(stderr, "bertfast: BERTFAST_AMX_GEMM=%s is none of auto, stream, blocked: using auto\n", env);
  return mode;
}

std::atomic<int>& mode_state() {
  static std::atomic<int> state{static_cast<int>(initial_mode())};
  return state;
}

// steps, rows and stage in one word (stage at bit 48), so a reader never sees half of a change.
constexpr int64_t kStageBit = int64_t(1) << 48;

int64_t blocking_word(int64_t steps, int64_t rows, bool stage) { return steps << 32 | rows | (stage ? kStageBit : 0); }

std::atomic<int64_t>& blocking_state() {
  static std::atomic<int64_t> state{
      blocking_word(kAmxDefaultBlocking.steps, kAmxDefaultBlocking.rows, kAmxDefaultBlocking.stage)};
  return state;
}

}  // namespace

AmxBlocking amx_blocking() {
  const int64_t v = blocking_state().load(std::memory_order_relaxed);
  return {(v >> 32) & 0xffff, v & 0xffffffff, (v & kStageBit) != 0};
}

bool set_amx_blocking(int64_t steps, int64_t rows, bool stage) {
  if (steps < 1 || steps > 64 || rows < kAmxPairRows || rows > kAmxMaxItemRows || rows % kAmxPairRows) return false;
  blocking_state().store(blocking_word(steps, rows, stage));
  return true;
}

AmxGemm amx_gemm() { return static_cast<AmxGemm>(mode_state().load(std::memory_order_relaxed)); }

void set_amx_gemm(AmxGemm mode) { mode_state().store(static_cast<int>(mode)); }

bool parse_amx_gemm(const char* name, AmxGemm* mode) {
  for (int i = 0; i < 3; ++i) {
    if (std::strcmp(name, kNames[i]) == 0) {
      *mode = static_cast<AmxGemm>(i);
      return true;
    }
  }
  return false;
}

const char* amx_gemm_name(AmxGemm mode) { return kNames[static_cast<int>(mode)]; }

#if BF_X86
namespace linear_detail {

void linear_amx_blocked_gemm(const bf16* x, int64_t ldx, const bf16* packed, int64_t M, int64_t N, int64_t K,
                             const Epilogue& ep, int nt, bool emulated) {
  amx_for_items(M, (N + kPanel - 1) / kPanel, nt, [&](int64_t r0, int64_t rows, int64_t p0, int64_t p1) {
    emulated ? linear_amx_blocked_emulated(x, ldx, packed, N, K, ep, r0, rows, p0, p1)
             : linear_amx_blocked(x, ldx, packed, N, K, ep, r0, rows, p0, p1);
  });
}

}  // namespace linear_detail
#endif

}  // namespace cpu
}  // namespace bertfast
