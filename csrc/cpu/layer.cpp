// One post-LayerNorm encoder layer on the small-M path, all in C++: the ops of bertfast/engine.py's layer
// loop (QKV GEMM, varlen attention, output GEMM + residual, LayerNorm, FFN-in GEMM + activation,
// FFN-out GEMM + residual, LayerNorm), the same kernels called in the same order on the same
// shapes, so the result is bit-identical to calling them one by one from Python. What it saves is
// the Python between them: BERT-base at b1 x s16 spent ~0.7 ms of an ~18 ms fp32 forward outside the
// kernels.
#include "common.h"

namespace bertfast {
namespace cpu {

template <typename T>
void encoder_layer(const T* x, int64_t tokens, const int32_t* cu_seqlens, int64_t batch, float scale,
                   const LayerPtrs<T>& w, T* work, T* out) {
  const int64_t T_ = tokens, H = w.hidden, I = w.intermediate, d = H / w.heads;
  T* qkv = work;               // (T, 3H): q | k | v per token
  T* ctx = qkv + T_ * 3 * H;   // (T, H)
  T* mid = ctx + T_ * H;       // (T, H): after the attention block
  T* inner = mid + T_ * H;     // (T, I)
  linear_small_m<T>(x, H, w.qkv, w.qkv_bias, nullptr, 0, T_, 3 * H, H, Act::None, qkv, 3 * H);
  const AttnStrides st{3 * H, d, 3 * H, d, 3 * H, d};
  attention<T>(qkv, qkv + H, qkv + 2 * H, st, cu_seqlens, batch, w.heads, d, scale, ctx);
  linear_small_m<T>(ctx, H, w.attn_out, w.attn_out_bias, x, H, T_, H, H, Act::None, mid, H);
  layernorm<T>(mid, nullptr, nullptr, w.attn_ln_weight, w.attn_ln_bias, w.eps, T_, H, mid);
  linear_small_m<T>(mid, H, w.ffn_in, w.ffn_in_bias, nullptr, 0, T_, I, H, w.act, inner, I);
  linear_small_m<T>(inner, I, w.ffn_out, w.ffn_out_bias, mid, H, T_, H, I, Act::None, out, H);
  layernorm<T>(out, nullptr, nullptr, w.ffn_ln_weight, w.ffn_ln_bias, w.eps, T_, H, out);
}

template void encoder_layer<float>(const float*, int64_t, const int32_t*, int64_t, float, const LayerPtrs<float>&,
                                   float*, float*);
template void encoder_layer<bf16>(const bf16*, int64_t, const int32_t*, int64_t, float, const LayerPtrs<bf16>&,
                                  bf16*, bf16*);

}  // namespace cpu
}  // namespace bertfast
