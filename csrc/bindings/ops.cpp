// The op wrappers of `bertfast._C`: each checks its inputs (checks.h), allocates the output and calls its kernel in
// csrc/cpu/ on raw pointers with the GIL released.
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "bindings/alloc.h"
#include "bindings/checks.h"
#include "bindings/lora.h"
#include "bindings/ops.h"
#include "cpu/attention/attention_impl.h"
#include "cpu/attention/disentangled_impl.h"
#include "cpu/common/amx_tiles.h"
#include "cpu/common/isa.h"
#include "cpu/common/kernels.h"
#include "cpu/gemm/amx_gemm.h"
#include "cpu/gemm/linear_impl.h"
#include "cpu/gemm/sparse_pool_impl.h"
#include "cpu/int8/int8_linear_impl.h"
#include "cpu/layer/profile.h"

namespace bertfast {
namespace bindings {

at::Tensor embeddings(const at::Tensor& ids, const c10::optional<at::Tensor>& positions,
                 const c10::optional<at::Tensor>& types, const at::Tensor& word,
                 const c10::optional<at::Tensor>& position_table, const c10::optional<at::Tensor>& type_table,
                 const at::Tensor& gamma, const at::Tensor& beta, double eps) {
  check_float(word, "word");
  BF_CHECK(word.dim() == 2, "word must be (vocab, hidden), got ", word.sizes());
  check_contig(word, "word");
  const int64_t H = word.size(1);
  BF_CHECK(H > 0, "hidden size must be positive, got word of shape ", word.sizes());
  // The other tables, the LayerNorm and the output share one dtype: the word table's, or fp32 beside a bf16 one.
  check_float(gamma, "ln_weight");
  BF_CHECK(gamma.scalar_type() == word.scalar_type() || word.scalar_type() == at::kBFloat16,
           "a float32 word table needs float32 position, token_type and LayerNorm tensors, got ln_weight ",
           gamma.scalar_type());
  BF_CHECK(ids.dim() == 1, "input_ids must be 1-D (tokens,), got ", ids.sizes());
  const int64_t T = ids.size(0);
  check_index(ids, T, word.size(0), "input_ids");
  at::Tensor pos, pt;  // undefined without a position table (rotary models): position_ids are then ignored
  if (position_table.has_value()) {
    pt = *position_table;
    check_like(pt, gamma, "position");
    BF_CHECK(pt.dim() == 2 && pt.size(1) == H, "position must be (max_positions, ", H, "), got ", pt.sizes());
    check_contig(pt, "position");
    BF_CHECK(positions.has_value(), "position_ids are needed with a position table");
    pos = *positions;
    check_index(pos, T, pt.size(0), "position_ids");
  }
  BF_CHECK(types.has_value() == type_table.has_value(),
           "token_type_ids and the token type table must be given together");
  at::Tensor ty, tt;
  if (types.has_value()) {
    ty = *types;
    tt = *type_table;
    check_like(tt, gamma, "token_type");
    BF_CHECK(tt.dim() == 2 && tt.size(1) == H, "token_type must be (types, ", H, "), got ", tt.sizes());
    check_contig(tt, "token_type");
    check_index(ty, T, tt.size(0), "token_type_ids");
  }
  check_vector(gamma, gamma, H, "ln_weight");
  check_vector(beta, gamma, H, "ln_bias");
  at::Tensor out = empty_activation({T, H}, gamma.options());
  {
    py::gil_scoped_release nogil;
    const auto run = [&](auto word_tag, auto tag) {
      using W = decltype(word_tag);
      using T_ = decltype(tag);
      bc::embeddings<W, T_>(ids.data_ptr<int64_t>(), pos.defined() ? pos.data_ptr<int64_t>() : nullptr,
                            ty.defined() ? ty.data_ptr<int64_t>() : nullptr, ptr<W>(word), ptr<T_>(pt), ptr<T_>(tt),
                            ptr<T_>(gamma), ptr<T_>(beta), float(eps), T, H, ptr<T_>(out));
    };
    if (word.scalar_type() == gamma.scalar_type())
      dispatch(word.scalar_type(), [&](auto tag) { run(tag, tag); });
    else
      run(bc::bf16{}, float{});
  }
  return out;
}

at::Tensor layernorm(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta, double eps,
                     const c10::optional<at::Tensor>& residual) {
  check_float(x, "x");
  BF_CHECK(x.dim() == 2, "x must be (tokens, hidden), got ", x.sizes());
  check_contig(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  BF_CHECK(H > 0, "hidden size must be positive");
  check_vector(gamma, x, H, "weight");
  check_vector(beta, x, H, "bias");
  const at::Tensor r = optional_operand(residual, x, x.sizes(), Layout::Contiguous, "residual");
  at::Tensor out = empty_activation(x.sizes(), x.options());
  {
    py::gil_scoped_release nogil;
    dispatch(x.scalar_type(), [&](auto tag) {
      using T_ = decltype(tag);
      bc::layernorm<T_>(ptr<T_>(x), ptr<T_>(r), ptr<T_>(gamma), ptr<T_>(beta), float(eps), T, H, ptr<T_>(out));
    });
  }
  return out;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                     int64_t max_seqlen, double scale, bool bf16_products,
                     const c10::optional<at::Tensor>& bias_table, const c10::optional<at::Tensor>& bias_positions,
                     int64_t window, const c10::optional<at::Tensor>& c2p, const c10::optional<at::Tensor>& p2c,
                     const c10::optional<at::Tensor>& rel_index) {
  check_float(q, "q");
  BF_CHECK(q.dim() == 3, "q must be (tokens, heads, head_dim), got ", q.sizes());
  check_like(k, q, "k");
  check_like(v, q, "v");
  BF_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "q, k, v must have the same shape, got ", q.sizes(),
           ", ", k.sizes(), ", ", v.sizes());
  for (const auto* t : {&q, &k, &v})
    BF_CHECK(t->stride(2) == 1 || t->size(2) == 1,
             "q, k and v must be contiguous along head_dim (stride 1), got strides ", t->strides());
  const int64_t T = q.size(0), heads = q.size(1), d = q.size(2);
  BF_CHECK(heads > 0 && d > 0, "heads and head_dim must be positive, got ", q.sizes());
  const int64_t B = check_cu_seqlens(cu_seqlens, T, max_seqlen, "q");
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  bc::AttnBias bias{nullptr, 0, nullptr};
  if (c2p.has_value() || p2c.has_value() || rel_index.has_value()) {  // DeBERTa-v2
    BF_CHECK(!bias_table.has_value(), "bias_table and the disentangled terms (c2p, p2c) exclude each other");
    check_disentangled(c2p, p2c, rel_index, bias_positions, heads, T, cu_seqlens, &bias);
  } else {
    bias = check_attn_bias(bias_table, bias_positions, heads, T, cu_seqlens);
  }
  BF_CHECK(window >= 0, "window must be >= 0 (0: global attention), got ", window);
  const bc::AttnStrides st{q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
  at::Tensor out = empty_activation({T, heads * d}, q.options());
  {
    py::gil_scoped_release nogil;
    dispatch(q.scalar_type(), [&](auto tag) {
      using T_ = decltype(tag);
      bc::attention<T_>(ptr<T_>(q), ptr<T_>(k), ptr<T_>(v), st, cu, B, heads, d, float(scale), ptr<T_>(out),
                        bf16_products, bias.table || bias.index ? &bias : nullptr, window);
    });
  }
  return out;
}

// DeBERTa-v2's per-token position terms: scale * x[t, h] . pos[r, h] -> (T, heads, rows) float32.
at::Tensor position_scores(const at::Tensor& x, const at::Tensor& pos, double scale,
                           const c10::optional<at::Tensor>& windows) {
  check_float(x, "x");
  BF_CHECK(x.dim() == 3 && x.size(1) > 0 && x.size(2) > 0, "x must be (tokens, heads, head_dim), got ", x.sizes());
  BF_CHECK(x.stride(2) == 1 || x.size(2) == 1, "x must be contiguous along head_dim, got strides ", x.strides());
  const int64_t T = x.size(0), heads = x.size(1), d = x.size(2);
  check_like(pos, x, "pos");
  BF_CHECK(pos.dim() == 2 && pos.size(0) > 0 && pos.size(1) == heads * d, "pos must be (rows > 0, heads * head_dim = ",
           heads * d, "), got ", pos.sizes());
  check_contig(pos, "pos");
  const int32_t* win = nullptr;
  if (windows.has_value()) {
    check_tensor(*windows, "windows");
    BF_CHECK(windows->scalar_type() == at::kInt && windows->dim() == 2 && windows->size(0) == T &&
                 windows->size(1) == 2,
             "windows must be (tokens = ", T, ", 2) int32, got ", windows->scalar_type(), " ", windows->sizes());
    check_contig(*windows, "windows");
    win = windows->data_ptr<int32_t>();
    for (int64_t t = 0; t < T; ++t)
      BF_CHECK(0 <= win[2 * t] && win[2 * t] <= win[2 * t + 1] && win[2 * t + 1] <= pos.size(0), "windows[", t,
               "] must be columns lo <= hi in [0, rows = ", pos.size(0), "], got [", win[2 * t], ", ",
               win[2 * t + 1], ")");
  }
  at::Tensor out = empty_activation({T, heads, pos.size(0)}, x.options().dtype(at::kFloat));
  if (T == 0) return out;
  {
    py::gil_scoped_release nogil;
    dispatch(x.scalar_type(), [&](auto tag) {
      using T_ = decltype(tag);
      bc::position_scores<T_>(ptr<T_>(x), x.stride(0), x.stride(1), T, heads, d, ptr<T_>(pos), pos.size(0),
                              float(scale), out.data_ptr<float>(), win);
    });
  }
  return out;
}

// RoPE on x (T, heads, d) in place, rows and heads any stride apart (e.g. the q and k heads of the fused (T, 3H)
// QKV output viewed as (T, 2 * heads, d)); cos, sin (T, d / 2) float32 contiguous. Returns x.
at::Tensor rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  check_float(x, "x");
  BF_CHECK(x.dim() == 3, "x must be (tokens, heads, head_dim), got ", x.sizes());
  BF_CHECK(x.stride(2) == 1 || x.size(2) <= 1, "x must be contiguous along head_dim (stride 1), got strides ",
           x.strides());
  BF_CHECK(at::has_internal_overlap(x) != at::MemOverlap::Yes, "x must not overlap itself (it is rotated in place), "
           "got shape ", x.sizes(), " and strides ", x.strides());
  const int64_t T = x.size(0), heads = x.size(1), d = x.size(2);
  BF_CHECK(d % 2 == 0, "rotary embeddings need an even head_dim, got ", d);
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
    check_tensor(*t, name);
    BF_CHECK(t->scalar_type() == at::kFloat, name, " must be float32, got ", t->scalar_type());
    BF_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == d / 2, name, " must have shape (", T, ", ", d / 2,
             "), got ", t->sizes());
    check_contig(*t, name);
  }
  if (x.numel() > 0) {
    py::gil_scoped_release nogil;
    dispatch(x.scalar_type(), [&](auto tag) {
      using T_ = decltype(tag);
      bc::rotary<T_>(ptr<T_>(x), x.stride(0), x.stride(1), T, heads, d, cos.data_ptr<float>(), sin.data_ptr<float>());
    });
  }
  return x;
}

