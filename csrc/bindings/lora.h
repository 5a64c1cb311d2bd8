// `_C.LoraTerm`: the operands of one call's LoRA terms (cpu/gemm/lora.h) as Python hands them to `linear` and
// `quant_linear` (bertfast/backends/cpu/lora.py), checked once when built; and `_C.lora_shrink`, their shrink.
// `_C.LoraSlot`: a GEMM's operands before their shrink, for `Layer` (layer.h), which shrinks each GEMM's own input.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "cpu/gemm/lora.h"

namespace bertfast {
namespace bindings {

class LoraOperands {
 public:
  // s (M, R) float32 rows; index (M,) int32, each -1 or a factor's position; per factor bt (float32, contiguous; its
  // layout: cpu/gemm/lora.h) and seg (segments, 3) int32 rows (k0, k1, offset into bt), the same segments for all;
  // width columns per segment.
  // bt_tiles: per factor B in the AMX expand's tile form instead of bts (then empty), or empty.
  LoraOperands(at::Tensor s, at::Tensor index, std::vector<at::Tensor> bts, std::vector<at::Tensor> segs,
               int64_t width, std::vector<at::Tensor> bt_tiles);
  // The term of a call of M rows and N outputs (checked against both).
  cpu::LoraTerm term(int64_t M, int64_t N) const;

 private:
  at::Tensor s_, index_;
  std::vector<at::Tensor> bts_, segs_, bt_tiles_;
  std::vector<cpu::LoraFactor> factors_;
  int64_t width_, segments_;
};

class LoraSlotOperands {
 public:
  // index (T,) int32, each -1 or a factor's position; per factor at (A^T: (K, r) float32 contiguous, r a multiple of
  // 16, the same K for all), bt and seg as LoraOperands takes them (seg's ranks within the factor's r); width as there;
  // tiles: per factor A^T in tile form (lora_shrink's), or empty; with them `at` may be empty (the amx tiers only);
  // bt_tiles: B in tile form instead of bts, as LoraOperands takes it.
  LoraSlotOperands(at::Tensor index, std::vector<at::Tensor> at, std::vector<at::Tensor> bts,
                   std::vector<at::Tensor> segs, int64_t width, std::vector<at::Tensor> tiles,
                   std::vector<at::Tensor> bt_tiles);
  // The widest factor's rank: a row of the shrunk values.
  int64_t rank() const { return rank_; }
  // The slot of a GEMM of K inputs and N outputs on a call of M rows (checked against all three), the shrunk values
  // into s, (M, rank()) float32; index: the call's rows' instead of the slot's own, as the constructor takes it.
  cpu::LoraSlot slot(int64_t M, int64_t K, int64_t N, float* s, const at::Tensor* index = nullptr) const;

 private:
  at::Tensor index_;
  std::vector<at::Tensor> at_, bts_, segs_, tiles_, bt_tiles_;
  std::vector<const float*> at_ptrs_;
  std::vector<const cpu::bf16*> tile_ptrs_;
  std::vector<int64_t> ranks_;
  std::vector<cpu::LoraFactor> factors_;
  int64_t width_, segments_, k_ = 0, steps_, rank_;
};

// s (M, R) float32 = x A^T per row on the row's factor (index[m], -1: a zero row), R the widest of the at's; x (M, K)
// float32 or bfloat16, each at (K, r) float32 contiguous with r a multiple of 16; tiles: per factor A^T in tile form
// (on the AMX tiers the shrink then runs on the tiles; `at` may then be empty), or empty.
at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& index, const std::vector<at::Tensor>& at,
                       const std::vector<at::Tensor>& tiles);

}  // namespace bindings
}  // namespace bertfast
