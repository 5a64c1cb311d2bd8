// One post-LayerNorm encoder layer on the extension's GEMMs, all in C++: the ops of `reference.layer`
// (QKV GEMM, varlen attention, output GEMM + residual, LayerNorm, FFN-in GEMM + activation,
// FFN-out GEMM + residual, LayerNorm) as the cpu backend runs them (fp32, bf16, or int8 GEMMs), the
// same kernels called in the same order on the same shapes (int8, and fp32's attention block: on groups of rows, whose
// ops are per row or per sequence), so the result is bit-identical to calling them one by one from Python. What it
// saves is the Python between them, and under int8 and fp32 the trips through L3 of the activations between ops.
//
// The residual stream (x, the attention block's output, out) and the LayerNorms are fp32 in every dtype: in bf16
// only the GEMMs' and attention's operands are bf16, rounded once from the stream (to_bf16) where a GEMM reads it.
// Rounding the stream itself to bf16 after every residual add cost ~4x the error (docs/bf16.md#bf16-accuracy).
//
// LoRA adapters per row (LayerLora): each GEMM's rows shrunk from the input the op-by-op path shrinks (the fp32
// stream where a bf16 GEMM rounds it; x itself where int8 carries its codes), then its term added in the GEMM's
// epilogue as there. A shrunk row's bits and an epilogue's are the row's own, so groups and chunks change none.
#include <algorithm>
#include <vector>

#include "cpu/common/kernels.h"
#include "cpu/common/parallel.h"
#include "cpu/gemm/lora.h"
#include "cpu/layer/profile.h"

