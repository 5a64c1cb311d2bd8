// The one Python module of the native CPU backend, `bertfast._C`: validates every input at the boundary
// (device, dtype, shape, strides, index ranges) and raises ValueError with a message before any kernel
// runs, then calls the kernels in csrc/cpu/ on raw pointers with the GIL released.
//
// Ops and their kernels (csrc/cpu/<folder>/): embeddings, layernorm, rotary_, glu, Layer, pool_rows (layer/: the
// file of that name), attention (attention/attention*.cpp), pack_linear and linear (gemm/linear_pack.cpp,
// gemm/linear*.cpp), LoraTerm, LoraSlot and lora_shrink (gemm/lora.h, gemm/lora.cpp; bindings/lora.h), sparse_pool
// (gemm/sparse_pool*.cpp), quantize_rows, pack_int8 and quant_linear
// (int8/quantize_rows.cpp, int8/int8_linear*.cpp), WordPiece (text/wordpiece.cpp; bindings/wordpiece.h),
// isa / detected_isa / set_isa / isa_supported / has_avx512_bf16 / set_avx512_bf16 / has_avx_vnni (common/isa.cpp),
// num_threads (common/parallel.h), profile_enable / profile_counters (layer/profile.h: bertfast/profiling.py).
// `bertfast._C.testing`, knobs for tests and measurement only: amx_gemm / set_amx_gemm / amx_blocking /
// set_amx_blocking (gemm/amx_gemm.cpp), activation_cache_stats (bindings/alloc.cpp), bf16_conversions
// (common/amx_emulation.cpp), set_avx_vnni (common/isa.cpp), and the choosers' answers on given arguments:
// attention_path, gemm_path, int8_path, sparse_pool_path, position_scores_path (attention/attention.cpp,
// gemm/linear.cpp, int8/int8_linear.cpp, gemm/sparse_pool.cpp, attention/disentangled.cpp).
//
// The files: bindings/checks.h (the input checks), bindings/ops.h and ops.cpp (the op wrappers), bindings/layer.h
// (Layer), bindings/alloc.h and alloc.cpp (huge pages for packed weights); this one only binds. Only this file
// includes the full torch headers (slow to compile); the others include the ATen headers they use.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "bindings/layer.h"
#include "bindings/lora.h"
#include "bindings/ops.h"
#include "bindings/wordpiece.h"
#include "cpu/common/isa.h"
#include "cpu/common/parallel.h"

