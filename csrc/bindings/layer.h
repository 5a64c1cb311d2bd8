// `Layer` (Python: `_C.Layer`) and its weights (`_C.LayerWeights`): one encoder layer run whole in C++, the weights
// checked once when it is built (checks.h), each call only its input; bound in csrc/bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "bindings/alloc.h"
#include "bindings/checks.h"
#include "bindings/lora.h"
#include "bindings/ops.h"
#include "cpu/common/kernels.h"

namespace bertfast {
// Hidden, as pybind11's own types are: a class bound by pybind11 must not be more visible than they.
namespace bindings __attribute__((visibility("hidden"))) {

// The tensors of one encoder layer (Python: `_C.LayerWeights(qkv=..., ...)`, keyword arguments): the four
// GEMM weights packed by pack_linear (the dtype of their biases: the layer's dtype), or by pack_int8 with their
// per-channel scales and column sums (int8_scales, int8_colsums: one per GEMM, in the order qkv, attn_out, ffn_in,
// ffn_out; an fp32 layer), their biases and the two LayerNorms (fp32 in every dtype: they run on the fp32
// residual stream, layer.cpp).
struct LayerTensors {
  at::Tensor qkv, qkv_bias, attn_out, attn_out_bias, attn_ln_weight, attn_ln_bias;
  at::Tensor ffn_in, ffn_in_bias, ffn_out, ffn_out_bias, ffn_ln_weight, ffn_ln_bias;
  c10::optional<std::vector<at::Tensor>> int8_scales, int8_colsums;
};

// What an int8 Layer call leaves for the next (Python: `_C.LayerCarry()`, the same one passed as `carry=` to each
// layer of a forward in turn): its output's codes for the next layer's QKV GEMM, quantized as the output's rows were
// normalized (layer.cpp) instead of read back by the next call. That call takes them only for the very tensor this one
// returned (held here, so no other tensor can have its memory), unchanged, with the same cu_seqlens and the same
// form per group (int8_code_forms: the tier's); otherwise it quantizes x itself. The output is the same either way.
struct LayerCarry {
  at::Tensor out, q, scale, zp;  // the output, its codes (T, H), their scales and zero points (T,)
  std::vector<int32_t> cu;
  std::vector<uint8_t> forms;