// The gate of a GLU FFN: h (M, 2N), contiguous along features -> act(h[:, :N]) * h[:, N:], (M, N).
at::Tensor glu(const at::Tensor& h, const std::string& act) {
  check_float(h, "h");
  BF_CHECK(h.dim() == 2 && h.size(1) % 2 == 0, "h must be (rows, 2 * features), got ", h.sizes());
  BF_CHECK(h.stride(1) == 1 || h.size(1) <= 1, "h must be contiguous along features, got strides ", h.strides());
  const int64_t M = h.size(0), N = h.size(1) / 2;
  const bc::Activation a = activation(act);
  at::Tensor out = empty_activation({M, N}, h.options());
  if (M > 0 && N > 0) {
    py::gil_scoped_release nogil;
    dispatch(h.scalar_type(), [&](auto tag) {
      using T_ = decltype(tag);
      bc::glu<T_>(ptr<T_>(h), M > 1 ? h.stride(0) : 2 * N, M, N, a, ptr<T_>(out));
    });
  }
  return out;
}

at::Tensor pack_linear(const at::Tensor& weight) {
  check_float(weight, "weight");
  BF_CHECK(weight.dim() == 2, "weight must be (out_features, in_features), got ", weight.sizes());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const bool is_bf16 = w.scalar_type() == at::kBFloat16;
  at::Tensor packed = empty_streamed(bc::packed_numel(N, K, is_bf16), w.options());
  dispatch(w.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    bc::pack_linear<T_>(ptr<T_>(w), N, K, ptr<T_>(packed));
  });
  return packed;
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias, const std::string& act,
                  const c10::optional<at::Tensor>& residual, const LoraOperands* lora, bool float_out) {
  check_float(x_in, "x");
  check_float(packed, "packed weight");
  BF_CHECK(x_in.dim() == 2, "x must be (rows, in_features), got ", x_in.sizes());
  BF_CHECK(x_in.stride(1) == 1 || x_in.size(1) <= 1, "x must be contiguous along in_features, got strides ",
           x_in.strides());
  const int64_t M = x_in.size(0), K = x_in.size(1), N = out_features;
  BF_CHECK(N > 0 && K > 0, "in_features and out_features must be positive, got ", K, " and ", N);
  // bf16 weights take fp32 x (the residual stream of a bf16 forward), rounded to bf16 once here (to_bf16), and
  // an fp32 residual, which makes the output fp32 (linear_packed_wide), as float_out does without one.
  const bool widen_x = packed.scalar_type() == at::kBFloat16 && x_in.scalar_type() == at::kFloat;
  BF_CHECK(!float_out || packed.scalar_type() == at::kBFloat16, "float_out is for a bf16 weight, got ",
           packed.scalar_type());
  at::Tensor x = x_in;
  if (widen_x) {
    x = empty_activation({M, K}, packed.options());
    const int64_t ld = M > 1 ? x_in.stride(0) : K;
    py::gil_scoped_release nogil;
    bc::to_bf16(ptr<float>(x_in), ld, M, K, ptr<bc::bf16>(x));
  }
  check_packed(packed, x, N, K, "packed weight");
  const bc::Activation a = activation(act);
  const at::Tensor b = optional_operand(bias, x, {N}, Layout::Contiguous, "bias");
  const bool wide = x.scalar_type() == at::kBFloat16 &&
                    (float_out || (residual.has_value() && residual->scalar_type() == at::kFloat));
  BF_CHECK(!float_out || !residual.has_value() || residual->scalar_type() == at::kFloat,
           "float_out takes a float32 residual, got ", residual.has_value() ? residual->scalar_type() : at::kFloat);
  const at::Tensor r = optional_operand(residual, wide && residual.has_value() ? *residual : x,
                                        {M, N}, Layout::Rows, "residual");
  cpu::LoraTerm term;
  if (lora != nullptr) term = lora->term(M, N);
  const cpu::LoraTerm* lt = lora != nullptr ? &term : nullptr;
  at::Tensor out = empty_activation({M, N}, wide ? x.options().dtype(at::kFloat) : x.options());
  const int64_t ldx = M > 1 ? x.stride(0) : K;
  const int64_t ldr = r.defined() ? r.stride(0) : 0;
  {
    py::gil_scoped_release nogil;
    if (wide) {
      bc::linear_packed_wide(ptr<bc::bf16>(x), ldx, ptr<bc::bf16>(packed), ptr<bc::bf16>(b), ptr<float>(r), ldr, M,
                             N, K, a, ptr<float>(out), N, lt);
    } else {
      dispatch(x.scalar_type(), [&](auto tag) {
        using T_ = decltype(tag);
        bc::linear_packed<T_>(ptr<T_>(x), ldx, ptr<T_>(packed), ptr<T_>(b), ptr<T_>(r), ldr, M, N, K, a,
                               ptr<T_>(out), N, lt);
      });
    }
  }
  return out;
}

