// ISA tiers: detection and cap (isa.cpp), per-function target attributes, BF_DISPATCH, the denormal guard.
//
// Kernels are written once as always-inline templates over the element type and instantiated per tier:
// inside a function marked with the tier's BF_TARGET_* attribute (GCC compiles it for that ISA) and inside
// a plain function (the portable fallback: the baseline ISA of the build, e.g. SSE2 on x86-64 or NEON on
// aarch64). Which one runs is chosen at run time from the CPU's features (`active_isa`).
#pragma once

#include "cpu/common/types.h"

// BERTFAST_PORTABLE_ONLY builds the portable kernels alone (what a non-x86 build compiles).
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(BERTFAST_PORTABLE_ONLY)
#include <immintrin.h>
#endif

namespace bertfast {
namespace cpu {

// ISA tiers, lowest to highest; each tier's kernels need the features of the tiers below it too.
//   Portable:   the build's baseline (SSE2 on x86-64, NEON on aarch64), plain loops the compiler vectorizes.
//   Avx2:       AVX2 + FMA (+ F16C, BMI2).
//   Avx512Vnni: AVX-512 F/BW/VL/DQ + VNNI; AVX-512 BF16 used where present.
//   AmxEmulated: the Amx tier's kernels with the tile instructions emulated (amx_tiles.h, amx_emulation.cpp) on a
//               CPU with Avx512Vnni (AVX-512 BF16 not needed): slow, for tests of the AMX code on CPUs without
//               AMX. Never detected; only BERTFAST_ISA=amx_emulated or set_isa select it.
//   Amx:        the above + AVX-512 BF16 + AMX tiles (bf16, int8), granted by the OS.
enum class Isa : int { Portable = 0, Avx2 = 1, Avx512Vnni = 2, AmxEmulated = 3, Amx = 4 };

// Whether the tier runs the AMX kernels (on tiles, or emulated).
inline bool amx_kernels(Isa isa) { return isa == Isa::Amx || isa == Isa::AmxEmulated; }

// The best tier this CPU (and OS) supports (never AmxEmulated).
Isa detected_isa();
// The tier the kernels dispatch to: the detected one, capped by BERTFAST_ISA at load or by set_isa.
Isa active_isa();
// Cap the kernels at `isa` (tests and benchmarks run every lower tier, and amx_emulated); false if the CPU lacks
// it (or, for amx and amx_emulated, AVX-512 BF16 is hidden on a CPU that has it).
bool set_isa(Isa isa);
// Every tier up to the detected one; amx_emulated wherever the CPU has Avx512Vnni.
bool isa_supported(Isa isa);
// The cap BERTFAST_ISA named when the extension first read it (the one parse of it, blanks around the name dropped):
// a tier's name or "avx512_vnni-nobf16", "" when unset. Throws std::invalid_argument (ValueError in Python) naming
// the caps for any other value, under which the kernels run uncapped.
const char* requested_cap();
// The tier named by `name` ("amx", "amx_emulated", "avx512_vnni", "avx2", "portable"); false if no tier has that
// name.
bool parse_isa(const char* name, Isa* isa);
const char* isa_name(Isa isa);
// AVX-512 BF16 dot products (vdpbf16ps), used by the Avx512Vnni tier's bf16 GEMM where present: the CPU
// has them and they are not hidden (BERTFAST_ISA=avx512_vnni-nobf16 at load, or set_avx512_bf16), as a
// hypervisor that masks them would. Hidden, the tier is capped below amx.
bool has_avx512_bf16();
// Hide (false) or restore (true) AVX-512 BF16; false if restoring it where the CPU lacks it, or hiding it while the
// amx or amx_emulated tier is active on a CPU that has it.
bool set_avx512_bf16(bool enabled);
// AVX-VNNI (VEX vpdpbusd on ymm: Alder Lake and later Intel cores, AMD Zen 4 and later), used by the Avx2 tier's
// int8 GEMM where present: exact int32 sums either way, so the output is the same with or without it.
bool has_avx_vnni();
// Hide (false) or restore (true) AVX-VNNI, so tests can compare the two paths; false if the CPU lacks it.
bool set_avx_vnni(bool enabled);
// Whether the CPU has AMX tiles and the OS granted this process their state (requested once).
bool amx_tiles_permitted();

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(BERTFAST_PORTABLE_ONLY)
#define BF_X86 1
// The Avx2 tier's kernels (the portable templates compiled for AVX2 + FMA, and AVX2 intrinsics).
#define BF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#define BF_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2,prefer-vector-width=512")))
#define BF_TARGET_AVX512BF16 \
  __attribute__((target(   \
      "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,bmi2,prefer-vector-width=512")))
// The Avx2 tier's int8 GEMM with AVX-VNNI (VEX vpdpbusd on ymm).
#define BF_TARGET_AVXVNNI __attribute__((target("avx2,fma,f16c,bmi2,avxvnni")))
// The int8 GEMM's VNNI kernels (vpdpbusd).
#define BF_TARGET_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2,prefer-vector-width=512")))
// AMX-BF16 kernels (tiles plus the AVX-512 BF16 code around them).
#define BF_TARGET_AMX                                                                                  \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c," \
                        "bmi2,prefer-vector-width=512")))
// AMX-INT8 kernels (tiles plus the AVX512-VNNI code around them; AMX-BF16 for their LoRA terms).
#define BF_TARGET_AMX_INT8                                                                                          \
  __attribute__((target("amx-tile,amx-int8,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c," \
                        "bmi2,prefer-vector-width=512")))
#else
#define BF_X86 0
#endif

// Dispatch helper: `BF_DISPATCH(name, args)` calls name##_avx512 on the Avx512Vnni tier and above,
// name##_avx2 on Avx2, else name##_generic.
#if BF_X86
#define BF_DISPATCH(name, ...)                                                             \
  (::bertfast::cpu::active_isa() >= ::bertfast::cpu::Isa::Avx512Vnni ? name##_avx512(__VA_ARGS__) \
   : ::bertfast::cpu::active_isa() == ::bertfast::cpu::Isa::Avx2     ? name##_avx2(__VA_ARGS__)   \
                                                                     : name##_generic(__VA_ARGS__))
#else
#define BF_DISPATCH(name, ...) name##_generic(__VA_ARGS__)
#endif

// Flushes denormals to zero (FTZ + DAZ) on this thread while in scope. exp/erfc tails and softmax
// weights of far-away keys produce values near 1e-38, and one denormal operand costs a ~100-cycle
// microcode assist on x86: unguarded, the erf-GELU of a GEMM output ran 5x slower. A flushed value
// is off by less than 1.2e-38 absolute. MXCSR is restored on exit (the threads are shared with torch).
struct DenormalGuard {
#if BF_X86
  unsigned int saved;
  DenormalGuard() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~DenormalGuard() { _mm_setcsr(saved); }
  DenormalGuard(const DenormalGuard&) = delete;
  DenormalGuard& operator=(const DenormalGuard&) = delete;
#else
  DenormalGuard() {}  // other ISAs: the kernels avoid denormals in exp/GELU by clamping instead
#endif
};

}  // namespace cpu
}  // namespace bertfast
