// Run-time ISA selection for the CPU kernels: the best the CPU supports, overridable for tests and by
// the BERTFAST_CPU_ISA environment variable ("generic" or "avx512").
#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common.h"

#if BF_X86 && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace bertfast {
namespace cpu {

bool isa_supported(Isa isa) {
  if (isa == Isa::Generic) return true;
#if BF_X86
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2");
  return avx512;
#else
  return false;
#endif
}

bool has_avx512_bf16() {
#if BF_X86
  static const bool bf = isa_supported(Isa::Avx512) && __builtin_cpu_supports("avx512bf16");
  return bf;
#else
  return false;
#endif
}

bool amx_tiles_permitted() {
#if BF_X86 && defined(__linux__)
  // Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA);
  // asked once per process, for every AMX kernel (bf16 and int8).
  static const bool permitted = [] {
    if (!__builtin_cpu_supports("amx-tile")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}

bool amx_bf16_usable() {
#if BF_X86
  static const bool usable = has_avx512_bf16() && __builtin_cpu_supports("amx-bf16") && amx_tiles_permitted();
  return usable;
#else
  return false;
#endif
}

static Isa initial_isa() {
  const char* env = std::getenv("BERTFAST_CPU_ISA");
  if (env != nullptr && std::strcmp(env, "generic") == 0) return Isa::Generic;
  return isa_supported(Isa::Avx512) ? Isa::Avx512 : Isa::Generic;
}

static std::atomic<int>& isa_state() {
  static std::atomic<int> state{static_cast<int>(initial_isa())};
  return state;
}

Isa active_isa() { return static_cast<Isa>(isa_state().load(std::memory_order_relaxed)); }

bool set_isa(Isa isa) {
  if (!isa_supported(isa)) return false;
  isa_state().store(static_cast<int>(isa));
  return true;
}

static std::atomic<bool>& amx_state() {
  static std::atomic<bool> state{[] {
    const char* env = std::getenv("BERTFAST_CPU_AMX");
    return !(env != nullptr && std::strcmp(env, "0") == 0);
  }()};
  return state;
}

bool amx_enabled() { return amx_state().load(std::memory_order_relaxed); }
void set_amx_enabled(bool enabled) { amx_state().store(enabled); }

int num_threads() { return omp_get_max_threads(); }

}  // namespace cpu
}  // namespace bertfast
