// DeBERTa-v2's position scores (disentangled.cpp, disentangled_amx.cpp): their paths, the one rule choosing them
// (choose_position_scores) and the AMX kernel's entry points.
#pragma once

#include <cstdint>

#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"

namespace bertfast {
namespace cpu {

// The kernels of position_scores, one per path.
enum class PositionScoresPath : int {
  Portable,     // fp32 dot products in plain loops, bf16 widened (disentangled.cpp)
  Avx2,         // the same loops compiled for AVX2 + FMA
  Avx512,       // fp32 AVX-512 register blocks of 6 tokens x 64 columns, bf16 widened
  Avx512Bf16,   // bf16: the same blocks, one vdpbf16ps per pair of head dims (disentangled.cpp)
  Amx,          // bf16 on AMX tiles: per head a blocked AMX GEMM of x against the packed rows (disentangled_amx.cpp)
  AmxEmulated,  // the same with the tiles emulated (the amx_emulated tier)
};
const char* position_scores_path_name(PositionScoresPath path);

// What the choice reads: the operands' dtype, the head dim and the tier (the same choice for every T, rows and
// window: a row's entries never depend on its batch).
struct PositionScoresCall {
  bool bf16;
  int64_t head_dim;
  Isa isa;
  bool avx512_bf16;  // AVX-512 BF16 present and not hidden (has_avx512_bf16())
};
PositionScoresPath choose_position_scores(const PositionScoresCall& call);

namespace disentangled_detail {

// Where the AMX kernel writes: out (tokens, heads, rows) float32, head h, times scale.
struct ScoreOut {
  float* out;
  int64_t heads, h, rows;
  float scale;
};

#if BF_X86
// Tokens [r0, r0 + n) of one head's x (bf16, d a multiple of kAmxK, rows ldx apart) against panels [u0, u1) of that
// head's position rows in pack_linear's bf16 layout (n <= kAmxMaxItemRows); and with the tiles emulated.
BF_TARGET_AMX void position_scores_amx(const bf16* x, int64_t ldx, const bf16* packed, int64_t d, const ScoreOut& o,
                                       int64_t r0, int64_t n, int64_t u0, int64_t u1);
BF_TARGET_AVX512 void position_scores_amx_emulated(const bf16* x, int64_t ldx, const bf16* packed, int64_t d,
                                                   const ScoreOut& o, int64_t r0, int64_t n, int64_t u0, int64_t u1);
#endif

}  // namespace disentangled_detail
}  // namespace cpu
}  // namespace bertfast