using namespace bertfast::bindings;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "bertfast native CPU kernels (fp32 and bf16, packed [T, H] token layout)";
  m.def("embeddings", &embeddings,
        "LayerNorm(word[ids] + type[types] + position[positions]) -> (T, H) in ln_weight's dtype; no token types or "
        "no position table (rotary models): those terms left out; the word table float32 or bfloat16, the other "
        "tables and the LayerNorm of its dtype, or float32 beside a bfloat16 one",
        py::arg("input_ids"), py::arg("position_ids"), py::arg("token_type_ids"), py::arg("word"),
        py::arg("position"), py::arg("token_type"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"));
  m.def("layernorm", &layernorm, "LayerNorm(x + residual) over the last dim, fp32 statistics", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("attention", &attention,
        "varlen attention on packed q, k, v (T, heads, d) -> (T, heads * d); bf16_products: fp32 inputs may "
        "run the products on bf16 operands (AMX, or AVX-512 BF16 without a bias or window; fp32 accumulation and "
        "softmax); bias_table (heads, width) float32 "
        "and bias_positions (T,) int32: score(t, u) += bias_table[h, (width - 1) / 2 + pos[u] - pos[t]] (MPNet); "
        "window > 0: token t attends only to the tokens u of its sequence with |t - u| <= window; DeBERTa-v2 "
        "instead of bias_table: c2p, p2c (T, heads, cols) float32 (either may be None) and rel_index (width,) int32: "
        "c = rel_index[(width - 1) / 2 + pos[t] - pos[u]], score(t, u) += c2p[t, h, c] + p2c[u, h, c]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens"), py::arg("max_seqlen"), py::arg("scale"),
        py::arg("bf16_products") = false, py::arg("bias_table") = py::none(), py::arg("bias_positions") = py::none(),
        py::arg("window") = 0, py::arg("c2p") = py::none(), py::arg("p2c") = py::none(),
        py::arg("rel_index") = py::none());
  m.def("position_scores", &position_scores,
        "DeBERTa-v2's per-token position terms: x (T, heads, d) rows any stride apart, pos (rows, heads * d) "
        "contiguous of x's dtype -> (T, heads, rows) float32, scale * x[t, h] . pos[r, h]; windows: None or (T, 2) "
        "int32, the columns [lo, hi) token t needs: only those are sure to be written",
        py::arg("x"), py::arg("pos"), py::arg("scale"), py::arg("windows") = py::none());
  m.def("rotary_", &rotary_,
        "RoPE in place, half-split convention, exact fp32 math: x (T, heads, d) rows and heads any stride apart, "
        "cos and sin (T, d / 2) float32; returns x",
        py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("glu", &glu, "the gate of a GLU FFN: h (M, 2N) -> act(h[:, :N]) * h[:, N:] (M, N), fp32 math", py::arg("h"),
        py::arg("act"));
  m.def("pack_linear", &pack_linear, "pack a (N, K) weight for `linear`", py::arg("weight"));
  m.def("linear", &linear,
        "act(x @ w.T + bias + lora) + residual on a packed weight (streaming at small M; fp32 blocked at large M); "
        "act in none|gelu|gelu_tanh|relu|tanh|silu; lora: a LoraTerm (the rows' LoRA terms) or None; float_out: "
        "a float32 output from a bf16 weight (as a float32 residual gives)",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("act") = "none", py::arg("residual") = py::none(), py::arg("lora") = py::none(),
        py::arg("float_out") = false);
  py::class_<LoraOperands>(m, "LoraTerm",
                           "the LoRA terms of one linear call, added in its epilogue before the activation: row m "
                           "adds s[m] . bt of factor index[m] (none where it is -1); s (M, R) float32 (lora_shrink), "
                           "index (M,) int32, per factor bt (float32: per segment, per 16-column group, its rows "
                           "k0..k1 of 16 floats) and seg ((segments, 3) int32: k0, k1 and the offset in bt of each "
                           "segment), segments of `width` outputs; bt_tiles: per factor B in the AMX expand's "
                           "tile form instead of bt (then empty), which only the amx tiers' GEMMs take")
      .def(py::init<at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t,
                    std::vector<at::Tensor>>(),
           py::arg("s"), py::arg("index"), py::arg("bt"), py::arg("seg"), py::arg("width"),
           py::arg("bt_tiles") = std::vector<at::Tensor>());
  py::class_<LoraSlotOperands>(m, "LoraSlot",
                                "the LoRA operands of one GEMM of a `Layer` call before their shrink, which the layer "
                                "computes on that GEMM's own input: index (T,) int32 (-1: no term), per factor at "
                                "(A.T as lora_shrink takes it), bt and seg (as LoraTerm takes them, seg's ranks within "
                                "the factor's), segments of `width` outputs; tiles: per factor A.T in tile form "
                                "(as lora_shrink takes it) or empty")
      .def(py::init<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t,
                    std::vector<at::Tensor>, std::vector<at::Tensor>>(),
           py::arg("index"), py::arg("at"), py::arg("bt"), py::arg("seg"), py::arg("width"),
           py::arg("tiles") = std::vector<at::Tensor>(), py::arg("bt_tiles") = std::vector<at::Tensor>());
  m.def("lora_shrink", &lora_shrink,
        "s (M, R) float32 = x @ A.T per row on factor index[m] (int32; -1: a zero row); at: per factor A.T (K, r) "
        "float32 contiguous, r a multiple of 16; R the widest r; each value's bits depend on its row alone; tiles: "
        "per factor A.T in tile form (bfloat16, R/16 x ceil(K/32) x 1024: per rank group and K step hi then lo), "
        "which the AMX tiers shrink on, or empty",
        py::arg("x"), py::arg("index"), py::arg("at"), py::arg("tiles") = std::vector<at::Tensor>());
  py::class_<LayerTensors>(m, "LayerWeights",
                           "the weights of one encoder layer for `Layer`, as keyword arguments: qkv, attn_out, "
                           "ffn_in, ffn_out packed by pack_linear (or pack_int8, with int8_scales and int8_colsums, "
                           "one per GEMM in that order), their biases (qkv_bias, ...), attn_ln_weight, "
                           "attn_ln_bias, ffn_ln_weight, ffn_ln_bias")
      .def(py::init([](at::Tensor qkv, at::Tensor qkv_bias, at::Tensor attn_out, at::Tensor attn_out_bias,
                       at::Tensor attn_ln_weight, at::Tensor attn_ln_bias, at::Tensor ffn_in, at::Tensor ffn_in_bias,
                       at::Tensor ffn_out, at::Tensor ffn_out_bias, at::Tensor ffn_ln_weight, at::Tensor ffn_ln_bias,
                       c10::optional<std::vector<at::Tensor>> int8_scales,
                       c10::optional<std::vector<at::Tensor>> int8_colsums) {
             return LayerTensors{qkv,         qkv_bias,      attn_out,      attn_out_bias, attn_ln_weight,
                                 attn_ln_bias, ffn_in,       ffn_in_bias,   ffn_out,       ffn_out_bias,
                                 ffn_ln_weight, ffn_ln_bias, int8_scales,   int8_colsums};
           }),
           py::kw_only(), py::arg("qkv"), py::arg("qkv_bias"), py::arg("attn_out"), py::arg("attn_out_bias"),
           py::arg("attn_ln_weight"), py::arg("attn_ln_bias"), py::arg("ffn_in"), py::arg("ffn_in_bias"),
           py::arg("ffn_out"), py::arg("ffn_out_bias"), py::arg("ffn_ln_weight"), py::arg("ffn_ln_bias"),
           py::arg("int8_scales") = py::none(), py::arg("int8_colsums") = py::none());
  py::class_<LayerCarry>(m, "LayerCarry",
                         "what an int8 `Layer` call leaves for the next: its output's codes for the next layer's QKV "
                         "GEMM (pass one to each layer of a forward in turn, as `carry=`; the outputs are the same)")
      .def(py::init<>())
      .def_property_readonly(
          "codes",
          [](const LayerCarry& c) -> py::object {
            if (!c.out.defined()) return py::none();
            return py::make_tuple(c.q, c.scale, c.zp);
          },
          "(q (T, H) int8, scale (T,), zero_point (T,)) of the last output, each row in the form its group's QKV "
          "GEMM takes (unsigned: q ^ 0x80, as quantize_rows' flip); None before an int8 call");
  py::class_<Layer>(m, "Layer",
                    "one post-LayerNorm encoder layer on packed weights (a LayerWeights), run whole in C++ on the "
                    "extension's GEMMs; call it with (x, cu_seqlens, max_seqlen, scale[, bias_table, bias_positions]), "
                    "the bias as in `attention`; carry: a LayerCarry, the same one for each layer of a forward in "
                    "turn; lora: the rows' LoRA adapters, a LoraSlot or None per GEMM (qkv, attn_out, ffn_in, "
                    "ffn_out), their terms computed as `linear` adds a LoraTerm's (the same bits); lora_index: per "
                    "GEMM (4) the call's rows' index (T,) int32 instead of its LoraSlot's own, or None")
      .def(py::init<const LayerTensors&, int64_t, int64_t, int64_t, double, const std::string&>(), py::arg("weights"),
           py::arg("hidden"), py::arg("intermediate"), py::arg("heads"), py::arg("eps"), py::arg("act"))
      .def("__call__", &Layer::forward, py::arg("x"), py::arg("cu_seqlens"), py::arg("max_seqlen"), py::arg("scale"),
           py::arg("bias_table") = py::none(), py::arg("bias_positions") = py::none(),
           py::arg("carry") = static_cast<LayerCarry*>(nullptr), py::arg("lora") = py::none(),
           py::arg("lora_index") = py::none());
  py::class_<WordPiece>(m, "WordPiece",
                        "BERT's WordPiece on ASCII texts, the ids of the tokenizers library's BertNormalizer (clean_text) "
                        "-> BertPreTokenizer -> WordPiece -> [cls] text [sep] pipeline, truncated on the right "
                        "(bertfast/tokenization.py builds it only for a tokenizer of that shape)")
      .def(py::init([](const std::vector<std::pair<std::string, int32_t>>& vocab, const std::string& unk_token,
                       const std::string& prefix, int32_t cls, int32_t sep, bool lowercase, int64_t max_chars,
                       const std::vector<std::string>& added) {
             BF_CHECK(!vocab.empty(), "the vocabulary is empty");
             bool has_unk = false;
             for (const auto& entry : vocab) has_unk |= entry.first == unk_token;
             BF_CHECK(has_unk, "unk_token ", unk_token, " is not in the vocabulary");
             return WordPiece(bc::WordPieceSpec{vocab, unk_token, prefix, cls, sep, lowercase, max_chars, added});
           }),
           py::kw_only(), py::arg("vocab"), py::arg("unk_token"), py::arg("prefix"), py::arg("cls"), py::arg("sep"),
           py::arg("lowercase"), py::arg("max_chars"), py::arg("added"))
      .def("encode", &WordPiece::encode,
           "texts (list of str) -> (ids (total,) int64, each text's ids in turn; lengths (N,) int64, -1 for a text "
           "left to the library: not ASCII, or holding an added token's content)",
           py::arg("texts"), py::arg("max_length"));
  m.def("isa", &isa,
        "the ISA tier the kernels dispatch to: 'amx', 'amx_emulated', 'avx512_vnni', 'avx2' or 'portable'");
  m.def("detected_isa", &detected_isa, "the best ISA tier this CPU (and OS) supports");
  m.def("requested_cap", &bc::requested_cap,
        "the cap BERTFAST_ISA named when the extension loaded ('' when unset); ValueError for an unknown name");
  m.def("set_isa", &set_isa,
        "cap the kernels at an ISA tier (or choose amx_emulated); returns False if the CPU lacks it", py::arg("isa"));
  m.def("isa_supported", &isa_supported, "whether this CPU runs an ISA tier (amx_emulated: AVX-512 VNNI)",
        py::arg("isa"));
  m.def("has_avx512_bf16", &bc::has_avx512_bf16,
        "whether the kernels use AVX-512 BF16 dot products (the CPU has them, not hidden)");
  m.def("set_avx512_bf16", &bc::set_avx512_bf16,
        "hide (False) or restore (True) AVX-512 BF16, as BERTFAST_ISA=avx512_vnni-nobf16 does at load; returns False "
        "restoring it where the CPU lacks it, or hiding it under the amx or amx_emulated tier where the CPU has it",
        py::arg("enabled"));
  m.def("has_avx_vnni", &bc::has_avx_vnni, "whether the avx2 tier's int8 GEMM uses AVX-VNNI (the CPU has it, not hidden)");
  m.def("num_threads", &bc::num_threads, "OpenMP threads the kernels (and torch's ops) use on the calling thread");
  m.def(
      "set_num_threads",
      [](int n) {
        BF_CHECK(n >= 1, "threads must be >= 1, got ", n);
        bc::set_num_threads(n);
      },
      "OpenMP threads for the parallel regions the calling thread starts: its setting only, other threads keep "
      "theirs (torch.set_num_threads also changes the default of threads started later)",
      py::arg("threads"));
  m.def("profile_enable", &profile_enable, "the native layer's stage timers on (zeroed) or off", py::arg("on"));
  m.def("profile_counters", &profile_counters,
        "the native layer's stage totals since profile_enable(True): {stage: (seconds, calls, flops)}");
  // int8 dynamic quantization (bertfast/backends/cpu/quant.py)
  m.def("quantize_rows", &quantize_rows,
        "per-token asymmetric int8 quantization: x (M, K) fp32 -> (q int8, scale, zero_point); flip: q ^ 0x80 (the "
        "codes as the unsigned bytes VNNI multiplies)",
        py::arg("x"), py::arg("flip") = false);
  m.def("sparse_pool", &sparse_pool,
        "SPLADE pooling fused into the vocabulary GEMM: x (T, K) float32 or bfloat16, a (vocab, K) weight of x's dtype "
        "packed by pack_linear (bf16: on AMX tiles where the tier has them), bias (vocab,) float32 or None, "
        "cu_seqlens (batch+1,) int32 -> (batch, vocab) float32, per sequence the max or sum over its tokens of "
        "log1p(relu(x w^T + bias)) (activation 'log1p_relu': log1p applied twice)",
        py::arg("x"), py::arg("packed"), py::arg("vocab"), py::arg("bias"), py::arg("cu_seqlens"),
        py::arg("pooling") = "max", py::arg("activation") = "relu");
  m.def("pool_rows", &pool_rows,
        "sentence pooling on packed tokens: x (T, H) float32, cu_seqlens (batch+1,) int32 -> (batch, H) float32, per "
        "sequence its first token ('cls') or mean ('mean'); zeros for a sequence without tokens",
        py::arg("x"), py::arg("cu_seqlens"), py::arg("mode"));
  m.def("pack_int8", &pack_int8, "pack an int8 (N, K) weight for quant_linear", py::arg("weight"));
  m.def("quant_linear", &quant_linear,
        "quantize_rows, then the int8 GEMM on pack_int8 weights with the dequantization epilogue fused (AMX-int8 / "
        "VNNI / AVX2 / portable by the ISA tier): act(x @ W.T + bias + lora) + residual for fp32 x (M, K); "
        "unsigned_codes=False: signed codes whatever the kernel (a VNNI kernel then flips them in a pass of its own; "
        "the same bits)",
        py::arg("x"), py::arg("packed"), py::arg("w_scale"), py::arg("colsum"), py::arg("bias") = py::none(),
        py::arg("act") = "none", py::arg("residual") = py::none(), py::arg("unsigned_codes") = true,
        py::arg("lora") = py::none());

  // Test and measurement knobs, none of which the product calls: kept out of the ops so none creeps in.
  py::module_ t = m.def_submodule("testing", "test and measurement knobs of the native kernels (not for products)");
  t.def("amx_gemm", &amx_gemm,
        "the AMX GEMMs' kernel choice: 'auto' (by M), 'stream' or 'blocked', bit-identical (BERTFAST_AMX_GEMM at "
        "load)");
  t.def("set_amx_gemm", &set_amx_gemm, "choose the AMX GEMMs' kernel: 'auto', 'stream' or 'blocked'", py::arg("name"));
  t.def("amx_blocking", &amx_blocking,
        "the blocked AMX kernel's (tile steps per K block, rows per work item at most, A staged in tile order)");
  t.def("set_amx_blocking", &set_amx_blocking,
        "set the blocked AMX kernel's geometry, for measurement (the bits do not change)", py::arg("steps"),
        py::arg("rows"), py::arg("stage") = false);
  t.def("activation_cache_stats", &bertfast::bindings::activation_cache_stats,
        "the native ops' block cache (bindings/alloc.cpp): (bytes cached now, cap in bytes, blocks reused, blocks "
        "allocated)");
  t.def("bf16_conversions", &bf16_conversions,
        "fp32 -> bf16 bits (int16) as the amx_emulated tier converts them, and as VCVTNEPS2BF16 does (None where the "
        "CPU lacks AVX-512 BF16)", py::arg("x"));
  t.def("set_avx_vnni", &bc::set_avx_vnni, "hide (False) or restore (True) AVX-VNNI; False if the CPU lacks it",
        py::arg("enabled"));
  t.def("attention_path", &attention_path,
        "choose_attention's path (its enum's name) for a layer: dtype 'float32' or 'bfloat16', bf16_products, "
        "head_dim, has_bias, window (> 0: sliding), on `tier` with or without AVX-512 BF16",
        py::arg("dtype"), py::arg("bf16_products"), py::arg("head_dim"), py::arg("has_bias"), py::arg("window"),
        py::arg("tier"), py::arg("avx512_bf16") = true);
  t.def("gemm_path", &gemm_path,
        "choose_gemm's path (its enum's name) for an M x K call of `linear`: dtype 'float32' or 'bfloat16', on "
        "`tier` with or without AVX-512 BF16, the AMX kernels' choice amx_gemm ('auto', 'stream', 'blocked')",
        py::arg("dtype"), py::arg("m"), py::arg("k"), py::arg("tier"), py::arg("avx512_bf16") = true,
        py::arg("amx_gemm") = "auto");
  t.def("int8_path", &int8_path,
        "choose_int8's path (its enum's name) for an M x K call of `quant_linear`, on `tier` with or without AVX-VNNI, "
        "the AMX kernels' choice amx_gemm ('auto', 'stream', 'blocked')",
        py::arg("m"), py::arg("k"), py::arg("tier"), py::arg("avx_vnni") = false, py::arg("amx_gemm") = "auto");
  t.def("sparse_pool_path", &sparse_pool_path,
        "choose_sparse_pool's path (its enum's name) for a call of `sparse_pool` with hidden size K: dtype 'float32' "
        "or 'bfloat16', on `tier`", py::arg("dtype"), py::arg("k"), py::arg("tier"));
  t.def("position_scores_path", &position_scores_path,
        "choose_position_scores's path (its enum's name) for a call of `position_scores` with head dim head_dim: "
        "dtype 'float32' or 'bfloat16', on `tier` with or without AVX-512 BF16", py::arg("dtype"), py::arg("head_dim"),
        py::arg("tier"), py::arg("avx512_bf16") = true);
}