at::Tensor sparse_pool(const at::Tensor& x, const at::Tensor& packed, int64_t vocab,
                       const c10::optional<at::Tensor>& bias, const at::Tensor& cu_seqlens, const std::string& pooling,
                       const std::string& activation) {
  check_tensor(x, "x");
  BF_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16, got ",
           x.scalar_type());
  BF_CHECK(x.dim() == 2, "x must be (tokens, hidden), got ", x.sizes());
  BF_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "x must be contiguous along hidden, got strides ", x.strides());
  const int64_t T = x.size(0), K = x.size(1), V = vocab;
  BF_CHECK(V > 0 && K > 0, "vocab and hidden must be positive, got ", V, " and ", K);
  check_packed(packed, x, V, K, "packed weight");
  const int64_t B = check_cu_seqlens(cu_seqlens, T, T, "x");
  BF_CHECK(pooling == "max" || pooling == "sum", "pooling must be 'max' or 'sum', got '", pooling, "'");
  BF_CHECK(activation == "relu" || activation == "log1p_relu", "activation must be 'relu' or 'log1p_relu', got '",
           activation, "'");
  at::Tensor out = empty_activation({B, V}, x.options().dtype(at::kFloat));
  const at::Tensor b = optional_operand(bias, out, {V}, Layout::Contiguous, "bias");  // fp32, as out, for both
  {
    py::gil_scoped_release nogil;
    const bc::SparsePooling mode = pooling == "max" ? bc::SparsePooling::Max : bc::SparsePooling::Sum;
    dispatch(x.scalar_type(), [&](auto tag) {
      using T_ = decltype(tag);
      bc::sparse_pool(ptr<T_>(x), T > 1 ? x.stride(0) : K, cu_seqlens.data_ptr<int32_t>(), B, ptr<T_>(packed),
                      ptr<float>(b), V, K, mode, activation == "log1p_relu", ptr<float>(out));
    });
  }
  return out;
}

