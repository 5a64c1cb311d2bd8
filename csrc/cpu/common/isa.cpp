// Run-time ISA tiers for the CPU kernels: the best tier the CPU supports, capped by the BERTFAST_ISA
// environment variable or by set_isa (tests and benchmarks). This file owns the tier state and the one parse of
// BERTFAST_ISA (read once, when the extension first dispatches); Python reads both through `_C`.
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu/common/isa.h"

#if BF_X86 && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace bertfast {
namespace cpu {

namespace {
constexpr const char* kNames[] = {"portable", "avx2", "avx512_vnni", "amx_emulated", "amx"};
constexpr int kTiers = sizeof(kNames) / sizeof(kNames[0]);
}

const char* isa_name(Isa isa) { return kNames[static_cast<int>(isa)]; }

bool parse_isa(const char* name, Isa* isa) {
  for (int i = 0; i < kTiers; ++i) {
    if (std::strcmp(name, kNames[i]) == 0) {
      *isa = static_cast<Isa>(i);
      return true;
    }
  }
  return false;
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

Isa detected_isa() {
#if BF_X86
  static const Isa best = [] {
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("avx512vnni");
    const bool amx = avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("amx-bf16") &&
                     __builtin_cpu_supports("amx-int8") && amx_tiles_permitted();
    return amx ? Isa::Amx : avx512 ? Isa::Avx512Vnni : avx2 ? Isa::Avx2 : Isa::Portable;
  }();
  return best;
#else
  return Isa::Portable;
#endif
}

// The cap below avx512_vnni's full feature set: the tier without AVX-512 BF16, as on a CPU (or a hypervisor)
// that lacks it. BERTFAST_ISA names it; the kernels' tier is avx512_vnni.
constexpr const char* kNoBf16Cap = "avx512_vnni-nobf16";
// What BERTFAST_ISA takes, lowest to highest (bertfast/backends/cpu/isa.py's CAPS, tested to agree).
constexpr const char* kCaps[] = {"portable", "avx2", kNoBf16Cap, "avx512_vnni", "amx_emulated", "amx"};

namespace {
// BERTFAST_ISA as read once: `name` the cap ("" when unset or blank), surrounding blanks dropped; `known` false for a
// name that is no cap (the kernels then run uncapped and `requested_cap` raises).
struct EnvCap {
  std::string name;
  bool known = true;
};

const EnvCap& env_cap() {
  static const EnvCap cap = [] {
    EnvCap c;
    const char* env = std::getenv("BERTFAST_ISA");
    std::string value = env != nullptr ? env : "";
    const auto blank = [](char ch) { return std::isspace(static_cast<unsigned char>(ch)) != 0; };
    while (!value.empty() && blank(value.back())) value.pop_back();
    size_t first = 0;
    while (first < value.size() && blank(value[first])) ++first;
    c.name = value.substr(first);
    if (c.name.empty()) return c;
    c.known = false;
    for (const char* name : kCaps) c.known |= c.name == name;
    return c;
  }();
  return cap;
}
}  // namespace

const char* requested_cap() {
  const EnvCap& cap = env_cap();
  if (!cap.known) {
    std::string expected;
    for (const char* name : kCaps) expected += (expected.empty() ? "" : ", ") + std::string(name);
    throw std::invalid_argument("BERTFAST_ISA='" + cap.name + "' is not an ISA tier; expected one of " + expected);
  }
  return cap.name.c_str();
}

static bool bf16_hidden_by_env() { return env_cap().name == kNoBf16Cap; }

static bool cpu_has_avx512_bf16() {
#if BF_X86
  static const bool bf = detected_isa() >= Isa::Avx512Vnni && __builtin_cpu_supports("avx512bf16");
  return bf;
#else
  return false;
#endif
}

bool isa_supported(Isa isa) {
  // The emulated tiles run inside the AMX kernels' own code, compiled for AVX-512 (F/BW/VL/DQ) and VNNI: their two
  // bf16 conversions are emulated too (amx_tiles.h), so a CPU without AVX-512 BF16 runs them as well.
  if (isa == Isa::AmxEmulated) return isa_supported(Isa::Avx512Vnni);
  return isa <= detected_isa();
}

static std::atomic<bool>& bf16_state() {
  static std::atomic<bool> state{cpu_has_avx512_bf16() && !bf16_hidden_by_env()};
  return state;
}

bool has_avx512_bf16() { return bf16_state().load(std::memory_order_relaxed); }

static bool cpu_has_avx_vnni() {
#if BF_X86
  static const bool vnni = isa_supported(Isa::Avx2) && __builtin_cpu_supports("avxvnni");
  return vnni;
#else
  return false;
#endif
}

static std::atomic<bool>& avx_vnni_state() {
  static std::atomic<bool> state{cpu_has_avx_vnni()};
  return state;
}

bool has_avx_vnni() { return avx_vnni_state().load(std::memory_order_relaxed); }

bool set_avx_vnni(bool enabled) {
  if (enabled && !cpu_has_avx_vnni()) return false;
  avx_vnni_state().store(enabled);
  return true;
}

static Isa initial_isa() {
  Isa cap = Isa::Amx;
  const EnvCap& env = env_cap();
  // An unknown name runs uncapped here; `requested_cap` raises for it (bertfast refuses to import with it).
  if (bf16_hidden_by_env()) {
    cap = Isa::Avx512Vnni;
  } else if (env.known && !env.name.empty()) {
    parse_isa(env.name.c_str(), &cap);
  }
  // amx_emulated is a choice, not only a cap: it runs where supported, above a detected avx512_vnni too.
  if (cap == Isa::AmxEmulated && isa_supported(cap)) return cap;
  return cap < detected_isa() ? cap : detected_isa();
}

static std::atomic<int>& isa_state() {
  static std::atomic<int> state{static_cast<int>(initial_isa())};
  return state;
}

Isa active_isa() { return static_cast<Isa>(isa_state().load(std::memory_order_relaxed)); }

// With AVX-512 BF16 hidden on a CPU that has it the amx tiers are refused (their bf16 is native); on a CPU without
// it, amx_emulated runs as it is.
bool set_isa(Isa isa) {
  if (!isa_supported(isa) || (amx_kernels(isa) && cpu_has_avx512_bf16() && !has_avx512_bf16())) return false;
  isa_state().store(static_cast<int>(isa));
  return true;
}

bool set_avx512_bf16(bool enabled) {
  if (enabled && !cpu_has_avx512_bf16()) return false;
  // Under the amx tiers it stays where the CPU has it (cap the tier first); where the CPU lacks it, it is off already.
  if (!enabled && amx_kernels(active_isa()) && cpu_has_avx512_bf16()) return false;
  bf16_state().store(enabled);
  return true;
}

}  // namespace cpu
}  // namespace bertfast
