// Int8 GEMM on weights packed at load, the dequantization epilogue fused (bertfast/backends/cpu/quant.py):
//   out[m, n] = act(xs[m] * (ws[n] * sum_k q[m, k] w[n, k] - zp[m] * colsum[n]) + bias[n]) + residual[m, n]
// for activation codes q (per-token asymmetric int8, quantize_rows) and weights w (per-channel symmetric).
//
// Weights: panels of 16 output columns, groups of 4 along K, [N/16][K/4][16][4] int8, zero padded, so one
// 64-byte load feeds one vpdpbusd for 16 columns. vpdpbusd multiplies unsigned by signed bytes: the codes
// are made unsigned (q + 128 == q ^ 0x80) and the epilogue subtracts (zp + 128) * colsum instead of
// zp * colsum, the same correction. Every path sums exactly in int32, so the tiers differ at most in the
// epilogue's last bit. Paths, by tier (never a library's reference kernel):
//   amx, K % 64 == 0: AMX-int8 tiles (tdpbssd) on the signed codes, any M (amx_emulated: the same, emulated).
//   avx512_vnni: up to kStreamRows rows a 4 x 64 tile streams the weights (x flipped per broadcast); more
//     rows: x flipped once into an unsigned buffer (or quantized straight to unsigned bytes by the caller:
//     int8_unsigned_codes), then row blocks x 64 columns in 6 x 64 register tiles.
//   avx2: x widened once to int16, weights sign-extended on the fly (vpmovsxbw), vpmaddwd: 6 x 8 tiles; where the
//     CPU has AVX-VNNI, x flipped once to unsigned bytes and VEX vpdpbusd on ymm, 6 x 16 tiles (the same sums).
//   portable: x widened as for avx2; per panel the weights moved to k-contiguous rows, then 4 x 2 tiles of
//     dot products over k in plain loops (the compiler's pmaddwd / sdot reductions).
//
// The files: int8_linear_pack.cpp (the packed layout), int8_linear_stream.cpp (avx512_vnni, few rows),
// int8_linear_blocked.cpp (every tier, more rows), int8_linear_amx.cpp (AMX-int8); this one chooses (choose_int8)
// and dispatches.
#include <omp.h>

#include <cstdio>
#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "cpu/gemm/amx_gemm.h"
#include "cpu/int8/int8_linear_impl.h"