at::Tensor pool_rows(const at::Tensor& x, const at::Tensor& cu_seqlens, const std::string& mode) {
  check_tensor(x, "x");
  BF_CHECK(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  BF_CHECK(x.dim() == 2, "x must be (tokens, hidden), got ", x.sizes());
  BF_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "x must be contiguous along hidden, got strides ", x.strides());
  const int64_t T = x.size(0), H = x.size(1);
  const int64_t B = check_cu_seqlens(cu_seqlens, T, T, "x");
  BF_CHECK(mode == "cls" || mode == "mean", "mode must be 'cls' or 'mean', got '", mode, "'");
  const bc::RowPooling m = mode == "cls" ? bc::RowPooling::kCls : bc::RowPooling::kMean;
  at::Tensor out = at::empty({B, H}, x.options());
  {
    py::gil_scoped_release nogil;
    bc::pool_rows(ptr<float>(x), T > 1 ? x.stride(0) : H, H, cu_seqlens.data_ptr<int32_t>(), B, m, ptr<float>(out));
  }
  return out;
}

void profile_enable(bool on) {
  if (on) bc::profile::reset();
  bc::profile::g_enabled.store(on, std::memory_order_relaxed);
}

py::dict profile_counters() {
  namespace pf = bc::profile;
  py::dict out;  // stage name -> (seconds, calls, flops); layernorm's two calls a layer share one name
  for (int s = 0; s < pf::kStageCount; ++s) {
    const int64_t calls = pf::g_counters.calls[s].load(std::memory_order_relaxed);
    if (!calls) continue;
    out[pf::kStageNames[s]] = py::make_tuple(double(pf::g_counters.ns[s].load(std::memory_order_relaxed)) * 1e-9,
                                             calls, pf::g_counters.flops[s].load(std::memory_order_relaxed));
  }
  return out;
}