namespace bertfast {
namespace cpu {

Int8Groups int8_groups(Isa isa) { return amx_kernels(isa) ? Int8Groups{256, 256} : Int8Groups{96, 96}; }

// The end of the group of whole sequences from sequence b0 on: as many as fit in max_rows tokens (kQkvRows for fp32,
// LayerConfig::groups for int8), at least one.
static int64_t group_end(const int32_t* cu, int64_t batch, int64_t b0, int64_t max_rows) {
  int64_t b1 = b0 + 1;
  while (b1 < batch && cu[b1 + 1] - cu[b0] <= max_rows) ++b1;
  return b1;
}

// f(b0, b1, t0, rows) for each group of whole sequences [b0, b1) (group_end), its tokens [t0, t0 + rows); groups of
// no token skipped.
template <typename F>
static void for_each_group(const int32_t* cu, int64_t batch, int64_t max_rows, F&& f) {
  for (int64_t b0 = 0, b1; b0 < batch; b0 = b1) {
    b1 = group_end(cu, batch, b0, max_rows);
    if (cu[b1] > cu[b0]) f(b0, b1, int64_t(cu[b0]), int64_t(cu[b1] - cu[b0]));
  }
}

// The LoRA term of a GEMM on rows [t0, t0 + M) of the call (x: their inputs, rows ldx apart), shrunk now into `term`;
// null where no adapter of the call adapts the GEMM (slot null).
template <typename T>
static const LoraTerm* lora_rows(const LoraSlot* slot, int64_t t0, const T* x, int64_t ldx, int64_t M, int64_t K,
                                 LoraTerm* term) {
  if (slot == nullptr) return nullptr;
  lora_shrink_term(*slot, t0, x, ldx, M, K, term);
  return term;
}

// Codes, scales and zero points of the rows from row t on (rows of H codes).
static Int8Scratch codes_from(const Int8Scratch& s, int64_t t, int64_t H) {
  return {s.q + t * H, s.scale + t, s.zp + t};
}

// The sequences [b0, b1) of a group seen from its first token: cu_seqlens less cu[b0], and the position bias's
// per-token arrays from that token, so the attention reads the group's q, k, v from the first rows of the buffer
// and writes its output to the first rows of ctx. The same rows for every group stay in L2; rows cu[b0] on of a
// T-row buffer, which the previous group's evicted the layer before, were fetched from L3 to be written (MiniLM's
// QKV output for one of fp32's groups: 192 x 1,152 fp32, 864 KiB).
struct GroupView {
  std::vector<int32_t> cu;
  AttnBias shifted{};
  const AttnBias* bias = nullptr;
  GroupView(const int32_t* cu_all, int64_t b0, int64_t b1, const AttnBias* b, int64_t heads) : cu(size_t(b1 - b0 + 1)) {
    const int32_t t0 = cu_all[b0];
    for (int64_t i = b0; i <= b1; ++i) cu[size_t(i - b0)] = cu_all[i] - t0;
    if (b == nullptr) return;
    shifted = *b;
    shifted.pos = b->pos + t0;
    if (b->c2p != nullptr) shifted.c2p = b->c2p + int64_t(t0) * heads * b->cols;
    if (b->p2c != nullptr) shifted.p2c = b->p2c + int64_t(t0) * heads * b->cols;
    bias = &shifted;
  }
};

std::vector<uint8_t> int8_code_forms(const int32_t* cu, int64_t batch, int64_t H, int64_t group) {
  std::vector<uint8_t> form(size_t(cu[batch]));
  for_each_group(cu, batch, group, [&](int64_t, int64_t, int64_t t0, int64_t rows) {
    std::fill(form.begin() + t0, form.begin() + t0 + rows, uint8_t(int8_unsigned_codes(rows, H)));
  });
  return form;
}

// int8's FFN on a group's rows: in chunks of rows (c.groups.ffn) from `mid` (the group's attention block output,
// normalized in place, and its codes in q8: int8_attention_group) into `out`, whose rows are normalized (out's
// LayerNorm) and, with out_codes, quantized for the next layer's QKV GEMM as the FFN-out GEMM finishes them (from L2,
// where a pass in the next layer read them from L3), in the group's form (flip): the next layer's groups are this
// layer's (int8_code_forms). lora: the call's, the group's rows from its first token t0 on.
static void int8_ffn(float* mid, int64_t T_, const LayerWeights<float>& w, const LayerConfig& c, float* inner,
                     const Int8Scratch& q8, float* out, const Int8Scratch* out_codes, const LayerLora& lora,
                     int64_t t0) {
  const int64_t H = c.hidden, I = c.intermediate;
  const bool flip = int8_unsigned_codes(T_, H);  // the group's form: mid's codes (int8_attention_group), out's
  // The FFN in chunks of c.groups.ffn to 2 x c.groups.ffn - 1 rows: a chunk's GELU output (off the amx tiers at most
  // 191 x I fp32, MiniLM's 1.1 MiB) is quantized and multiplied from L2 rather than written out for all T rows and read
  // back from L3; its rows are quantized as the FFN-in GEMM finishes them (int8_linear_then: 48 rows, 288 KiB for
  // MiniLM), since a whole chunk's no longer fits in a 1 MiB L2 beside the weights.
  // Every row gets the same arithmetic whatever its chunk; a chunk has more than 16 rows when T has, so its
  // GEMMs take T's path and the codes int8_attention_group wrote are in the form they multiply (flip).
  const int64_t chunks = std::max<int64_t>(1, T_ / c.groups.ffn);
  const Int8Scratch g8 = codes_from(q8, T_, H);  // a chunk's GELU output, quantized
  float* act = inner;  // a chunk's GELU output: the same rows of the buffer for every chunk, so they stay in L2
  for (int64_t part = 0; part < chunks; ++part) {
    int64_t r0, r1;
    split_range(T_, int(part), int(chunks), &r0, &r1);
    const int64_t rows = r1 - r0;
    const LayerGemm<float>& fi = w.ffn_in;
    const LayerGemm<float>& fo = w.ffn_out;
    const bool flip_out = int8_unsigned_codes(rows, I);
    LoraTerm term;
    {
      profile::Scope timed(profile::kFfnIn, 2 * rows * H * I);
      const LoraTerm* lt = lora_rows(lora.ffn_in, t0 + r0, mid + r0 * H, H, rows, H, &term);  // the normalized rows
      int8_linear_then(q8.q + r0 * H, H, rows, H, q8.scale + r0, q8.zp + r0, static_cast<const int8_t*>(fi.packed), I,
                       fi.w_scale, fi.colsum, fi.bias, c.act, nullptr, I, act, flip, [&](int64_t lo, int64_t hi) {
                         profile::Inner quantizing(profile::kQuantize, profile::kFfnIn);
                         quantize_rows_here(act, I, lo, hi, I, g8.q, g8.scale, g8.zp, flip_out);
                       }, lt);
    }
    profile::Scope timed(profile::kFfnOut, 2 * rows * I * H);
    const LoraTerm* lt = lora_rows(lora.ffn_out, t0 + r0, act, I, rows, I, &term);  // the chunk's GELU output, fp32
    int8_linear_then(g8.q, I, rows, I, g8.scale, g8.zp, static_cast<const int8_t*>(fo.packed), H, fo.w_scale,
                     fo.colsum, fo.bias, Activation::None, mid + r0 * H, H, out + r0 * H, flip_out,
                     [&](int64_t lo, int64_t hi) {
                       {
                         profile::Inner normalizing(profile::kLayerNorm, profile::kFfnOut);
                         layernorm_rows_here(out + r0 * H, w.ffn_ln_weight, w.ffn_ln_bias, c.eps, lo, hi, H);
                       }
                       if (out_codes == nullptr) return;
                       profile::Inner quantizing(profile::kQuantize, profile::kFfnOut);
                       quantize_rows_here(out, H, r0 + lo, r0 + hi, H, out_codes->q, out_codes->scale, out_codes->zp,
                                          flip);
                     }, lt);
  }
}

// int8's attention block on a group of whole sequences (group_end: up to c.groups.group tokens, or one longer sequence
// alone), x its rows: the QKV GEMM, the attention, and the output GEMM (+ the residual x) into mid, whose rows are then
// normalized in place (the attention LayerNorm) and quantized into q8 as the GEMM finishes them (int8_linear_then),
// for the FFN (int8_ffn), in the group's form (flip). The row blocks' codes go where the QKV GEMM's own were,
// which it no longer reads once the block is written. mid, qkv, ctx and q8 are the group's rows from the first row
// of their buffers: the same rows for every group, which stay in L2 (GroupView). x_codes: the QKV GEMM's codes of the
// group's rows, quantized by the previous layer as it normalized x (in this group's form), or nullptr: x quantized
// here into q8. lora: the call's, the group's rows from its first token t0 on (the QKV GEMM's shrunk from x, its
// codes carried or not).
static void int8_attention_group(const float* x, const GroupView& view, int64_t batch, float scale,
                                 const LayerWeights<float>& w, const LayerConfig& c, float* qkv, float* ctx,
                                 const Int8Scratch& q8, float* mid, const Int8Scratch* x_codes, const LayerLora& lora,
                                 int64_t t0) {
  const int64_t H = c.hidden, d = H / c.heads, rows = view.cu[size_t(batch)];
  const AttnStrides st{3 * H, d, 3 * H, d, 3 * H, d};
  const bool from_bf16 = attention_from_bf16(d, view.bias != nullptr) && int8_linear_bf16_supported();
  const bool flip = int8_unsigned_codes(rows, H);
  const Int8Scratch in = x_codes != nullptr ? *x_codes : q8;
  if (x_codes == nullptr) {
    profile::Scope timed(profile::kQuantize);
    quantize_rows(x, H, rows, H, q8.q, q8.scale, q8.zp, flip);
  }
  const int8_t* packed = static_cast<const int8_t*>(w.qkv.packed);
  LoraTerm term;
  if (from_bf16) {  // q, k, v rounded to bf16 by the GEMM's epilogue: half the bytes to the attention, which would
                    // round them itself (attention_from_bf16)
    bf16* qkv16 = reinterpret_cast<bf16*>(qkv);  // the same buffer, half of it
    {
      profile::Scope timed(profile::kQkv, 2 * rows * H * 3 * H);
      const LoraTerm* lt = lora_rows(lora.qkv, t0, x, H, rows, H, &term);
      int8_linear_bf16(in.q, H, rows, H, in.scale, in.zp, packed, 3 * H, w.qkv.w_scale, w.qkv.colsum, w.qkv.bias,
                       qkv16, flip, lt);
    }
    profile::Scope timed(profile::kAttention);
    attention_bf16_products(qkv16, qkv16 + H, qkv16 + 2 * H, st, view.cu.data(), batch, c.heads, d, scale, ctx);
  } else {
    {
      profile::Scope timed(profile::kQkv, 2 * rows * H * 3 * H);
      const LoraTerm* lt = lora_rows(lora.qkv, t0, x, H, rows, H, &term);
      int8_linear(in.q, H, rows, H, in.scale, in.zp, packed, 3 * H, w.qkv.w_scale, w.qkv.colsum, w.qkv.bias,
                  Activation::None, nullptr, 3 * H, qkv, flip, lt);
    }
    profile::Scope timed(profile::kAttention);
    attention<float>(qkv, qkv + H, qkv + 2 * H, st, view.cu.data(), batch, c.heads, d, scale, ctx, true, view.bias);
  }
  // The group's attention output, quantized over its x codes (no longer read), times the output weights.
  {
    profile::Scope timed(profile::kQuantize);
    quantize_rows(ctx, H, rows, H, q8.q, q8.scale, q8.zp, flip);
  }
  profile::Scope timed(profile::kAttnOut, 2 * rows * H * H);
  const LoraTerm* lt = lora_rows(lora.attn_out, t0, ctx, H, rows, H, &term);
  int8_linear_then(q8.q, H, rows, H, q8.scale, q8.zp, static_cast<const int8_t*>(w.attn_out.packed), H,
                   w.attn_out.w_scale, w.attn_out.colsum, w.attn_out.bias, Activation::None, x, H, mid, flip,
                   [&](int64_t lo, int64_t hi) {
                     profile::Inner normalizing(profile::kLayerNorm, profile::kAttnOut);
                     layernorm_rows_here(mid, w.attn_ln_weight, w.attn_ln_bias, c.eps, lo, hi, H);
                     quantize_rows_here(mid, H, lo, hi, H, q8.q, q8.scale, q8.zp, flip);
                   }, lt);
}

// fp32's attention block by the same groups of whole sequences as int8's (int8_attention_block): the QKV GEMM, the
// attention, the output GEMM (+ the residual x) into mid, a group's q, k and v rows through L2 rather than written
// out for all T rows and read back from L3. The GEMMs are per row whatever their row count and the attention per
// sequence, so a row gets the same bits whatever its group. bf16 keeps one call per op: by groups its streaming QKV
// GEMM would read the weights once per group, for no attention gain at its 512-token batches.
static void fp32_attention_block(const float* x, const int32_t* cu, int64_t batch, float scale,
                                 const LayerWeights<float>& w, const LayerConfig& c, float* qkv, float* ctx,
                                 const AttnBias* bias, float* mid, const LayerLora& lora) {
  const int64_t H = c.hidden, d = H / c.heads;
  const AttnStrides st{3 * H, d, 3 * H, d, 3 * H, d};
  for_each_group(cu, batch, kQkvRows, [&](int64_t b0, int64_t b1, int64_t t0, int64_t rows) {
    const GroupView view(cu, b0, b1, bias, c.heads);  // the group's q, k, v and ctx in the buffers' first rows
    LoraTerm term;
    {
      profile::Scope timed(profile::kQkv, 2 * rows * H * 3 * H);
      const LoraTerm* lt = lora_rows(lora.qkv, t0, x + t0 * H, H, rows, H, &term);
      linear_packed<float>(x + t0 * H, H, static_cast<const float*>(w.qkv.packed), w.qkv.bias, nullptr, 3 * H, rows,
                           3 * H, H, Activation::None, qkv, 3 * H, lt);
    }
    {
      profile::Scope timed(profile::kAttention);
      attention<float>(qkv, qkv + H, qkv + 2 * H, st, view.cu.data(), b1 - b0, c.heads, d, scale, ctx, false,
                       view.bias);
    }
    profile::Scope timed(profile::kAttnOut, 2 * rows * H * H);
    const LoraTerm* lt = lora_rows(lora.attn_out, t0, ctx, H, rows, H, &term);
    linear_packed<float>(ctx, H, static_cast<const float*>(w.attn_out.packed), w.attn_out.bias, x + t0 * H,
                         H, rows, H, H, Activation::None, mid + t0 * H, H, lt);
  });
}

template <typename T>
void encoder_layer(const float* x, int64_t tokens, const int32_t* cu_seqlens, int64_t batch, float scale,
                   const LayerWeights<T>& w, const LayerConfig& c, float* work, const Int8Scratch& q8, float* out,
                   const AttnBias* bias, const Int8Scratch* x_codes, const Int8Scratch* out_codes,
                   const LayerLora* adapters) {
  const int64_t T_ = tokens, H = c.hidden, I = c.intermediate;
  const LayerLora lora = adapters != nullptr ? *adapters : LayerLora{};
  // work (layer_work_numel floats): the fp32 attention block output, then the operands in T.
  float* mid = work;                         // (T, H) fp32: after the attention block
  T* qkv = reinterpret_cast<T*>(mid + T_ * H);  // (T, 3H): q | k | v per token
  T* ctx = qkv + T_ * 3 * H;                 // (T, H)
  T* inner = ctx + T_ * H;                   // (T, I)
  T* op = inner + T_ * I;                    // (T, H): bf16 only, the stream rounded for a GEMM
  // The stream (T, H) as a GEMM operand: itself in fp32, rounded to bf16 into `op` in bf16.
  const auto operand = [&](const float* s) -> const T* {
    if constexpr (sizeof(T) == 2) {
      profile::Scope timed(profile::kBf16Operands);
      to_bf16(s, H, T_, H, op);
      return op;
    } else {
      return s;
    }
  };
  // o (T, N) = act(in (T, K) . g^T + bias + lora) + residual (T, N); o and residual fp32 where residual is given (the
  // stream), of type T otherwise. What the backend's linear runs on the extension (fp32 and bf16; int8 runs its own
  // blocks, int8_attention_block and int8_ffn). slot: the GEMM's LoRA, shrunk from `from` (fp32 or T): what the
  // op-by-op path shrinks, the fp32 stream where `in` is its bf16 rounding.
  const auto gemm = [&](profile::Stage stage, const LayerGemm<T>& g, const T* in, int64_t K, int64_t N,
                        const float* residual, Activation act, void* o, const LoraSlot* slot, const auto* from) {
    profile::Scope timed(stage, 2 * T_ * K * N);
    LoraTerm term;
    const LoraTerm* lt = lora_rows(slot, 0, from, K, T_, K, &term);
    const T* packed = static_cast<const T*>(g.packed);
    if constexpr (sizeof(T) == 2) {
      if (residual != nullptr)
        return linear_packed_wide(in, K, packed, g.bias, residual, N, T_, N, K, act, static_cast<float*>(o), N, lt);
      linear_packed<T>(in, K, packed, g.bias, nullptr, N, T_, N, K, act, static_cast<T*>(o), N, lt);
    } else {
      linear_packed<T>(in, K, packed, g.bias, residual, N, T_, N, K, act, static_cast<T*>(o), N, lt);
    }
  };
  const auto norm = [&](float* y, const float* gamma, const float* beta) {
    profile::Scope timed(profile::kLayerNorm);
    layernorm<float>(y, nullptr, gamma, beta, c.eps, T_, H, y);
  };
  if constexpr (sizeof(T) == 4) {
    if (c.int8) {  // by groups of whole sequences, each through the whole layer: its attention block, then its FFN
      // A group's activations (mid, qkv, ctx, codes, the GELU output) in the first rows of their buffers, so they
      // stay in L2 from one op to the next and from one group to the next; only x, out and the codes carried
      // between layers (x_codes, out_codes) are the layer's T rows. Every op is per row or per sequence, so a
      // row's bits do not depend on its group.
      return for_each_group(cu_seqlens, batch, c.groups.group, [&](int64_t b0, int64_t b1, int64_t t0, int64_t rows) {
        const GroupView view(cu_seqlens, b0, b1, bias, c.heads);
        const Int8Scratch in_codes = x_codes != nullptr ? codes_from(*x_codes, t0, H) : Int8Scratch{};
        const Int8Scratch out8 = out_codes != nullptr ? codes_from(*out_codes, t0, H) : Int8Scratch{};
        int8_attention_group(x + t0 * H, view, b1 - b0, scale, w, c, qkv, ctx, q8, mid,
                             x_codes != nullptr ? &in_codes : nullptr, lora, t0);
        int8_ffn(mid, rows, w, c, inner, q8, out + t0 * H, out_codes != nullptr ? &out8 : nullptr, lora, t0);
      });
    }
    fp32_attention_block(x, cu_seqlens, batch, scale, w, c, qkv, ctx, bias, mid, lora);
  } else {
    {
      gemm(profile::kQkv, w.qkv, operand(x), H, 3 * H, nullptr, Activation::None, qkv, lora.qkv, x);
      profile::Scope timed(profile::kAttention);
      const int64_t d = H / c.heads;
      const AttnStrides st{3 * H, d, 3 * H, d, 3 * H, d};
      attention<T>(qkv, qkv + H, qkv + 2 * H, st, cu_seqlens, batch, c.heads, d, scale, ctx, false, bias);
    }
    gemm(profile::kAttnOut, w.attn_out, ctx, H, H, x, Activation::None, mid, lora.attn_out, ctx);
  }
  if constexpr (sizeof(T) == 2) {  // the LayerNorm and the FFN-in operand's rounding in one pass (same bits)
    {
      profile::Scope timed(profile::kLayerNorm);
      layernorm_to_bf16(mid, w.attn_ln_weight, w.attn_ln_bias, c.eps, T_, H, op);
    }
    gemm(profile::kFfnIn, w.ffn_in, op, H, I, nullptr, c.act, inner, lora.ffn_in, mid);
  } else {
    norm(mid, w.attn_ln_weight, w.attn_ln_bias);
    gemm(profile::kFfnIn, w.ffn_in, operand(mid), H, I, nullptr, c.act, inner, lora.ffn_in, mid);
  }
  gemm(profile::kFfnOut, w.ffn_out, inner, I, H, mid, Activation::None, out, lora.ffn_out, inner);
  norm(out, w.ffn_ln_weight, w.ffn_ln_bias);
}

template void encoder_layer<float>(const float*, int64_t, const int32_t*, int64_t, float, const LayerWeights<float>&,
                                   const LayerConfig&, float*, const Int8Scratch&, float*, const AttnBias*,
                                   const Int8Scratch*, const Int8Scratch*, const LayerLora*);
template void encoder_layer<bf16>(const float*, int64_t, const int32_t*, int64_t, float, const LayerWeights<bf16>&,
                                  const LayerConfig&, float*, const Int8Scratch&, float*, const AttnBias*,
                                  const Int8Scratch*, const Int8Scratch*, const LayerLora*);

}  // namespace cpu
}  // namespace bertfast
