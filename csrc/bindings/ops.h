// The op wrappers of `bertfast._C` (ops.cpp; bound in csrc/bindings.cpp) and what Layer (layer.h) shares with
// them: raw pointers of checked tensors and the float32 / bfloat16 dispatch.
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <string>
#include <tuple>

#include "cpu/common/types.h"

namespace py = pybind11;

namespace bertfast {
namespace bindings {

class LoraOperands;  // bindings/lora.h

namespace bc = ::bertfast::cpu;

template <typename T>
T* ptr(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<T*>(t.data_ptr()) : nullptr;
}

template <typename F>
void dispatch(at::ScalarType dt, F&& f) {
  if (dt == at::kFloat)
    f(float{});
  else
    f(bc::bf16{});
}

at::Tensor embeddings(const at::Tensor& ids, const c10::optional<at::Tensor>& positions,
                 const c10::optional<at::Tensor>& types, const at::Tensor& word,
                 const c10::optional<at::Tensor>& position_table, const c10::optional<at::Tensor>& type_table,
                 const at::Tensor& gamma, const at::Tensor& beta, double eps);
at::Tensor layernorm(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta, double eps,
                     const c10::optional<at::Tensor>& residual);
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                     int64_t max_seqlen, double scale, bool bf16_products,
                     const c10::optional<at::Tensor>& bias_table, const c10::optional<at::Tensor>& bias_positions,
                     int64_t window, const c10::optional<at::Tensor>& c2p, const c10::optional<at::Tensor>& p2c,
                     const c10::optional<at::Tensor>& rel_index);
at::Tensor position_scores(const at::Tensor& x, const at::Tensor& pos, double scale,
                           const c10::optional<at::Tensor>& windows);
at::Tensor rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor glu(const at::Tensor& h, const std::string& act);
at::Tensor pack_linear(const at::Tensor& weight);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias, const std::string& act,
                  const c10::optional<at::Tensor>& residual, const LoraOperands* lora, bool float_out);
at::Tensor sparse_pool(const at::Tensor& x, const at::Tensor& packed, int64_t vocab,
                       const c10::optional<at::Tensor>& bias, const at::Tensor& cu_seqlens, const std::string& pooling,
                       const std::string& activation);
at::Tensor pool_rows(const at::Tensor& x, const at::Tensor& cu_seqlens, const std::string& mode);
// The native layer's stage timers (cpu/profile.h): on (counters zeroed) or off, and their totals.
void profile_enable(bool on);
py::dict profile_counters();
std::string isa();
std::string detected_isa();
bool set_isa(const std::string& name);
bool isa_supported(const std::string& name);
// The AMX GEMMs' kernel choice (cpu/amx_gemm.h): "auto", "stream" or "blocked".
std::string amx_gemm();
void set_amx_gemm(const std::string& name);
// The blocked AMX kernel's geometry (tile steps per K block, rows per work item at most), for measurement.
std::tuple<int64_t, int64_t, bool> amx_blocking();
void set_amx_blocking(int64_t steps, int64_t rows, bool stage);
// fp32 -> bf16 bits as the amx_emulated tier converts them, and as VCVTNEPS2BF16 does where the CPU has it.
std::tuple<at::Tensor, c10::optional<at::Tensor>> bf16_conversions(const at::Tensor& x);
// The choosers' answers (the path's name) for arguments given here, the tier among them: choose_attention
// (attention_impl.h), choose_gemm (linear_impl.h), choose_int8 (int8_linear_impl.h), choose_sparse_pool
// (sparse_pool_impl.h); dtype "float32" or "bfloat16".
std::string attention_path(const std::string& dtype, bool bf16_products, int64_t head_dim, bool has_bias,
                           int64_t window, const std::string& tier, bool avx512_bf16);
std::string gemm_path(const std::string& dtype, int64_t m, int64_t k, const std::string& tier, bool avx512_bf16,
                      const std::string& amx_gemm);
std::string int8_path(int64_t m, int64_t k, const std::string& tier, bool avx_vnni, const std::string& amx_gemm);
std::string sparse_pool_path(const std::string& dtype, int64_t k, const std::string& tier);
std::string position_scores_path(const std::string& dtype, int64_t head_dim, const std::string& tier,
                                 bool avx512_bf16);
// int8 dynamic quantization
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, bool flip);
at::Tensor pack_int8(const at::Tensor& weight);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                        const at::Tensor& colsum, const c10::optional<at::Tensor>& bias, const std::string& act,
                        const c10::optional<at::Tensor>& residual, bool unsigned_codes,
                        const LoraOperands* lora);

}  // namespace bindings
}  // namespace bertfast
