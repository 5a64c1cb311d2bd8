// The kernels' entry points, one per op: embeddings, layernorm, attention, GEMMs, int8 quantization, the layer.
//
// Raw pointers: shapes, strides and indices are validated once, at the boundary (csrc/bindings/checks.h).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "cpu/common/activation.h"
#include "cpu/common/isa.h"
#include "cpu/common/types.h"

namespace bertfast {
namespace cpu {

struct LoraTerm;  // cpu/gemm/lora.h
struct LoraSlot;  // cpu/gemm/lora.h

// ---- embeddings.cpp ----

// out[t, :] = LayerNorm(word[ids[t]] + type[types[t]] + pos[positions[t]]); types/type and positions/pos may be
// null (no token types; no position table: rotary models). W, T: float, float; bf16, bf16; or bf16, float (a bf16
// word table, the rest and out fp32: the fp32 residual stream of a bf16 forward).
template <typename W, typename T>
void embeddings(const int64_t* ids, const int64_t* positions, const int64_t* types, const W* word, const T* pos,
                const T* type, const T* gamma, const T* beta, float eps, int64_t tokens, int64_t hidden, T* out);

// ---- layernorm.cpp ----

// out[t, :] = LayerNorm(x[t, :] + residual[t, :]) with fp32 statistics; residual may be null; out may alias
// x or residual.
template <typename T>
void layernorm(const T* x, const T* residual, const T* gamma, const T* beta, float eps, int64_t tokens,
               int64_t hidden, T* out);

// ---- attention*.cpp ----

// Varlen attention: q/k/v element (t, h, e) at ptr[t * row_stride + h * head_stride + e];
// out: [T, heads * head_dim] contiguous. bf16_products: fp32 inputs may run the two products on bf16
// operands (AMX; or AVX-512 BF16 without a position bias or window, P rounded once; fp32 accumulation and softmax)
// where the CPU has it, or on AVX-512 VNNI without AVX-512 BF16 on int16 codes of 12-13 bits (no position bias or
// window; attention_avx512int16.cpp): the int8 path asks for it. bf16 inputs run their products on bf16 operands wherever the CPU
// has them (AMX tiles, or AVX-512 BF16 without a position bias), P in two bf16 parts.
struct AttnStrides {
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;
};
// Whether the bf16-product attention on AVX-512 BF16 (attention_avx512bf16.cpp) runs for a layer of this head_dim
// with (bias_or_window) or without a position bias or window (attention<bf16> asks with its bias alone: that kernel
// takes the bf16 dtype's window); then attention_bf16_products takes q, k, v already rounded to bf16
// (int8_linear_bf16's output) into fp32 rows: the same arithmetic on the same bf16 values.
bool attention_from_bf16(int64_t head_dim, bool bias_or_window);
// Whether fp32 attention with bf16_products runs the int16 products (attention_avx512int16.cpp) for a layer of this
// head_dim with or without a position bias or window.
bool attention_int16(int64_t head_dim, bool bias_or_window);
// An additive relative position bias (MPNet): score(t, u) += table[h * width + (width - 1) / 2 + pos[u] - pos[t]]
// for tokens t, u of one sequence, pos: (T,) the tokens' positions, table: (heads, width) fp32 per distance,
// width odd and covering every distance within a sequence (checked at the boundary): linear in length.
// DeBERTa-v2's disentangled terms instead (index != nullptr, table == nullptr): c = index[(width - 1) / 2 + pos[t] -
// pos[u]] and score(t, u) += c2p[(t * heads + h) * cols + c] + p2c[(u * heads + h) * cols + c], each table (T,
// heads, cols) fp32 or absent (nullptr), index: (width,) int32 with values in [0, cols) (checked at the boundary).
struct AttnBias {
  const float* table;
  int64_t width;
  const int32_t* pos;
  const float* c2p = nullptr;
  const float* p2c = nullptr;
  const int32_t* index = nullptr;
  int64_t cols = 0;
};
// window > 0: sliding-window attention, token t sees only the tokens u of its sequence with |t - u| <= window
// (key tiles outside every query's window are never visited).
template <typename T>
void attention(const T* q, const T* k, const T* v, const AttnStrides& s, const int32_t* cu_seqlens,
               int64_t batch, int64_t heads, int64_t head_dim, float scale, T* out, bool bf16_products = false,
               const AttnBias* bias = nullptr, int64_t window = 0);
void attention_bf16_products(const bf16* q, const bf16* k, const bf16* v, const AttnStrides& s,
                             const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t head_dim, float scale,
                             float* out);

// ---- disentangled.cpp ----

// DeBERTa-v2's per-token position terms: out[(t * heads + h) * rows + r] = scale * sum_e x[t, h, e] * pos[r, h, e],
// x element (t, h, e) at x[t * ld_row + h * ld_head + e], pos: (rows, heads * head_dim) contiguous. Each entry is
// one dot product over e in order, the same code for every token count (a row's terms do not depend on T).
// windows: nullptr (every entry) or (tokens, 2) int32, token t's entries [windows[2t], windows[2t + 1]) the only
// ones it needs (the columns its sequence's distances reach): those are written, possibly more (whole 16-column
// groups), the rest are left as they were. An entry has the same bits either way.
template <typename T>
void position_scores(const T* x, int64_t ld_row, int64_t ld_head, int64_t tokens, int64_t heads, int64_t head_dim,
                     const T* pos, int64_t rows, float scale, float* out, const int32_t* windows = nullptr);

// ---- rotary.cpp ----

// RoPE in place, half-split convention: head h of token t is the row x[t * ld_row + h * ld_head + e], e < head_dim
// (even); cos, sin: (tokens, head_dim / 2) fp32 contiguous. Exact fp32 math (no fused multiply-add).
template <typename T>
void rotary(T* x, int64_t ld_row, int64_t ld_head, int64_t tokens, int64_t heads, int64_t head_dim, const float* cos,
            const float* sin);

// ---- glu.cpp ----

// The gate of a GLU FFN: out (M, N) contiguous = act(h[:, :N]) * h[:, N:] for h (M, 2N) with row stride ldh.
template <typename T>
void glu(const T* h, int64_t ldh, int64_t M, int64_t N, Activation act, T* out);

// ---- linear*.cpp: GEMM on prepacked weights ----

// out[m, n] = act(x[m, :] . w[n, :] + bias[n]) + residual[m, n]. Any M; out must not overlap x or residual.
// Built for few rows (streaming the weights); fp32 with AVX-512 also runs large M (blocked), bf16 and the
// portable kernels are meant for small M only.
// Packed layout (linear_pack.cpp): panels of kPanel output columns; fp32: [panels][K][kPanel]; bf16:
// [panels][ceil(K/2)][kPanel][2] (pairs along K for vdpbf16ps), zero padded in N and K.
constexpr int64_t kPanel = 48;
int64_t packed_numel(int64_t n, int64_t k, bool is_bf16);
template <typename T>
void pack_linear(const T* w, int64_t n, int64_t k, T* packed);
template <typename T>
void linear_packed(const T* x, int64_t ldx, const T* packed, const T* bias, const T* residual, int64_t ldr,
                   int64_t m, int64_t n, int64_t k, Activation act, T* out, int64_t ldo,
                   const LoraTerm* lora = nullptr);
// The same on bf16 operands (x, packed, bias) with residual and out in fp32: a bf16 forward's residual stream
// (layer.cpp). Every row's value is linear_packed<bf16>'s before its final rounding. lora (both): the rows' LoRA
// terms (cpu/gemm/lora.h) added before the activation, act(x w^T + bias + lora) + residual, or null.
void linear_packed_wide(const bf16* x, int64_t ldx, const bf16* packed, const bf16* bias, const float* residual,
                        int64_t ldr, int64_t m, int64_t n, int64_t k, Activation act, float* out, int64_t ldo,
                        const LoraTerm* lora = nullptr);

// ---- lora.cpp: the shrink of LoRA terms (cpu/gemm/lora.h) ----

// s[m, 0:ranks[f]) = x[m] . at[f] for each row m whose index[m] = f >= 0 (rows of index -1 untouched): x (M, K) rows
// ldx apart, at[f] A^T of factor f (K, ranks[f]) fp32 with ranks[f] a multiple of 16; s rows lds apart. tiles: per
// factor its A^T in tile form or null (lora.h); on the AMX tiers a factor with one is shrunk on the tiles.
template <typename T>
void lora_shrink(const T* x, int64_t ldx, int64_t M, int64_t K, const int32_t* index, const float* const* at,
                 const int64_t* ranks, float* s, int64_t lds, const bf16* const* tiles = nullptr);
// The LoraTerm of a GEMM on rows [t0, t0 + M) of `slot` (x (M, K): their inputs, rows ldx apart): their shrink
// computed now (lora_shrink) into the slot's rows of s, which the term reads.
template <typename T>
void lora_shrink_term(const LoraSlot& slot, int64_t t0, const T* x, int64_t ldx, int64_t M, int64_t K,
                      LoraTerm* term);

// ---- convert.cpp: fp32 rows to bf16 (round to nearest even, as torch's .to(torch.bfloat16)) ----

// out (M, K) contiguous = x (M, K) with rows ldx apart, rounded to bf16: the operands of a bf16 GEMM from an fp32
// residual stream.
void to_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, bf16* out);
// LayerNorm of fp32 rows x (T, H) in place (layernorm<float>, no residual), each row then rounded to bf16 into out
// (T, H) while it is in cache: the bits of layernorm and to_bf16, one pass (layernorm_then: below).
void layernorm_to_bf16(float* x, const float* gamma, const float* beta, float eps, int64_t T, int64_t H, bf16* out);

// ---- sparse_pool*.cpp: SPLADE's pooling in the vocabulary GEMM's epilogue ----

// out (batch, V) fp32 = reduce over the tokens t of each sequence (cu_seqlens) of f(x[t] . w[v] + bias[v]),
// f = log1p(relu(.)), applied twice when `twice` (log1p_relu); x (T, K) rows ldx apart and w packed by pack_linear,
// both fp32 or both bf16 (fp32 accumulation; on AMX tiles where the tier has them); bias (V,) fp32 or null. The
// (T, V) logits are never stored; a row's result does not depend on the batch, bit for bit.
enum class SparsePooling : int { Max = 0, Sum = 1 };
void sparse_pool(const float* x, int64_t ldx, const int32_t* cu_seqlens, int64_t batch, const float* packed,
                 const float* bias, int64_t V, int64_t K, SparsePooling pooling, bool twice, float* out);
void sparse_pool(const bf16* x, int64_t ldx, const int32_t* cu_seqlens, int64_t batch, const bf16* packed,
                 const float* bias, int64_t V, int64_t K, SparsePooling pooling, bool twice, float* out);

// ---- pool_rows.cpp: sentence pooling on the packed tokens (bertfast/sentence.py's pool_packed) ----

// out (batch, H) = per sequence of cu_seqlens, over its tokens of x (T, H) rows ldx apart: the mean (kMean) or the
// first token (kCls); zeros for a sequence without tokens.
enum class RowPooling : int { kCls = 0, kMean = 1 };
void pool_rows(const float* x, int64_t ldx, int64_t H, const int32_t* cu_seqlens, int64_t batch, RowPooling mode,
               float* out);

// ---- int8 dynamic quantization (quantize_rows.cpp; used by bertfast/backends/cpu/quant.py) ----

// Per-token asymmetric int8 quantization of x (M, K) fp32 with row stride ldx: q (M, K) int8 contiguous,
// scale (M,) fp32 and zero point (M,) int32 per row (the math of quant.quantize_rows_reference). flip: the codes
// written as unsigned bytes, q ^ 0x80 = q + 128, the form int8_linear's vpdpbusd kernels multiply
// (int8_unsigned_codes).
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* scale, int32_t* zp,
                   bool flip = false);
