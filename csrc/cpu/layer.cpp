// One post-LayerNorm encoder layer on the extension's GEMMs, all in C++: the ops of `reference.layer`
// (QKV GEMM, varlen attention, output GEMM + residual, LayerNorm, FFN-in GEMM + activation,
// FFN-out GEMM + residual, LayerNorm) as the cpu backend runs them (fp32, bf16, or int8 GEMMs), the
// same kernels called in the same order on the same shapes, so the result is bit-identical to
// calling them one by one from Python. What it saves is the Python between them (paired runs, b1 x s16:
// BERT-base x0.93-0.95 the time in fp32, x0.92 bf16, x0.91 int8; MiniLM x0.84-0.90).
#include "kernels.h"
#include "profile.h"

namespace bertfast {
namespace cpu {

template <typename T>
void encoder_layer(const T* x, int64_t tokens, const int32_t* cu_seqlens, int64_t batch, float scale,
                   const LayerWeights<T>& w, const LayerConfig& c, T* work, const Int8Scratch& q8, T* out,
                   const AttnBias* bias) {
  const int64_t T_ = tokens, H = c.hidden, I = c.intermediate, d = H / c.heads;
  T* qkv = work;              // (T, 3H): q | k | v per token
  T* ctx = qkv + T_ * 3 * H;  // (T, H)
  T* mid = ctx + T_ * H;      // (T, H): after the attention block
  T* inner = mid + T_ * H;    // (T, I)
  // out (T, N) = act(in (T, K) . g^T + bias) + residual (T, N); what the backend's linear runs on the extension.
  const auto gemm = [&](profile::Stage stage, const LayerGemm<T>& g, const T* in, int64_t K, int64_t N,
                        const T* residual, Activation act, T* o) {
    if constexpr (sizeof(T) == 4) {
      if (c.int8) {  // quant.linear's native call: quantize_rows, then the int8 GEMM with its epilogue
        {
          profile::Scope timed(profile::kQuantize);
          quantize_rows(in, K, T_, K, q8.q, q8.scale, q8.zp);
        }
        profile::Scope timed(stage, 2 * T_ * K * N);
        int8_linear(q8.q, K, T_, K, q8.scale, q8.zp, static_cast<const int8_t*>(g.packed), N, g.w_scale, g.colsum,
                    g.bias, act, residual, N, o);
        return;
      }
    }
    profile::Scope timed(stage, 2 * T_ * K * N);
    linear_packed<T>(in, K, static_cast<const T*>(g.packed), g.bias, residual, N, T_, N, K, act, o, N);
  };
  const auto norm = [&](T* y, const T* gamma, const T* beta) {
    profile::Scope timed(profile::kLayerNorm);
    layernorm<T>(y, nullptr, gamma, beta, c.eps, T_, H, y);
  };
  gemm(profile::kQkv, w.qkv, x, H, 3 * H, nullptr, Activation::None, qkv);
  {
    profile::Scope timed(profile::kAttention);
    const AttnStrides st{3 * H, d, 3 * H, d, 3 * H, d};
    attention<T>(qkv, qkv + H, qkv + 2 * H, st, cu_seqlens, batch, c.heads, d, scale, ctx, c.int8, bias);
  }
  gemm(profile::kAttnOut, w.attn_out, ctx, H, H, x, Activation::None, mid);
  norm(mid, w.attn_ln_weight, w.attn_ln_bias);
  gemm(profile::kFfnIn, w.ffn_in, mid, H, I, nullptr, c.act, inner);
  gemm(profile::kFfnOut, w.ffn_out, inner, I, H, mid, Activation::None, out);
  norm(out, w.ffn_ln_weight, w.ffn_ln_bias);
}

template void encoder_layer<float>(const float*, int64_t, const int32_t*, int64_t, float, const LayerWeights<float>&,
                                   const LayerConfig&, float*, const Int8Scratch&, float*,
                                   const AttnBias*);
template void encoder_layer<bf16>(const bf16*, int64_t, const int32_t*, int64_t, float, const LayerWeights<bf16>&,
                                  const LayerConfig&, bf16*, const Int8Scratch&, bf16*,
                                  const AttnBias*);

}  // namespace cpu
}  // namespace bertfast
