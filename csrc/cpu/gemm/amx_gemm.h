// The AMX GEMMs' two kernels (bf16: linear_amx.cpp, int8: int8_linear_amx.cpp) and the one rule that picks
// between them by M, with its thresholds; the work items of the blocked kernel.
//
//   stream:  per claimed 48-column unit of the weights, every 16-row block of x runs the whole K in three C tiles
//            (1 A + 3 B tile loads per 3 multiply-adds). At small M bound by the weight stream, read once.
//   blocked: per work item a block of rows x a run of units; K in blocks of a few tile steps whose
//            weight sub-panel (24 KB) stays in L1 across the item's 32-row pairs; per pair 2 x 2 tiles for a
//            unit's columns 0-31 and 2 x 1 for 32-47 (7 tile loads per 6 multiply-adds, mostly from L1), the C
//            tiles saved to and reloaded from a scratch between K blocks. At large M the streaming kernel reloads
//            a whole panel (72 KB at K = 768) from L2 for every 16 rows, and x from L2/L3 for every panel.
// Both give an output the same sequence of tile multiply-adds (k steps 0, 1, 2, ... into a C tile that starts
// from zero; an fp32 or int32 tile saved and reloaded is exact; a row's sums never depend on the other rows of its
// tile, nor on how many rows the tile is configured with) and the same epilogue on each row (bf16: the same
// store_tile call per 16-row block and panel; int8: finish16 per row and panel). So the kernels are
// bit-identical, and choosing by M keeps the engine batch-invariant (tests/test_amx_gemm.py).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/common/parallel.h"

namespace bertfast {
namespace cpu {

// The bf16 AMX kernels (linear_amx.cpp, sparse_pool_amx.cpp) run when K is a multiple of this: bf16 elements of K
// per tile step.
constexpr int64_t kAmxK = 32;

enum class AmxGemm : int { Auto = 0, Stream = 1, Blocked = 2 };

// The kernel choice: BERTFAST_AMX_GEMM=stream|blocked|auto, read once at load (default auto), or set_amx_gemm.
AmxGemm amx_gemm();
void set_amx_gemm(AmxGemm mode);
// The mode named by `name` ("auto", "stream", "blocked"); false if none has that name.
bool parse_amx_gemm(const char* name, AmxGemm* mode);
const char* amx_gemm_name(AmxGemm mode);

// Rows from which auto takes the blocked kernel: where BERT-base's four GEMMs run faster blocked than streaming
// (benchmarks/bench_amx_gemm.py; benchmarks/results/amx-2026-11-26). int8 runs blocked at every M: its T1
// prefetch a K block ahead keeps the weight stream going better than the streaming kernel's (faster at all four
// shapes from 1 to 64 rows on the 2026-12-07 AMX host, and at 16 rows on the 2026-12-06 one).
constexpr int64_t kAmxBlockedRowsBf16 = 128;
constexpr int64_t kAmxBlockedRowsInt8 = 1;

// The one routing rule of the AMX GEMMs: whether an M-row call takes the blocked kernel under `mode` (amx_gemm()).
// The GEMMs' choosers (choose_gemm, choose_int8) ask it.
inline bool amx_blocked(int64_t m, bool int8, AmxGemm mode) {
  if (mode != AmxGemm::Auto) return mode == AmxGemm::Blocked;
  return m >= (int8 ? kAmxBlockedRowsInt8 : kAmxBlockedRowsBf16);
}

// The blocked kernel's geometry. A unit is 48 output columns (three 16-column tile groups): a bf16 panel, or
// three int8 panels. A K block is `steps` tile steps (bf16: 32 elements, int8: 64 codes): at 8 its weight
// sub-panel is 8 x 3 KB = 24 KB (half of Sapphire Rapids' 48 KB L1D), the A rows of a 32-row pair 16 KB. A work
// item has at most `rows` rows (a multiple of the 32-row pair): its x block (256 x 768 bf16: 384 KB) stays in L2
// across its run of units, and each weight sub-panel, streamed in from L3 once per item, serves twice the rows of
// 128-row items (a BERT-base forward 1-5% faster on a 2026-12-07 AMX host: benchmarks/results/2026-12-07-amx-host).
// `stage`: the item first copies its x block into tile order (each tile's 16 rows of 64 bytes contiguous: a pair's
// K block one 16 KB stretch), and its A tiles load from there instead of from rows ldx apart. set_amx_blocking
// changes the geometry (benchmarks/bench_amx_gemm.py --blocking). Any geometry gives the same bits.
struct AmxBlocking {
  int64_t steps, rows;
  bool stage;
};
constexpr AmxBlocking kAmxDefaultBlocking{8, 256, false};
constexpr int64_t kAmxPairRows = 32;
constexpr int64_t kAmxMaxItemRows = 256;  // the kernel's C scratch: 256 x 48 x 4 bytes = 48 KB of stack
AmxBlocking amx_blocking();
// false (nothing changed) unless 1 <= steps <= 64 and rows is a multiple of 32 in [32, kAmxMaxItemRows].
bool set_amx_blocking(int64_t steps, int64_t rows, bool stage = false);

// The blocked kernel's work items over an M x `units` output: row blocks of equal size (a multiple of 32, at most
// amx_blocking().rows) times `runs` equal runs of units, one per thread (each item's x block stays in its core's L2
// across its run).
struct AmxItems {
  int64_t rows_per, row_blocks, units, runs;
  AmxItems(int64_t M, int64_t units_, int nt) : units(units_), runs(std::min<int64_t>(units_, std::max(nt, 1))) {
    const int64_t most = amx_blocking().rows;
    row_blocks = (M + most - 1) / most;
    rows_per = ((M + row_blocks - 1) / row_blocks + kAmxPairRows - 1) / kAmxPairRows * kAmxPairRows;
    row_blocks = (M + rows_per - 1) / rows_per;
  }
  int64_t count() const { return row_blocks * runs; }
  int64_t first_unit(int64_t run) const { return units * run / runs; }
};

// f(r0, rows, u0, u1) for every work item of an M x `units` call (AmxItems), on nt threads: how both blocked
// kernels' calls (bf16: amx_gemm.cpp, int8: int8_linear.cpp) share out their items.
template <typename F>
void amx_for_items(int64_t M, int64_t units, int nt, const F& f) {
  const AmxItems items(M, units, nt);
  parallel_for(nt, items.count(), [&](int64_t i) {
    const int64_t rb = i / items.runs, run = i % items.runs, r0 = rb * items.rows_per;
    f(r0, std::min(items.rows_per, M - r0), items.first_unit(run), items.first_unit(run + 1));
  });
}

}  // namespace cpu
}  // namespace bertfast