// quantize_rows on rows [lo, hi) of x, on the calling thread (one of a parallel region's: no team of its own); q,
// scale and zp indexed by row as there.
void quantize_rows_here(const float* x, int64_t ldx, int64_t lo, int64_t hi, int64_t K, int8_t* q, float* scale,
                        int32_t* zp, bool flip);
// layernorm_to_bf16's pass (layernorm.cpp): x (T, H) normalized in place as layernorm<float> (no residual) in
// chunks of rows on the team, then(lo, hi) on each chunk's rows [lo, hi) by the thread that normalized them.
void layernorm_then(float* x, const float* gamma, const float* beta, float eps, int64_t T, int64_t H,
                    const std::function<void(int64_t lo, int64_t hi)>& then);
// Rows [lo, hi) of x (rows H floats apart) normalized in place as layernorm<float> (no residual), on the calling
// thread (one of a parallel region's: no team of its own).
void layernorm_rows_here(float* x, const float* gamma, const float* beta, float eps, int64_t lo, int64_t hi, int64_t H);

// ---- int8_linear*.cpp: int8 GEMM (the quant_linear op) ----

// Any M, on every tier: weights packed once by pack_int8 ([N/16][K/4][16][4] int8, zero padded); x the signed
// codes of quantize_rows, or with x_unsigned their unsigned form (quantize_rows' flip) where
// int8_unsigned_codes(M, K) says the call's kernel takes it; out (M, N) fp32 =
// act(xs[m] * (ws[n] * sum_k q[m, k] w[n, k] - zp[m] * colsum[n]) + bias[n] + lora[m, n]) + residual[m, n]
// (lora: the rows' LoRA terms, cpu/gemm/lora.h, or null).
int64_t int8_packed_numel(int64_t n, int64_t k);
void pack_int8(const int8_t* w, int64_t n, int64_t k, int8_t* packed);
void int8_linear(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const float* xs, const int32_t* zp,
                 const int8_t* packed, int64_t N, const float* ws, const float* colsum, const float* bias,
                 Activation act, const float* residual, int64_t ldr, float* out, bool x_unsigned = false,
                 const LoraTerm* lora = nullptr);