std::string isa() { return bc::isa_name(bc::active_isa()); }
std::string detected_isa() { return bc::isa_name(bc::detected_isa()); }

namespace {

bc::Isa tier_named(const std::string& name) {
  bc::Isa tier;
  BF_CHECK(bc::parse_isa(name.c_str(), &tier), "unknown ISA tier '", name,
           "' (expected one of amx, amx_emulated, avx512_vnni, avx2, portable)");
  return tier;
}

bc::AmxGemm amx_gemm_named(const std::string& name) {
  bc::AmxGemm mode;
  BF_CHECK(bc::parse_amx_gemm(name.c_str(), &mode), "unknown AMX GEMM kernel '", name,
           "' (expected auto, stream or blocked)");
  return mode;
}

bool is_bf16_named(const std::string& dtype) {
  BF_CHECK(dtype == "float32" || dtype == "bfloat16", "dtype must be 'float32' or 'bfloat16', got '", dtype, "'");
  return dtype == "bfloat16";
}

}  // namespace

bool set_isa(const std::string& name) { return bc::set_isa(tier_named(name)); }

bool isa_supported(const std::string& name) { return bc::isa_supported(tier_named(name)); }

std::string amx_gemm() { return bc::amx_gemm_name(bc::amx_gemm()); }

void set_amx_gemm(const std::string& name) { bc::set_amx_gemm(amx_gemm_named(name)); }

