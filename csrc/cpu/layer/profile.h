// Per-stage timers of the native layer, read by `bertfast.profiling` (`bertfast embed --profile`): off unless a
// profile runs, then one steady-clock read before and after each stage of `encoder_layer`. Off, a stage costs one
// relaxed atomic load. The totals are wall time of the calling thread (each stage is one parallel region).
#pragma once

#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace bertfast {
namespace cpu {
namespace profile {

enum Stage : int { kQkv, kAttention, kAttnOut, kLayerNorm, kFfnIn, kFfnOut, kQuantize, kBf16Operands, kStageCount };
// The names `bertfast.profiling` reports these under (the op-by-op path's wrappers use the same ones). bf16 operands:
// the fp32 stream rounded to bf16 for a GEMM (layer.cpp's `operand`; the op-by-op path does it inside its GEMMs).
inline constexpr const char* kStageNames[kStageCount] = {"gemm qkv",    "attention",     "gemm attn-out",
                                                         "layernorm",   "gemm ffn-in",   "gemm ffn-out",
                                                         "quantize rows", "bf16 operands"};

struct Counters {
  std::atomic<int64_t> ns[kStageCount];
  std::atomic<int64_t> calls[kStageCount];
  std::atomic<int64_t> flops[kStageCount];
};

inline std::atomic<bool> g_enabled{false};
inline Counters g_counters{};

inline void reset() {
  for (int s = 0; s < kStageCount; ++s) {
    g_counters.ns[s].store(0, std::memory_order_relaxed);
    g_counters.calls[s].store(0, std::memory_order_relaxed);
    g_counters.flops[s].store(0, std::memory_order_relaxed);
  }
}

// Times its scope into `stage` when profiling is on; `flops`: the multiply-adds x 2 the stage computes.
class Scope {
 public:
  explicit Scope(Stage stage, int64_t flops = 0)
      : stage_(stage), flops_(flops), on_(g_enabled.load(std::memory_order_relaxed)) {
    if (on_) start_ = std::chrono::steady_clock::now();
  }
  ~Scope() {
    if (!on_) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_);
    g_counters.ns[stage_].fetch_add(ns.count(), std::memory_order_relaxed);
    g_counters.calls[stage_].fetch_add(1, std::memory_order_relaxed);
    g_counters.flops[stage_].fetch_add(flops_, std::memory_order_relaxed);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Stage stage_;
  int64_t flops_;
  bool on_;
  std::chrono::steady_clock::time_point start_;
};

// Times its scope into `stage` and out of `outer`, a stage whose parallel region it runs inside (int8's GELU output
// quantized row block by row block inside the FFN-in GEMM): its thread time over the region's threads, as the
// stages count the calling thread's wall time, so that the two add up to the region's.
class Inner {
 public:
  Inner(Stage stage, Stage outer) : stage_(stage), outer_(outer), on_(g_enabled.load(std::memory_order_relaxed)) {
    if (on_) start_ = std::chrono::steady_clock::now();
  }
  ~Inner() {
    if (!on_) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_);
    const int64_t share = ns.count() / omp_get_num_threads();
    g_counters.ns[stage_].fetch_add(share, std::memory_order_relaxed);
    g_counters.ns[outer_].fetch_sub(share, std::memory_order_relaxed);
    g_counters.calls[stage_].fetch_add(1, std::memory_order_relaxed);
  }
  Inner(const Inner&) = delete;
  Inner& operator=(const Inner&) = delete;

 private:
  Stage stage_, outer_;
  bool on_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace profile
}  // namespace cpu
}  // namespace bertfast