namespace bertfast {
namespace cpu {

using namespace int8_detail;

const char* int8_path_name(Int8Path path) {
  switch (path) {
    case Int8Path::AmxStream: return "AmxStream";
    case Int8Path::AmxStreamEmulated: return "AmxStreamEmulated";
    case Int8Path::AmxBlocked: return "AmxBlocked";
    case Int8Path::AmxBlockedEmulated: return "AmxBlockedEmulated";
    case Int8Path::VnniStream: return "VnniStream";
    case Int8Path::VnniBlocked: return "VnniBlocked";
    case Int8Path::AvxVnni: return "AvxVnni";
    case Int8Path::Avx2: return "Avx2";
    case Int8Path::Portable: return "Portable";
  }
  return "?";
}

// The one rule. Batch invariance: M chooses only between kernels of one tier that sum exactly in int32 and end in
// the same per-row epilogue, so a row's bits do not depend on M. Thresholds: AMX-int8 where K % 64 == 0 (a tile
// step's codes), blocked from amx_blocked's rows; avx512_vnni streams up to kStreamRows rows.
Int8Path choose_int8(const Int8Call& c) {
  if (amx_kernels(c.isa) && c.k % 64 == 0) {
    const bool emulated = c.isa == Isa::AmxEmulated;
    if (amx_blocked(c.m, true, c.amx_mode)) return emulated ? Int8Path::AmxBlockedEmulated : Int8Path::AmxBlocked;
    return emulated ? Int8Path::AmxStreamEmulated : Int8Path::AmxStream;
  }
  if (c.isa >= Isa::Avx512Vnni) return c.m <= kStreamRows ? Int8Path::VnniStream : Int8Path::VnniBlocked;
  if (c.isa == Isa::Avx2) return c.avx_vnni ? Int8Path::AvxVnni : Int8Path::Avx2;
  return Int8Path::Portable;
}

namespace {

Int8Path int8_path(int64_t M, int64_t K) { return choose_int8({M, K, active_isa(), has_avx_vnni(), amx_gemm()}); }

bool unsigned_bytes(Int8Path path) { return path == Int8Path::VnniBlocked || path == Int8Path::AvxVnni; }

}  // namespace

bool int8_unsigned_codes(int64_t M, int64_t K) { return K % 4 == 0 && unsigned_bytes(int8_path(M, K)); }

namespace {
using RowsThen = std::function<void(int64_t lo, int64_t hi)>;
void run_int8(const Int8Args& a, bool x_unsigned, const RowsThen* then = nullptr);

// then over rows [0, M) of an (M, N) output once a path that finishes no row before the others has written it all:
// in chunks of rows claimed by the GEMM's nt threads, which would otherwise wait while the caller ran it alone.
void then_rows(const RowsThen* then, int64_t M, int64_t N, int nt) {
  if (then == nullptr) return;
  constexpr int64_t kChunk = 32;
  parallel_for(M * N < 32768 ? 1 : nt, (M + kChunk - 1) / kChunk,
               [&](int64_t c) { (*then)(c * kChunk, std::min(M, (c + 1) * kChunk)); });
}
}  // namespace

bool int8_linear_bf16_supported() {
#if BF_X86
  return active_isa() == Isa::Avx512Vnni;  // the streaming and blocked VNNI paths, both ending in finish16
#else
  return false;
#endif
}

void int8_linear_bf16(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const float* xs, const int32_t* zp,
                      const int8_t* packed, int64_t N, const float* ws, const float* colsum, const float* bias,
                      bf16* out, bool x_unsigned, const LoraTerm* lora) {
#if BF_X86
  if (M == 0 || N == 0) return;
  if (!int8_linear_bf16_supported()) {
    std::fprintf(stderr, "bertfast: int8_linear_bf16 called on the %s tier (needs avx512_vnni)\n", isa_name(active_isa()));
    std::abort();
  }
  Int8Args a{x, ldx, M, K, xs, zp, packed, N, ws, colsum, bias, Activation::None, nullptr, N, nullptr};
  a.out16 = out;
  a.lora = lora;
  run_int8(a, x_unsigned);
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)xs, (void)zp, (void)packed, (void)N, (void)ws, (void)colsum, (void)bias,
      (void)out, (void)x_unsigned, (void)lora;
  std::abort();
#endif
}

void int8_linear(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const float* xs, const int32_t* zp,
                 const int8_t* packed, int64_t N, const float* ws, const float* colsum, const float* bias,
                 Activation act, const float* residual, int64_t ldr, float* out, bool x_unsigned,
                 const LoraTerm* lora) {
  if (M == 0 || N == 0) return;  // x_unsigned: only where int8_unsigned_codes(M, K), as the caller quantized for
  Int8Args a{x, ldx, M, K, xs, zp, packed, N, ws, colsum, bias, act, residual, ldr, out};
  a.lora = lora;
  run_int8(a, x_unsigned);
}

void int8_linear_then(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const float* xs, const int32_t* zp,
                      const int8_t* packed, int64_t N, const float* ws, const float* colsum, const float* bias,
                      Activation act, const float* residual, int64_t ldr, float* out, bool x_unsigned,
                      const RowsThen& then, const LoraTerm* lora) {
  if (M == 0) return;
  if (N == 0) return then(0, M);
  Int8Args a{x, ldx, M, K, xs, zp, packed, N, ws, colsum, bias, act, residual, ldr, out};
  a.lora = lora;
  run_int8(a, x_unsigned, &then);
}

namespace {

// The call `a` on the path choose_int8 gives; then (optional): int8_linear_then's.
void run_int8(const Int8Args& call, bool x_unsigned, const RowsThen* then) {
  Int8Args a = call;
  const int8_t* x = a.x;
  const int64_t ldx = a.ldx, M = a.M, K = a.K, N = a.N;
  const int64_t panels = (N + 15) / 16, groups = (panels + kGroupPanels - 1) / kGroupPanels;
  const int nt = M * N * K < (int64_t(1) << 18) ? 1 : num_threads();
  const Int8Path path = int8_path(M, K);
  const LoraTerm lora = a.lora != nullptr ? lora_tile_rows(*a.lora, on_tiles(path), M, N) : LoraTerm{};
  if (a.lora != nullptr) a.lora = &lora;
#if BF_X86
  // Threads split the output columns in groups of 4 panels (64 columns), so each streams its own weights.
  switch (path) {
    case Int8Path::AmxBlocked:
    case Int8Path::AmxBlockedEmulated:
      // Units of three 16-column panels: the 48 columns of the bf16 kernel's unit, in three tile groups.
      amx_for_items(M, (panels + 2) / 3, nt, [&](int64_t r0, int64_t rows, int64_t u0, int64_t u1) {
        path == Int8Path::AmxBlocked ? panels_amx_blocked(a, r0, rows, u0, u1)
                                     : panels_amx_blocked_emulated(a, r0, rows, u0, u1);
      });
      then_rows(then, M, N, nt);
      return;
    case Int8Path::AmxStream:
    case Int8Path::AmxStreamEmulated:
      parallel_for(nt, groups, [&](int64_t g) {
        const int64_t p0 = g * 4, p1 = std::min(panels, g * 4 + 4);
        path == Int8Path::AmxStream ? panels_amx(a, p0, p1) : panels_amx_emulated(a, p0, p1);
      });
      then_rows(then, M, N, nt);
      return;
    default:
      break;
  }
  if (path == Int8Path::VnniStream) {
    parallel_for(nt, groups, [&](int64_t g) { stream_panels_vnni(a, g * 4, std::min(panels, g * 4 + 4)); });
    then_rows(then, M, N, nt);
    return;
  }
#endif
  // Blocked: the codes prepared once (unsigned bytes for VNNI, int16 otherwise, rows padded to whole
  // groups), then (row block, panel group) items claimed by the threads.
  const int64_t ld = (K + 3) / 4 * 4, row_blocks = (M + kRowBlock - 1) / kRowBlock;
  static thread_local std::vector<int16_t> codes;  // the caller's: reused across calls
  // Items in row-block order, so a thread alone finishes the row blocks one by one; then runs on a row block when
  // the last of its panel groups is written (left: the groups still to write, per row block).
  std::unique_ptr<std::atomic<int64_t>[]> left(then != nullptr ? new std::atomic<int64_t>[row_blocks] : nullptr);
  for (int64_t rb = 0; then != nullptr && rb < row_blocks; ++rb) left[rb].store(groups, std::memory_order_relaxed);
  const auto item = [&](int64_t i, auto&& run) {
    const int64_t rb = i / groups, g = i % groups, r0 = rb * kRowBlock, r1 = std::min(M, (rb + 1) * kRowBlock);
    run(r0, r1, g * kGroupPanels, std::min(panels, (g + 1) * kGroupPanels));
    if (then != nullptr && left[rb].fetch_sub(1, std::memory_order_acq_rel) == 1) (*then)(r0, r1);
  };
  const int prep_threads = int(std::min<int64_t>(nt, row_blocks));
#if BF_X86
  // VNNI (AVX-512, or AVX-VNNI on the avx2 tier): the codes flipped to unsigned bytes (unless the caller's
  // quantization wrote them so: x_unsigned, K % 4 == 0), then vpdpbusd tiles.
  if (unsigned_bytes(path)) {
    const bool zmm = path == Int8Path::VnniBlocked;
    const uint8_t* xu = reinterpret_cast<const uint8_t*>(x);
    int64_t ldu = ldx;
    if (!x_unsigned) {
      codes.resize(size_t(M * ld));
      uint8_t* flipped = reinterpret_cast<uint8_t*>(codes.data());
      parallel_for(prep_threads, row_blocks, [&](int64_t rb) {
        const int64_t lo = rb * kRowBlock, hi = std::min(M, lo + kRowBlock);
        zmm ? flip_codes_vnni(a, lo, hi, ld, flipped) : flip_codes_avx2(a, lo, hi, ld, flipped);
      });
      xu = flipped;
      ldu = ld;
    }
    parallel_for(nt, row_blocks * groups, [&](int64_t i) {
      item(i, [&](int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
        zmm ? item_vnni(a, xu, ldu, r0, r1, p0, p1) : item_avxvnni(a, xu, ldu, r0, r1, p0, p1);
      });
    });
    return;
  }
#endif
  codes.resize(size_t(M * ld));
  int16_t* xw = codes.data();
  parallel_for(prep_threads, row_blocks, [&](int64_t rb) {
    const int64_t lo = rb * kRowBlock, hi = std::min(M, lo + kRowBlock);
#if BF_X86
    if (path == Int8Path::Avx2) return widen_codes_avx2(a, lo, hi, ld, xw);
#endif
    widen_codes_generic(a, lo, hi, ld, xw);
  });
  parallel_for(nt, row_blocks * groups, [&](int64_t i) {
    item(i, [&](int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
#if BF_X86
      if (path == Int8Path::Avx2) return item_avx2(a, xw, ld, r0, r1, p0, p1);
#endif
      item_generic(a, xw, ld, r0, r1, p0, p1);
    });
  });
}

}  // namespace

}  // namespace cpu
}  // namespace bertfast