std::string attention_path(const std::string& dtype, bool bf16_products, int64_t head_dim, bool has_bias,
                           int64_t window, const std::string& tier, bool avx512_bf16) {
  return bc::attention_path_name(bc::choose_attention(
      {is_bf16_named(dtype), bf16_products, head_dim, has_bias, window, tier_named(tier), avx512_bf16}));
}

std::string gemm_path(const std::string& dtype, int64_t m, int64_t k, const std::string& tier, bool avx512_bf16,
                      const std::string& amx_gemm) {
  return bc::gemm_path_name(
      bc::choose_gemm({is_bf16_named(dtype), m, k, tier_named(tier), avx512_bf16, amx_gemm_named(amx_gemm)}));
}

std::string int8_path(int64_t m, int64_t k, const std::string& tier, bool avx_vnni, const std::string& amx_gemm) {
  return bc::int8_path_name(bc::choose_int8({m, k, tier_named(tier), avx_vnni, amx_gemm_named(amx_gemm)}));
}

std::string sparse_pool_path(const std::string& dtype, int64_t k, const std::string& tier) {
  return bc::sparse_pool_path_name(bc::choose_sparse_pool({is_bf16_named(dtype), k, tier_named(tier)}));
}

std::string position_scores_path(const std::string& dtype, int64_t head_dim, const std::string& tier,
                                 bool avx512_bf16) {
  return bc::position_scores_path_name(
      bc::choose_position_scores({is_bf16_named(dtype), head_dim, tier_named(tier), avx512_bf16}));
}

std::tuple<int64_t, int64_t, bool> amx_blocking() {
  const bc::AmxBlocking b = bc::amx_blocking();
  return {b.steps, b.rows, b.stage};
}

void set_amx_blocking(int64_t steps, int64_t rows, bool stage) {
  BF_CHECK(bc::set_amx_blocking(steps, rows, stage), "AMX blocking: steps must be in [1, 64] and rows a multiple of ",
           bc::kAmxPairRows, " in [", bc::kAmxPairRows, ", ", bc::kAmxMaxItemRows, "], got ", steps, ", ", rows);
}

std::tuple<at::Tensor, c10::optional<at::Tensor>> bf16_conversions(const at::Tensor& x) {
  BF_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
           "bf16_conversions takes a contiguous 1-D float32 tensor");
#if BF_X86
  const int64_t n = x.numel();
  at::Tensor emulated = at::empty({n}, x.options().dtype(at::kShort)), instruction = at::empty_like(emulated);
  auto bits = [](at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<int16_t>()); };
  bc::amx_emulation::cvtneps_bf16_emulated(x.data_ptr<float>(), n, bits(emulated));
  if (!bc::amx_emulation::cvtneps_bf16_instruction(x.data_ptr<float>(), n, bits(instruction))) return {emulated, {}};
  return {emulated, instruction};
