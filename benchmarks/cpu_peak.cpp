// Arithmetic ceilings of this CPU: how many multiply-adds per second one core, and every core at once, retires
// of each instruction the native kernels' inner loops are made of. Built and run by bench_peak.py.
//
// Each loop runs 12 independent accumulators (more than latency x issue width on current x86 cores), so it is
// bound by issue rate alone; inline asm keeps them in registers (GCC's intrinsics for vpdpbusd copy the
// accumulator on each step). Prints one line per (instruction, threads): name, threads, ops/s (a multiply-add
// counts as 2 ops), instructions/ns per thread.
//
// AMX rows: the same 12 steps a loop, as tdpbf16ps / tdpbssd on full 16 x 64-byte tiles (16 x 16 x 32 bf16 or
// 16 x 16 x 64 int8 multiply-adds each) into 6 accumulator tiles (tmm0-5, 6 x 16 cycles between dependent steps,
// more than the instruction's latency) from an A and a B tile that stay put (tmm6, tmm7): the TMUL unit's rate with
// no tile loads, the ceiling of the AMX GEMMs (csrc/cpu/gemm/amx_gemm.h). Listed as missing where the CPU lacks the
// tiles or Linux does not grant this process their state.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

namespace {

using Clock = std::chrono::steady_clock;

// Runs body(iterations) in every thread at once until `seconds` of wall time; returns instructions per ns per
// thread (12 instructions per iteration).
template <typename Body>
double rate(int threads, double seconds, Body body) {
  const long step = 1 << 20;
  double per_ns = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : per_ns)
  {
    body(step / 16);  // warm up: clocks and the AVX-512 license settle
#pragma omp barrier
    const auto t0 = Clock::now();
    long done = 0;
    double ns = 0.0;
    do {
      body(step);
      done += step;
      ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
    } while (ns < seconds * 1e9);
    per_ns = 12.0 * done / ns;
  }
  return per_ns / threads;
}

#define BF_TWELVE(OP) OP(a0) OP(a1) OP(a2) OP(a3) OP(a4) OP(a5) OP(a6) OP(a7) OP(a8) OP(a9) OP(a10) OP(a11)

