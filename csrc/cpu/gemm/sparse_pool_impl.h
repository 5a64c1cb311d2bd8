// SPLADE's pooled vocabulary GEMM (sparse_pool.cpp, sparse_pool_amx.cpp): its paths, the one rule choosing them
// (choose_sparse_pool), the activation both apply and the AMX kernel's entry points.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"

namespace bertfast {
namespace cpu {

// The kernels of sparse_pool, one per path.
enum class SparsePoolPath : int {
  Portable,     // fp32 register tiles in plain loops (sparse_pool.cpp)
  Avx512,       // fp32 AVX-512 register tiles (sparse_pool.cpp)
  WidePortable, // bf16 operands widened to fp32 (x once, a panel as a thread takes it), then Portable's tiles
  WideAvx512,   // the same on Avx512's tiles
  Amx,          // bf16 on AMX tiles, the pooling in the blocked AMX GEMM's epilogue (sparse_pool_amx.cpp)
  AmxEmulated,  // the same with the tiles emulated (the amx_emulated tier)
};
const char* sparse_pool_path_name(SparsePoolPath path);

// What the choice reads: the operands' dtype, K (the same choice for every T and V) and the tier.
struct SparsePoolCall {
  bool bf16;
  int64_t k;
  Isa isa;
};
SparsePoolPath choose_sparse_pool(const SparsePoolCall& call);

// f(y) = log1p(relu(y)), twice: log1p(f(y)) (SPLADE's log1p_relu).
BF_INLINE float splade_act(float y, bool twice) {
  const float z = y > 0.f ? std::log1p(y) : 0.f;
  return twice ? std::log1p(z) : z;
}

namespace sparse_detail {

// Where the AMX kernel folds the logits: per token its sequence, and the output (batch, V) fp32 holding each
// sequence's running value per column (Max: the max of the raw logits; Sum: the sum of f(logit + bias)).
struct PoolArgs {
  const int32_t* seq;  // (T,): token t belongs to sequence seq[t]
  int64_t V;
  SparsePooling pooling;
  const float* bias;  // (V,) or null
  bool twice;
  float* out;
};

#if BF_X86
// Rows [r0, r0 + rows) of x (bf16, K a multiple of kAmxK) against panels [u0, u1) of pack_linear's bf16 layout,
// each 16-row block of logits folded into a.out as it leaves the tiles, rows in order (rows <= kAmxMaxItemRows);
// and with the tiles emulated.
BF_TARGET_AMX void sparse_pool_amx(const bf16* x, int64_t ldx, const bf16* packed, int64_t K, const PoolArgs& a,
                                   int64_t r0, int64_t rows, int64_t u0, int64_t u1);
BF_TARGET_AVX512 void sparse_pool_amx_emulated(const bf16* x, int64_t ldx, const bf16* packed, int64_t K,
                                               const PoolArgs& a, int64_t r0, int64_t rows, int64_t u0, int64_t u1);
#endif

}  // namespace sparse_detail
}  // namespace cpu
}  // namespace bertfast