#else
  BF_CHECK(false, "bf16_conversions: the amx_emulated tier's conversion exists on x86-64 only");
  return {};
#endif
}

// ---- int8 dynamic quantization (quantize_rows.cpp, int8_linear*.cpp; bertfast/backends/cpu/quant.py) ----

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, bool flip) {
  check_rows_f32(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = empty_activation({M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = empty_activation({M}, x.options());
  at::Tensor zp = empty_activation({M}, x.options().dtype(at::kInt));
  if (M > 0) {
    py::gil_scoped_release nogil;
    bc::quantize_rows(x.data_ptr<float>(), M > 1 ? x.stride(0) : K, M, K, q.data_ptr<int8_t>(),
                      scale.data_ptr<float>(), zp.data_ptr<int32_t>(), flip);
  }
  return {q, scale, zp};
}

at::Tensor pack_int8(const at::Tensor& weight) {
  check_tensor(weight, "weight");
  BF_CHECK(weight.scalar_type() == at::kChar, "weight must be int8, got ", weight.scalar_type());
  BF_CHECK(weight.dim() == 2, "weight must be (out_features, in_features), got ", weight.sizes());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor packed = at::empty({bc::int8_packed_numel(N, K)}, w.options());
  bc::pack_int8(w.data_ptr<int8_t>(), N, K, packed.data_ptr<int8_t>());
  return packed;
}

// The whole int8 linear from fp32 x: quantize_rows, then the int8 GEMM with its epilogue fused,
// act(x @ W.T + bias) + residual.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                        const at::Tensor& colsum, const c10::optional<at::Tensor>& bias, const std::string& act,
                        const c10::optional<at::Tensor>& residual, bool unsigned_codes,
                        const LoraOperands* lora) {
  check_rows_f32(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  check_float(w_scale, "w_scale");
  BF_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.dim() == 1, "w_scale must be (N,) float32, got ",
           w_scale.scalar_type(), " ", w_scale.sizes());
  const int64_t N = w_scale.size(0);
  check_contig(w_scale, "w_scale");
  check_vector(colsum, w_scale, N, "colsum");
  check_packed_int8(packed, N, K, "packed weight");
  const bc::Activation a = activation(act);
  const at::Tensor b = optional_operand(bias, w_scale, {N}, Layout::Contiguous, "bias");
  const at::Tensor r = optional_operand(residual, w_scale, {M, N}, Layout::Rows, "residual");
  cpu::LoraTerm term;
  if (lora != nullptr) term = lora->term(M, N);
  at::Tensor q = empty_activation({M, K}, x.options().dtype(at::kChar));
  at::Tensor x_scale = empty_activation({M}, x.options());
  at::Tensor x_zp = empty_activation({M}, x.options().dtype(at::kInt));
  at::Tensor out = empty_activation({M, N}, w_scale.options());
  if (M > 0) {
    py::gil_scoped_release nogil;
    // The codes in the form the GEMM's kernel multiplies, unless told otherwise (then it flips them itself).
    const bool flip = unsigned_codes && bc::int8_unsigned_codes(M, K);
    bc::quantize_rows(x.data_ptr<float>(), M > 1 ? x.stride(0) : K, M, K, q.data_ptr<int8_t>(),
                      x_scale.data_ptr<float>(), x_zp.data_ptr<int32_t>(), flip);
    bc::int8_linear(q.data_ptr<int8_t>(), K, M, K, x_scale.data_ptr<float>(), x_zp.data_ptr<int32_t>(),
                    packed.data_ptr<int8_t>(), N, w_scale.data_ptr<float>(), colsum.data_ptr<float>(), ptr<float>(b),
                    a, ptr<float>(r), r.defined() ? r.stride(0) : 0, out.data_ptr<float>(), flip,
                    lora != nullptr ? &term : nullptr);
  }
  return out;
}

}  // namespace bindings
}  // namespace bertfast