  // Whether these are x's codes for this call: `now`, the call's int8_code_forms.
  bool holds(const at::Tensor& x, const int32_t* cu_seqlens, int64_t batch, const std::vector<uint8_t>& now) const {
    return out.defined() && x.is_same(out) && int64_t(cu.size()) == batch + 1 &&
           std::equal(cu.begin(), cu.end(), cu_seqlens) && forms == now;
  }
};

// One encoder layer on packed weights, run whole in C++ (csrc/cpu/layer/layer.cpp): the weights are checked
// once here, each call checks only its input. lora: a call's LoRA adapters per row, one LoraSlot (or None: no adapter
// of the call adapts it) per GEMM in the order qkv, attn_out, ffn_in, ffn_out; the layer shrinks each GEMM's own
// input and adds the terms in its epilogue, as `linear` and `quant_linear` do with a LoraTerm. lora_index: per GEMM
// the rows' index instead of its slot's own (slots kept across calls of other rows), or None.
class Layer {
 public:
  Layer(const LayerTensors& w, int64_t hidden, int64_t intermediate, int64_t heads, double eps, const std::string& act)
      : w_(w), config_{hidden, intermediate, heads, float(eps), activation(act), w.int8_scales.has_value()} {
    BF_CHECK(hidden > 0 && intermediate > 0 && heads > 0, "hidden, intermediate and heads must be positive, got ",
             hidden, ", ", intermediate, ", ", heads);
    BF_CHECK(hidden % heads == 0, "hidden size ", hidden, " is not a multiple of heads ", heads);
    BF_CHECK(w.int8_scales.has_value() == w.int8_colsums.has_value(), "int8_scales and int8_colsums go together");
    const at::Tensor& ref = w.qkv_bias;  // the layer's float dtype
    check_float(ref, "qkv bias");
    BF_CHECK(!config_.int8 || ref.scalar_type() == at::kFloat, "an int8 layer computes in float32, got ",
             ref.scalar_type());
    if (config_.int8) {
      BF_CHECK(w.int8_scales->size() == 4 && w.int8_colsums->size() == 4,
               "int8_scales and int8_colsums need one tensor per GEMM (4), got ", w.int8_scales->size(), " and ",
               w.int8_colsums->size());
    }
    const Gemm gemms[4] = {gemm(0), gemm(1), gemm(2), gemm(3)};
    for (int g = 0; g < 4; ++g) {
      if (config_.int8) {
        check_packed_int8(*gemms[g].weight, gemms[g].n, gemms[g].k, gemms[g].name);
        check_vector((*w.int8_scales)[g], ref, gemms[g].n, "int8 weight scale");
        check_vector((*w.int8_colsums)[g], ref, gemms[g].n, "int8 weight column sum");
        scales_[g] = (*w.int8_scales)[g];
        colsums_[g] = (*w.int8_colsums)[g];
      } else {
        check_packed(*gemms[g].weight, ref, gemms[g].n, gemms[g].k, gemms[g].name);
      }
    }
    check_vector(w.qkv_bias, ref, 3 * hidden, "qkv bias");
    check_vector(w.attn_out_bias, ref, hidden, "attention output bias");
    const at::Tensor stream = at::empty({0}, ref.options().dtype(at::kFloat));
    check_vector(w.attn_ln_weight, stream, hidden, "attention LayerNorm weight");
    check_vector(w.attn_ln_bias, stream, hidden, "attention LayerNorm bias");
    check_vector(w.ffn_in_bias, ref, intermediate, "ffn input bias");
    check_vector(w.ffn_out_bias, ref, hidden, "ffn output bias");
    check_vector(w.ffn_ln_weight, stream, hidden, "ffn LayerNorm weight");
    check_vector(w.ffn_ln_bias, stream, hidden, "ffn LayerNorm bias");
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& cu_seqlens, int64_t max_seqlen, double scale,
                     const c10::optional<at::Tensor>& bias_table,
                     const c10::optional<at::Tensor>& bias_positions, LayerCarry* carry,
                     const c10::optional<std::vector<const LoraSlotOperands*>>& lora,
                     const c10::optional<std::vector<c10::optional<at::Tensor>>>& lora_index) const {
    const int64_t H = config_.hidden, I = config_.intermediate;
    check_tensor(x, "x");
    BF_CHECK(x.scalar_type() == at::kFloat, "x (the residual stream) must be float32 in every dtype, got ",
             x.scalar_type());
    BF_CHECK(x.dim() == 2 && x.size(1) == H, "x must be (tokens, ", H, "), got ", x.sizes());
    check_contig(x, "x");
    const int64_t T = x.size(0);
    const int64_t B = check_cu_seqlens(cu_seqlens, T, max_seqlen, "x");
    const bc::AttnBias bias = check_attn_bias(bias_table, bias_positions, config_.heads, T, cu_seqlens);
    // LoRA: each GEMM's slot checked against the call, their shrunk rows in one block ((T, rank) floats a slot).
    bc::LoraSlot slots[4];
    const bc::LoraSlot* slot[4] = {};
    at::Tensor shrunk;
    if (lora.has_value()) {
      BF_CHECK(lora->size() == 4, "lora needs one LoraSlot or None per GEMM (4), got ", lora->size());
      BF_CHECK(!lora_index.has_value() || lora_index->size() == 4, "lora_index needs one index or None per GEMM (4), "
               "got ", lora_index.has_value() ? lora_index->size() : 0);
      int64_t numel = 0;
      for (const LoraSlotOperands* l : *lora) numel += l != nullptr ? T * l->rank() : 0;
      shrunk = at::empty({numel}, x.options());
      float* s = ptr<float>(shrunk);
      for (int g = 0; g < 4; ++g) {
        const LoraSlotOperands* l = (*lora)[size_t(g)];
        if (l == nullptr) continue;
        const c10::optional<at::Tensor>* index = lora_index.has_value() ? &(*lora_index)[size_t(g)] : nullptr;
        slots[g] = l->slot(T, gemm(g).k, gemm(g).n, s, index != nullptr && index->has_value() ? &**index : nullptr);
        slot[g] = &slots[g];
        s += T * l->rank();
      }
    }
    const bc::LayerLora layer_lora{slot[0], slot[1], slot[2], slot[3]};
    at::Tensor out = empty_activation({T, H}, x.options());
    // The scratch in one block (empty_activation: from 1 MB the cache's): the float work, then under int8 the operand
    // codes' scales and zero points, then the codes, 64-byte aligned. As three allocations of their own from torch's
    // allocator, a layer call spent more time outside its stages (benchmarks/results/embed-cpu).
    bc::LayerConfig config = config_;
    config.groups = bc::int8_groups(bc::active_isa());
    const int64_t ffn = config.groups.ffn;
    const int64_t numel = bc::layer_work_numel(T, H, I), rows8 = config.int8 ? bc::int8_codes_rows(T, ffn) : 0;
    const int64_t codes_at = (numel + 2 * rows8 + 15) / 16 * 16;
    at::Tensor work = empty_activation({codes_at + (config.int8 ? (bc::int8_codes_numel(T, H, I, ffn) + 3) / 4 : 0)},
                                       x.options());
    float* const tail = ptr<float>(work) + numel;
    const bc::Int8Scratch q8 = config_.int8 ? bc::Int8Scratch{reinterpret_cast<int8_t*>(ptr<float>(work) + codes_at),
                                                               tail, reinterpret_cast<int32_t*>(tail + rows8)}
                                            : bc::Int8Scratch{};
    // int8 with a carry: x's codes from it where it holds them, out's written into it (the same buffers: x's are read
    // before out's are written)
    const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
    const bool carrying = carry != nullptr && config_.int8;
    std::vector<uint8_t> forms = carrying ? bc::int8_code_forms(cu, B, H, config.groups.group) : std::vector<uint8_t>();
    const bool carried = carrying && carry->holds(x, cu, B, forms);
    if (carrying && !carried) {
      carry->q = at::empty({T, H}, x.options().dtype(at::kChar));
      carry->scale = at::empty({T}, x.options());
      carry->zp = at::empty({T}, x.options().dtype(at::kInt));
    }
    const bc::Int8Scratch codes = carrying ? bc::Int8Scratch{ptr<int8_t>(carry->q), ptr<float>(carry->scale),
                                                             ptr<int32_t>(carry->zp)}
                                           : bc::Int8Scratch{};
    {
      py::gil_scoped_release nogil;
      dispatch(w_.qkv_bias.scalar_type(), [&](auto tag) {
        using T_ = decltype(tag);
        const auto g = [&](int i) {
          const Gemm gm = gemm(i);
          return bc::LayerGemm<T_>{gm.weight->data_ptr(), ptr<T_>(*gm.bias), ptr<float>(scales_[i]),
                                   ptr<float>(colsums_[i])};
        };
        const bc::LayerWeights<T_> w{g(0),
                                     g(1),
                                     g(2),
                                     g(3),
                                     ptr<float>(w_.attn_ln_weight),
                                     ptr<float>(w_.attn_ln_bias),
                                     ptr<float>(w_.ffn_ln_weight),
                                     ptr<float>(w_.ffn_ln_bias)};
        bc::encoder_layer<T_>(ptr<float>(x), T, cu, B, float(scale), w, config, ptr<float>(work), q8,
                              ptr<float>(out), bias.table ? &bias : nullptr, carried ? &codes : nullptr,
                              carrying ? &codes : nullptr, lora.has_value() ? &layer_lora : nullptr);
      });
    }
    if (carrying) {
      carry->out = out;
      if (!carried) carry->cu.assign(cu, cu + B + 1), carry->forms = std::move(forms);
    } else if (carry != nullptr) {
      *carry = LayerCarry{};  // a float layer leaves no codes
    }
    return out;
  }

 private:
  // GEMM g of the layer (qkv, attn_out, ffn_in, ffn_out): its packed weight, bias, name and (N, K).
  struct Gemm {
    const at::Tensor* weight;
    const at::Tensor* bias;
    const char* name;
    int64_t n, k;
  };
  Gemm gemm(int g) const {
    const int64_t H = config_.hidden, I = config_.intermediate;
    switch (g) {
      case 0: return {&w_.qkv, &w_.qkv_bias, "qkv weight", 3 * H, H};
      case 1: return {&w_.attn_out, &w_.attn_out_bias, "attention output weight", H, H};
      case 2: return {&w_.ffn_in, &w_.ffn_in_bias, "ffn input weight", I, H};
      default: return {&w_.ffn_out, &w_.ffn_out_bias, "ffn output weight", H, I};
    }
  }

  LayerTensors w_;
  bc::LayerConfig config_;
  at::Tensor scales_[4], colsums_[4];  // int8 only
};

}  // namespace bindings
}  // namespace bertfast