// int8_linear, then then(lo, hi) on output rows [lo, hi) once all their columns are written: on the blocked paths
// of the AVX-512, avx2 and portable tiers each row block by the thread that wrote its last columns (in cache), on the
// AMX and streaming ones in chunks of rows shared out to the GEMM's threads at the end. then must take disjoint row
// ranges on several threads at once.
void int8_linear_then(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const float* xs, const int32_t* zp,
                      const int8_t* packed, int64_t N, const float* ws, const float* colsum, const float* bias,
                      Activation act, const float* residual, int64_t ldr, float* out, bool x_unsigned,
                      const std::function<void(int64_t lo, int64_t hi)>& then, const LoraTerm* lora = nullptr);
// Whether int8_linear on M x K codes runs a kernel of unsigned bytes (vpdpbusd: the blocked AVX-512 VNNI and AVX-VNNI
// paths) that reads them from a row-major buffer K wide (K % 4 == 0): then its caller may quantize with flip and
// pass x_unsigned, sparing the GEMM its own pass flipping the codes (same bits).
bool int8_unsigned_codes(int64_t M, int64_t K);
// int8_linear without activation or residual (with its LoRA terms), its output rounded to bf16 (round to nearest
// even) into out (M, N), as its fp32 output rounded; only where int8_linear_bf16_supported() (the avx512_vnni tier),
// else it aborts.
bool int8_linear_bf16_supported();
void int8_linear_bf16(const int8_t* x, int64_t ldx, int64_t M, int64_t K, const float* xs, const int32_t* zp,
                      const int8_t* packed, int64_t N, const float* ws, const float* colsum, const float* bias,
                      bf16* out, bool x_unsigned = false, const LoraTerm* lora = nullptr);