// One loop per instruction: 12 steps of BF_STEP_<NAME> an iteration on REG accumulators.
#define BF_LOOP(NAME, TARGET, REG, ZERO)                                                           \
  __attribute__((target(TARGET), noinline)) void NAME(long n) {                                   \
    REG a0 = ZERO, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0, \
        a10 = a0, a11 = a0, x = a0, w = a0;                                                        \
    asm volatile("" : "+v"(x), "+v"(w));                                                           \
    for (long i = 0; i < n; ++i) {                                                                 \
      BF_TWELVE(BF_STEP_##NAME)                                                                    \
    }                                                                                              \
    asm volatile("" ::"v"(a0), "v"(a1), "v"(a2), "v"(a3), "v"(a4), "v"(a5), "v"(a6), "v"(a7),      \
                 "v"(a8), "v"(a9), "v"(a10), "v"(a11));                                            \
  }

#define BF_STEP_fma_zmm(a) asm("vfmadd231ps %1, %2, %0" : "+v"(a) : "v"(x), "v"(w));
#define BF_STEP_fma_ymm(a) asm("vfmadd231ps %1, %2, %0" : "+x"(a) : "x"(x), "x"(w));
#define BF_STEP_vnni_zmm(a) asm("vpdpbusd %1, %2, %0" : "+v"(a) : "v"(x), "v"(w));
// AVX-VNNI (the avx2 tier's int8 kernel where the CPU has it): the VEX form on ymm.
#define BF_STEP_vnni_ymm(a) asm("%{vex%} vpdpbusd %1, %2, %0" : "+x"(a) : "x"(x), "x"(w));
#define BF_STEP_bf16_zmm(a) asm("vdpbf16ps %1, %2, %0" : "+v"(a) : "v"(x), "v"(w));
// The avx2 tier's int8 step: int16 pairs multiplied and summed (vpmaddwd), then accumulated (vpaddd): two
// instructions for 16 multiply-adds, counted as one step here.
#define BF_STEP_maddwd_ymm(a) \
  asm("vpmaddwd %1, %2, %%ymm15\n\tvpaddd %%ymm15, %0, %0" : "+x"(a) : "x"(x), "x"(w) : "xmm15");

BF_LOOP(fma_zmm, "avx512f", __m512, _mm512_setzero_ps())
BF_LOOP(fma_ymm, "avx2,fma", __m256, _mm256_setzero_ps())
BF_LOOP(vnni_zmm, "avx512f,avx512vnni", __m512i, _mm512_setzero_si512())
BF_LOOP(vnni_ymm, "avx2,avxvnni", __m256i, _mm256_setzero_si256())
BF_LOOP(bf16_zmm, "avx512f,avx512bf16", __m512, _mm512_setzero_ps())
BF_LOOP(maddwd_ymm, "avx2", __m256i, _mm256_setzero_si256())

// AMX: palette 1, tmm0-7 all 16 rows x 64 bytes, configured per thread (tile state is per thread) on each call.
struct alignas(64) TileConfig {
  unsigned char palette, start_row, reserved[14];
  unsigned short colsb[16];
  unsigned char rows[16];
};

#define BF_AMX_TWELVE(INSN)                                                                              \
  asm volatile(INSN " %%tmm7, %%tmm6, %%tmm0\n\t" INSN " %%tmm7, %%tmm6, %%tmm1\n\t" INSN               \
               " %%tmm7, %%tmm6, %%tmm2\n\t" INSN " %%tmm7, %%tmm6, %%tmm3\n\t" INSN                     \
               " %%tmm7, %%tmm6, %%tmm4\n\t" INSN " %%tmm7, %%tmm6, %%tmm5\n\t" INSN                     \
               " %%tmm7, %%tmm6, %%tmm0\n\t" INSN " %%tmm7, %%tmm6, %%tmm1\n\t" INSN                     \
               " %%tmm7, %%tmm6, %%tmm2\n\t" INSN " %%tmm7, %%tmm6, %%tmm3\n\t" INSN                     \
               " %%tmm7, %%tmm6, %%tmm4\n\t" INSN " %%tmm7, %%tmm6, %%tmm5" ::: "memory")

#define BF_AMX_LOOP(NAME, INSN)                                                       \
  __attribute__((noinline)) void NAME(long n) {                                       \
    TileConfig cfg{};                                                                 \
    cfg.palette = 1;                                                                  \
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;                  \
    asm volatile("ldtilecfg %0" ::"m"(cfg));                                          \
    asm volatile(                                                                     \
        "tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3\n\t" \
        "tilezero %%tmm4\n\ttilezero %%tmm5\n\ttilezero %%tmm6\n\ttilezero %%tmm7" ::);     \
    for (long i = 0; i < n; ++i) BF_AMX_TWELVE(INSN);                                 \
    asm volatile("tilerelease" ::);                                                   \
  }

BF_AMX_LOOP(amx_bf16, "tdpbf16ps")
BF_AMX_LOOP(amx_int8, "tdpbssd")

// The CPU has the tiles (and the instruction) and Linux grants this process their state (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, once per process; without it the first tile instruction faults).
bool amx_usable(bool feature) {
  if (!feature || !__builtin_cpu_supports("amx-tile")) return false;
#ifdef SYS_arch_prctl
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

struct Kind {
  const char* name;  // instruction and what it multiplies
  bool supported;    // by this CPU
  int macs;          // multiply-adds per instruction (step)
  void (*body)(long);
};

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 0.5;
  const int all = omp_get_max_threads();
  __builtin_cpu_init();
  const Kind kinds[] = {
      {"fp32 FMA zmm (vfmadd231ps)", __builtin_cpu_supports("avx512f") != 0, 16, fma_zmm},
      {"fp32 FMA ymm (vfmadd231ps)", __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), 8, fma_ymm},
      {"int8 VNNI zmm (vpdpbusd)", __builtin_cpu_supports("avx512vnni") != 0, 64, vnni_zmm},
      {"bf16 dot zmm (vdpbf16ps)", __builtin_cpu_supports("avx512bf16") != 0, 32, bf16_zmm},
      {"int16 madd ymm (vpmaddwd+vpaddd)", __builtin_cpu_supports("avx2") != 0, 16, maddwd_ymm},
      {"int8 VNNI ymm (AVX-VNNI vpdpbusd)", __builtin_cpu_supports("avxvnni") != 0, 32, vnni_ymm},
      {"bf16 AMX tile (tdpbf16ps)", amx_usable(__builtin_cpu_supports("amx-bf16")), 16 * 16 * 32, amx_bf16},
      {"int8 AMX tile (tdpbssd)", amx_usable(__builtin_cpu_supports("amx-int8")), 16 * 16 * 64, amx_int8},
  };
  for (const Kind& k : kinds) {
    if (!k.supported) {
      std::printf("%s\tmissing\n", k.name);
      continue;
    }
    for (int threads : {1, all}) {
      const double per_ns = rate(threads, seconds, k.body);
      std::printf("%s\t%d\t%.4g\t%.3f\n", k.name, threads, 2.0 * k.macs * per_ns * 1e9 * threads, per_ns);
      if (all == 1) break;
    }
  }
  return 0;
}
