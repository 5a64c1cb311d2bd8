// What bounds the AMX GEMMs (csrc/cpu/gemm/amx_blocked.h): the tile unit's latency and rate, tile loads, and the
// blocked kernel's own step patterns, each timed alone on one core. Built and run by bench_amx_probe.py.
//
// The blocked kernel reaches ~13 ns per tdpbf16ps and ~20 ns per tdpbssd at every M and K on the 2026-12-06 AMX
// host, where the tile unit alone retires one every 4.1 ns (bench_peak.py): these rows say which of latency, the
// loads' source, or a load waiting for the multiply-adds that read its register (the 8 tiles are all in use in a
// 2 x 2 step) takes the rest. Prints one line per probe: name, ns per multiply-add instruction (per load for the
// load rows), instructions timed.
//
// -DBF_AMX_EMULATED=1, linked with csrc/cpu/common/amx_emulation.cpp, runs the same code on emulated tiles (any
// AVX-512 CPU): a check of its tile shapes and addresses (the emulation aborts where the hardware would fault),
// its timings meaningless.
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cpu/common/amx_tiles.h"

namespace {

using namespace bertfast::cpu;
using Clock = std::chrono::steady_clock;

// A: 32 rows x 8 tile steps of 64 bytes, 512 bytes apart (16 KB, L1); B: 8 steps x 3 column groups of one 16-row
// tile each, the bf16 panel's layout (rows 192 bytes apart: 24 KB, L1); far: 1 MB that A walks through in the
// L2 rows (1536 bytes apart, BERT-base's bf16 x rows).
alignas(64) uint8_t a_buf[32 * 512];
alignas(64) uint8_t b_buf[8 * 16 * 192];
alignas(64) uint8_t far_buf[1 << 20];

BF_TARGET_TILES void release() { BF_TILE_RELEASE(); }

BF_TARGET_TILES void configure() {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  BF_TILE_LOADCONFIG(&cfg);
  BF_TILE_ZERO(0);
  BF_TILE_ZERO(1);
  BF_TILE_ZERO(2);
  BF_TILE_ZERO(3);
  BF_TILE_LOADD(4, a_buf, 512);
  BF_TILE_LOADD(5, a_buf + 16 * 512, 512);
  BF_TILE_LOADD(6, b_buf, 192);
  BF_TILE_LOADD(7, b_buf + 64, 192);
}

#define DP_BF16(c, a, b) BF_TILE_DPBF16PS(c, a, b)
#define DP_INT8(c, a, b) BF_TILE_DPBSSD(c, a, b)

// n rounds of N multiply-adds into accumulators tmm0.. (one A and one B tile that stay put): N = 1 is the latency
// of one dependent chain, larger N the rate once N chains overlap.
#define CHAIN(NAME, TARGET, DP, N)                                   \
  TARGET __attribute__((noinline)) long NAME(long n) {               \
    for (long i = 0; i < n; ++i) {                                   \
      DP(0, 6, 7);                                                   \
      if (N > 1) DP(1, 6, 7);                                        \
      if (N > 2) DP(2, 6, 7);                                        \
      if (N > 3) DP(3, 6, 7);                                        \
      if (N > 4) DP(4, 6, 7);                                        \
      if (N > 5) DP(5, 6, 7);                                        \
    }                                                                \
    return n * N;                                                    \
  }
CHAIN(chain1, BF_TARGET_TILES_BF16, DP_BF16, 1)
CHAIN(chain2, BF_TARGET_TILES_BF16, DP_BF16, 2)
CHAIN(chain3, BF_TARGET_TILES_BF16, DP_BF16, 3)
CHAIN(chain4, BF_TARGET_TILES_BF16, DP_BF16, 4)
CHAIN(chain6, BF_TARGET_TILES_BF16, DP_BF16, 6)
CHAIN(chain1_int8, BF_TARGET_TILES_INT8, DP_INT8, 1)
CHAIN(chain4_int8, BF_TARGET_TILES_INT8, DP_INT8, 4)

// Tile loads alone, four registers in turn: from L1 (the B sub-panel) or walking the 1 MB buffer in A's L2 rows.
BF_TARGET_TILES __attribute__((noinline)) long loads_l1(long n) {
  for (long i = 0; i < n; ++i) {
    const uint8_t* b = b_buf + (i & 7) * 16 * 192;
    BF_TILE_LOADD(4, b, 192);
    BF_TILE_LOADD(5, b + 64, 192);
    BF_TILE_LOADD(6, b + 128, 192);
    BF_TILE_LOADD(7, a_buf + (i & 7) * 64, 512);
  }
  return 4 * n;
}

BF_TARGET_TILES __attribute__((noinline)) long loads_l2(long n) {
  const long rows = sizeof(far_buf) / 1536;  // 682 rows of 1536 bytes: 42 row blocks of 16
  for (long i = 0; i < n; ++i) {
    const long block = (i % (rows / 16 - 1)) * 16, step = (i / (rows / 16 - 1)) % 24;
    const uint8_t* p = far_buf + block * 1536 + step * 64;
    BF_TILE_LOADD(4, p, 1536);
    BF_TILE_LOADD(5, p + 16 * 1536, 1536);
  }
  return 2 * n;
}

// Four accumulators, each multiply-add's B operand loaded just before it: into one register (R2 = 6: each load
// waits for the previous reader where tiles are not renamed) or into two in turn (R2 = 7).
#define RELOAD(NAME, R2)                                                  \
  BF_TARGET_TILES_BF16 __attribute__((noinline)) long NAME(long n) {     \
    for (long i = 0; i < n; ++i) {                                        \
      const uint8_t* b = b_buf + (i & 7) * 16 * 192;                      \
      BF_TILE_LOADD(6, b, 192);                                           \
      DP_BF16(0, 4, 6);                                                   \
      BF_TILE_LOADD(R2, b + 64, 192);                                     \
      DP_BF16(1, 4, R2);                                                  \
      BF_TILE_LOADD(6, b + 128, 192);                                     \
      DP_BF16(2, 4, 6);                                                   \
      BF_TILE_LOADD(R2, b_buf + ((i + 1) & 7) * 16 * 192, 192);           \
      DP_BF16(3, 4, R2);                                                  \
    }                                                                     \
    return 4 * n;                                                         \
  }
RELOAD(reload_same, 6)
RELOAD(reload_two, 7)

// The blocked kernel's steps on L1-resident operands (amx_blocked.h): a 2 x 2 step as it orders it (the four loads,
// then the four multiply-adds), the same step with each load just before its first reader, and the 2 x 1 step of
// a unit's last column group. `far`: A from the 1 MB buffer in L2 rows instead (B stays in L1).
#define STEP_2X2(NAME, TARGET, DP, INTERLEAVED, FAR)                                             \
  TARGET __attribute__((noinline)) long NAME(long n) {                                          \
    const long blocks = sizeof(far_buf) / 1536 / 32;                                            \
    for (long i = 0; i < n; ++i) {                                                              \
      const long s = i & 7;                                                                     \
      const uint8_t* a = FAR ? far_buf + ((i >> 3) % blocks) * 32 * 1536 + (i % 24) * 64       \
                             : a_buf + s * 64;                                                  \
      const long lda = FAR ? 1536 : 512;                                                        \
      const uint8_t* b = b_buf + s * 16 * 192;                                                  \
      if (INTERLEAVED) {                                                                        \
        BF_TILE_LOADD(4, a, lda);                                                               \
        BF_TILE_LOADD(6, b, 192);                                                               \
        DP(0, 4, 6);                                                                            \
        BF_TILE_LOADD(7, b + 64, 192);                                                          \
        DP(1, 4, 7);                                                                            \
        BF_TILE_LOADD(5, a + 16 * lda, lda);                                                    \
        DP(2, 5, 6);                                                                            \
        DP(3, 5, 7);                                                                            \
      } else {                                                                                  \
        BF_TILE_LOADD(4, a, lda);                                                               \
        BF_TILE_LOADD(5, a + 16 * lda, lda);                                                    \
        BF_TILE_LOADD(6, b, 192);                                                               \
        BF_TILE_LOADD(7, b + 64, 192);                                                          \
        DP(0, 4, 6);                                                                            \
        DP(1, 4, 7);                                                                            \
        DP(2, 5, 6);                                                                            \
        DP(3, 5, 7);                                                                            \
      }                                                                                         \
    }                                                                                           \
    return 4 * n;                                                                               \
  }
STEP_2X2(step2x2, BF_TARGET_TILES_BF16, DP_BF16, false, false)
STEP_2X2(step2x2_interleaved, BF_TARGET_TILES_BF16, DP_BF16, true, false)
STEP_2X2(step2x2_far, BF_TARGET_TILES_BF16, DP_BF16, false, true)
STEP_2X2(step2x2_int8, BF_TARGET_TILES_INT8, DP_INT8, false, false)

BF_TARGET_TILES_BF16 __attribute__((noinline)) long step2x1(long n) {
  for (long i = 0; i < n; ++i) {
    const long s = i & 7;
    BF_TILE_LOADD(4, a_buf + s * 64, 512);
    BF_TILE_LOADD(5, a_buf + 16 * 512 + s * 64, 512);
    BF_TILE_LOADD(6, b_buf + s * 16 * 192 + 128, 192);
    DP_BF16(0, 4, 6);
    DP_BF16(2, 5, 6);
  }
  return 2 * n;
}

struct Probe {
  const char* name;
  long (*body)(long);
};

const Probe kProbes[] = {
    {"tdpbf16ps, 1 chain (latency)", chain1},
    {"tdpbf16ps, 2 chains", chain2},
    {"tdpbf16ps, 3 chains", chain3},
    {"tdpbf16ps, 4 chains", chain4},
    {"tdpbf16ps, 6 chains (rate)", chain6},
    {"tdpbssd, 1 chain (latency)", chain1_int8},
    {"tdpbssd, 4 chains", chain4_int8},
    {"tileloadd from L1 (per load)", loads_l1},
    {"tileloadd from L2, 1536 B rows (per load)", loads_l2},
    {"4 chains, B reloaded into one register", reload_same},
    {"4 chains, B reloaded into two in turn", reload_two},
    {"blocked 2x2 step: 4 loads, then 4 tdp (L1)", step2x2},
    {"blocked 2x2 step: loads before first reader", step2x2_interleaved},
    {"blocked 2x2 step, A from L2", step2x2_far},
    {"blocked 2x2 step, tdpbssd (L1)", step2x2_int8},
    {"blocked 2x1 step (L1)", step2x1},
};

// Linux grants this process the tile state (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); emulated: always.
bool tiles_granted() {
#if defined(BF_AMX_EMULATED)
  return true;
#elif defined(SYS_arch_prctl)
  return __builtin_cpu_supports("amx-tile") && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 0.2;
  const long check_rounds = argc > 2 ? std::atol(argv[2]) : 0;  // > 0: that many rounds each, no timing loop
  if (!tiles_granted()) {
    std::printf("AMX tiles\tmissing\n");
    return 0;
  }
  for (unsigned i = 0; i < sizeof(a_buf); ++i) a_buf[i] = uint8_t(i * 7 + 1) & 0x3f;
  for (unsigned i = 0; i < sizeof(b_buf); ++i) b_buf[i] = uint8_t(i * 5 + 3) & 0x3f;
  for (unsigned i = 0; i < sizeof(far_buf); ++i) far_buf[i] = uint8_t(i * 3 + 2) & 0x3f;
  for (const Probe& p : kProbes) {
    configure();
    if (check_rounds > 0) {
      std::printf("%s\tran\t%ld\n", p.name, p.body(check_rounds));
      release();
      continue;
    }
    p.body(1 << 12);  // warm up: clocks, and the buffers into their caches
    long done = 0, rounds = 1 << 10;
    const auto t0 = Clock::now();
    double ns = 0.0;
    do {
      done += p.body(rounds);
      ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
      if (rounds < (1 << 20)) rounds *= 2;
    } while (ns < seconds * 1e9);
    release();
    std::printf("%s\t%.3f\t%ld\n", p.name, ns / double(done), done);
  }
  return 0;
}