// ---- layer.cpp: one post-LayerNorm encoder layer on the extension's GEMMs ----

// One GEMM of a layer: the weight packed by pack_linear (elements of T), or by pack_int8 (int8, T = float;
// then w_scale and colsum per output channel as int8_linear takes them); bias (N,).
template <typename T>
struct LayerGemm {
  const void* packed;
  const T* bias;
  const float* w_scale;
  const float* colsum;
};
// A layer's weights: the GEMMs' of type T, the LayerNorms' fp32 (they run on the fp32 residual stream).
template <typename T>
struct LayerWeights {
  LayerGemm<T> qkv, attn_out, ffn_in, ffn_out;
  const float *attn_ln_weight, *attn_ln_bias, *ffn_ln_weight, *ffn_ln_bias;
};
// A layer's sizes and options.
// int8's layer runs by groups of whole sequences of at most `group` tokens (one longer sequence in a group of its own),
// its FFN in chunks of `ffn` to 2 x ffn - 1 rows (fewer only where the group has fewer) (layer.cpp). Every op is per
// row or per sequence, so neither changes a bit.
struct Int8Groups {
  int64_t group, ffn;
};
// On the amx tiers 256 and 256, the AMX GEMM's work item (kAmxMaxItemRows): it streams each weight sub-panel from L3
// once an item, so a 96-row group paid that once per 96 rows. Elsewhere 96 and 96: a group's q, k, v (MiniLM: 96 x
// 1,152 fp32, 432 KiB) and a chunk's GELU output stay in a 1 MiB L2 beside the weights.
Int8Groups int8_groups(Isa isa);
struct LayerConfig {
  int64_t hidden, intermediate, heads;  // hidden = heads * head_dim
  float eps;
  Activation act;
  bool int8;  // int8 GEMMs with x quantized per token (T = float), attention's products in bf16
  Int8Groups groups{96, 96};  // int8's (int8_groups of the call's tier)
};
// A layer call's LoRA terms: per GEMM its rows' operands before their shrink (the call's tokens' rows), which the
// layer computes on the GEMM's own input as the op-by-op path does (lora_shrink_term), or null where no adapter of the
// call adapts that GEMM.
struct LayerLora {
  const LoraSlot *qkv, *attn_out, *ffn_in, *ffn_out;
};
// Scratch: work, layer_work_numel(T, H, I) floats; under int8 also codes, int8_codes_numel(T, H, I, ffn) int8 (a
// GEMM operand's T rows of up to H, then one FFN chunk's rows of I), with a scale and a zero point per row
// (int8_codes_rows).
constexpr int64_t layer_work_numel(int64_t tokens, int64_t hidden, int64_t intermediate) {
  return tokens * (5 * hidden + intermediate);
}
// fp32's QKV GEMM, attention and output GEMM run by groups of whole sequences of at most kQkvRows tokens (layer.cpp;
// one longer sequence in a group of its own); fp32's weights are 4x int8's bytes, read once a group.
constexpr int64_t kQkvRows = 192;
constexpr int64_t int8_codes_rows(int64_t tokens, int64_t ffn) {  // the operand's T rows, then a chunk's GELU output
  return tokens + (tokens < 2 * ffn ? tokens : 2 * ffn);
}
constexpr int64_t int8_codes_numel(int64_t tokens, int64_t hidden, int64_t intermediate, int64_t ffn) {
  return tokens * hidden + (tokens < 2 * ffn ? tokens : 2 * ffn) * intermediate;
}
struct Int8Scratch {
  int8_t* q;
  float* scale;
  int32_t* zp;
};
// Per token, whether its group's QKV GEMM takes the codes unsigned (int8_unsigned_codes of the group's rows, groups of
// at most `group` tokens: LayerConfig::groups): the form encoder_layer's out_codes are written in, which its x_codes
// must have been.
std::vector<uint8_t> int8_code_forms(const int32_t* cu_seqlens, int64_t batch, int64_t hidden, int64_t group);
// out (T, H) = the layer applied to x (T, H), sequences delimited by cu_seqlens; x and out fp32 (the residual
// stream) whatever T, the GEMMs' operand type. int8 only, each optional (T rows, H codes a row): x_codes, x's codes
// as the previous call's out_codes wrote them for the same cu_seqlens and tier (its QKV GEMM then quantizes nothing);
// out_codes, where out's are written, each row as its group's QKV GEMM takes it (the next layer's x_codes). The two
// may be one buffer: x's codes are read before out's are written. lora: the rows' LoRA terms of the four GEMMs, or
// null (each GEMM's shrink reads its fp32 or bf16 input as the op-by-op path's does: for the QKV GEMM x itself, even
// where its codes are carried).
template <typename T>
void encoder_layer(const float* x, int64_t tokens, const int32_t* cu_seqlens, int64_t batch, float scale,
                   const LayerWeights<T>& w, const LayerConfig& c, float* work, const Int8Scratch& q8, float* out,
                   const AttnBias* bias = nullptr, const Int8Scratch* x_codes = nullptr,
                   const Int8Scratch* out_codes = nullptr, const LayerLora* lora = nullptr);

}  // namespace cpu
}  // namespace bertfast
