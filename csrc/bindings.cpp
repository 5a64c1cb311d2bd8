// The one Python module of the native CPU backend, `bertfast._C`: validates every input at the boundary
// (device, dtype, shape, strides, index ranges) and raises ValueError with a message before any kernel
// runs, then calls the kernels in csrc/cpu/ on raw pointers with the GIL released.
//
// Ops and their kernels (csrc/cpu/): embed (embed.cpp), layernorm (layernorm.cpp), attention (attention.cpp),
// rotary_ (rotary.cpp), glu (glu.cpp),
// pack_linear and linear (linear_pack.cpp, linear*.cpp), Layer (layer.cpp), quantize_rows (quantize_rows.cpp),
// pack_int8 and quant_linear (int8_linear*.cpp, after quantize_rows),
// isa / detected_isa / set_isa / has_avx512_bf16 / set_avx512_bf16 / has_avx_vnni / set_avx_vnni (isa.cpp), num_threads (parallel.h).
#include <ATen/MemoryOverlap.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu/activation.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "cpu/parallel.h"

namespace bc = bertfast::cpu;

namespace {

#define BF_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

void check_tensor(const at::Tensor& t, const char* name) {
  BF_CHECK(t.defined(), name, " is undefined");
  BF_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  BF_CHECK(t.layout() == at::kStrided, name, " must be a dense (strided) tensor");
}

void check_float(const at::Tensor& t, const char* name) {
  check_tensor(t, name);
  BF_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
           " must be float32 or bfloat16, got ", t.scalar_type());
}

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  check_tensor(t, name);
  BF_CHECK(t.scalar_type() == ref.scalar_type(), name, " has dtype ", t.scalar_type(), " but the input has ",
           ref.scalar_type());
}

void check_contig(const at::Tensor& t, const char* name) {
  BF_CHECK(t.is_contiguous(), name, " must be contiguous (got strides ", t.strides(), ")");
}

// How an operand's elements must lie: all contiguous, or contiguous along the last dim (rows any stride apart).
enum class Layout { Contiguous, Rows };

// An operand of `ref`'s dtype and of shape `shape`, laid out as `layout` says.
void check_operand(const at::Tensor& t, const at::Tensor& ref, at::IntArrayRef shape, Layout layout,
                   const char* name) {
  check_like(t, ref, name);
  BF_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
  if (layout == Layout::Contiguous)
    check_contig(t, name);
  else
    BF_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, name, " must be contiguous along features, got strides ",
             t.strides());
}

void check_vector(const at::Tensor& t, const at::Tensor& ref, int64_t n, const char* name) {
  check_operand(t, ref, {n}, Layout::Contiguous, name);
}

// An optional operand (a bias, a residual): undefined when absent, else checked as check_operand does.
at::Tensor optional_operand(const c10::optional<at::Tensor>& t, const at::Tensor& ref, at::IntArrayRef shape,
                            Layout layout, const char* name) {
  if (!t.has_value()) return at::Tensor();
  check_operand(*t, ref, shape, layout, name);
  return *t;
}

// A weight packed by pack_linear for an (n, k) linear, in `ref`'s dtype.
void check_packed(const at::Tensor& w, const at::Tensor& ref, int64_t n, int64_t k, const char* name) {
  check_like(w, ref, name);
  const int64_t want = bc::packed_numel(n, k, ref.scalar_type() == at::kBFloat16);
  BF_CHECK(w.dim() == 1 && w.numel() == want, name, " does not match (", n, ", ", k, "): expected ", want,
           " elements from pack_linear, got ", w.sizes());
  check_contig(w, name);
}

// A weight packed by pack_int8 for an (n, k) linear.
void check_packed_int8(const at::Tensor& w, int64_t n, int64_t k, const char* name) {
  check_tensor(w, name);
  const int64_t want = bc::int8_packed_numel(n, k);
  BF_CHECK(w.scalar_type() == at::kChar && w.dim() == 1 && w.numel() == want, name, " does not match (", n, ", ", k,
           "): expected ", want, " int8 elements from pack_int8, got ", w.scalar_type(), " ", w.sizes());
  check_contig(w, name);
}

// Rows of `ids` must index into a table of `rows` rows.
void check_index(const at::Tensor& ids, int64_t n, int64_t rows, const char* name) {
  check_tensor(ids, name);
  BF_CHECK(ids.scalar_type() == at::kLong, name, " must be int64, got ", ids.scalar_type());
  BF_CHECK(ids.dim() == 1 && ids.size(0) == n, name, " must have shape (", n, "), got ", ids.sizes());
  check_contig(ids, name);
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    BF_CHECK(p[i] >= 0 && p[i] < rows, name, "[", i, "] = ", p[i], " is out of range [0, ", rows, ")");
}

// cu_seqlens (batch + 1,) int32: 0, then non-decreasing up to the `tokens` of `input`, no sequence longer
// than max_seqlen. Returns the batch size.
int64_t check_cu_seqlens(const at::Tensor& cu_seqlens, int64_t tokens, int64_t max_seqlen, const char* input) {
  check_tensor(cu_seqlens, "cu_seqlens");
  BF_CHECK(cu_seqlens.scalar_type() == at::kInt, "cu_seqlens must be int32, got ", cu_seqlens.scalar_type());
  BF_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1, "cu_seqlens must be (batch+1,), got ",
           cu_seqlens.sizes());
  check_contig(cu_seqlens, "cu_seqlens");
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  const int64_t B = cu_seqlens.size(0) - 1;
  BF_CHECK(cu[0] == 0, "cu_seqlens[0] must be 0, got ", cu[0]);
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    BF_CHECK(cu[b + 1] >= cu[b], "cu_seqlens must be non-decreasing, but cu_seqlens[", b + 1, "] = ", cu[b + 1],
             " < ", cu[b]);
    longest = std::max<int64_t>(longest, cu[b + 1] - cu[b]);
  }
  BF_CHECK(cu[B] == tokens, "cu_seqlens[-1] = ", cu[B], " but ", input, " has ", tokens, " tokens");
  BF_CHECK(max_seqlen >= longest, "max_seqlen = ", max_seqlen, " is less than the longest sequence (", longest,
           ")");
  return B;
}

// The optional relative position bias of attention (`bc::AttnBias`; table and positions go together): table
// (heads, width) float32 contiguous with width odd, positions (T,) int32 contiguous, and every distance between
// two tokens of one sequence inside the table. table == nullptr in the result when absent.
bc::AttnBias check_attn_bias(const c10::optional<at::Tensor>& table, const c10::optional<at::Tensor>& positions,
                             int64_t heads, int64_t tokens, const at::Tensor& cu_seqlens) {
  BF_CHECK(table.has_value() == positions.has_value(), "bias_table and bias_positions go together");
  if (!table.has_value()) return {nullptr, 0, nullptr};
  check_tensor(*table, "bias_table");
  BF_CHECK(table->scalar_type() == at::kFloat, "bias_table must be float32, got ", table->scalar_type());
  BF_CHECK(table->dim() == 2 && table->size(0) == heads && table->size(1) % 2 == 1,
           "bias_table must be (heads = ", heads, ", width) with width odd, got ", table->sizes());
  check_contig(*table, "bias_table");
  check_tensor(*positions, "bias_positions");
  BF_CHECK(positions->scalar_type() == at::kInt, "bias_positions must be int32, got ", positions->scalar_type());
  BF_CHECK(positions->dim() == 1 && positions->size(0) == tokens, "bias_positions must be (", tokens, ",), got ",
           positions->sizes());
  check_contig(*positions, "bias_positions");
  const int32_t* pos = positions->data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  const int64_t reach = (table->size(1) - 1) / 2;
  for (int64_t b = 0; b + 1 < cu_seqlens.size(0); ++b) {
    if (cu[b + 1] == cu[b]) continue;
    const auto [lo, hi] = std::minmax_element(pos + cu[b], pos + cu[b + 1]);
    BF_CHECK(int64_t(*hi) - *lo <= reach, "bias_positions of sequence ", b, " span ", int64_t(*hi) - *lo,
             " but bias_table (width ", table->size(1), ") covers distances up to ", reach);
  }
  return {table->data_ptr<float>(), table->size(1), pos};
}

bc::Activation activation(const std::string& name) {
  bc::Activation act = bc::Activation::None;
  BF_CHECK(bc::parse_activation(name.c_str(), &act), "unknown activation '", name, "' (expected ",
           bc::kActivationChoices, ")");
  return act;
}

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

at::Tensor embed(const at::Tensor& ids, const c10::optional<at::Tensor>& positions,
                 const c10::optional<at::Tensor>& types, const at::Tensor& word,
                 const c10::optional<at::Tensor>& position_table, const c10::optional<at::Tensor>& type_table,
                 const at::Tensor& gamma, const at::Tensor& beta, double eps) {
  check_float(word, "word");
  BF_CHECK(word.dim() == 2, "word must be (vocab, hidden), got ", word.sizes());
  check_contig(word, "word");
  const int64_t H = word.size(1);
  BF_CHECK(H > 0, "hidden size must be positive, got word of shape ", word.sizes());
  BF_CHECK(ids.dim() == 1, "input_ids must be 1-D (tokens,), got ", ids.sizes());
  const int64_t T = ids.size(0);
  check_index(ids, T, word.size(0), "input_ids");
  at::Tensor pos, pt;  // undefined without a position table (rotary models): position_ids are then ignored
  if (position_table.has_value()) {
    pt = *position_table;
    check_like(pt, word, "position");
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
    check_like(tt, word, "token_type");
    BF_CHECK(tt.dim() == 2 && tt.size(1) == H, "token_type must be (types, ", H, "), got ", tt.sizes());
    check_contig(tt, "token_type");
    check_index(ty, T, tt.size(0), "token_type_ids");
  }
  check_vector(gamma, word, H, "ln_weight");
  check_vector(beta, word, H, "ln_bias");
  at::Tensor out = at::empty({T, H}, word.options());
  {
    py::gil_scoped_release nogil;
    dispatch(word.scalar_type(), [&](auto tag) {
      using T_ = decltype(tag);
      bc::embed<T_>(ids.data_ptr<int64_t>(), pos.defined() ? pos.data_ptr<int64_t>() : nullptr,
                    ty.defined() ? ty.data_ptr<int64_t>() : nullptr, ptr<T_>(word), ptr<T_>(pt), ptr<T_>(tt),
                    ptr<T_>(gamma), ptr<T_>(beta), float(eps), T, H, ptr<T_>(out));
    });
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
  at::Tensor out = at::empty_like(x);
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
                     int64_t window) {
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
  const bc::AttnBias bias = check_attn_bias(bias_table, bias_positions, heads, T, cu_seqlens);
  BF_CHECK(window >= 0, "window must be >= 0 (0: global attention), got ", window);
  const bc::AttnStrides st{q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
  at::Tensor out = at::empty({T, heads * d}, q.options());
  {
    py::gil_scoped_release nogil;
    dispatch(q.scalar_type(), [&](auto tag) {
      using T_ = decltype(tag);
      bc::attention<T_>(ptr<T_>(q), ptr<T_>(k), ptr<T_>(v), st, cu, B, heads, d, float(scale), ptr<T_>(out),
                        bf16_products, bias.table ? &bias : nullptr, window);
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
  at::Tensor out = at::empty({M, N}, h.options());
  if (M > 0 && N > 0) {
    py::gil_scoped_release nogil;
    dispatch(h.scalar_type(), [&](auto tag) {
      using T_ = decltype(tag);
      bc::glu<T_>(ptr<T_>(h), M > 1 ? h.stride(0) : 2 * N, M, N, a, ptr<T_>(out));
    });
  }
  return out;
}

// Packed weights are streamed once per forward: on 4 KB pages that is a TLB miss every 4 KB of a
// 100+ MB stream. Large packed weights get their own 2 MB aligned block, marked for transparent huge
// pages (Linux, THP "madvise" or "always"); elsewhere, or if that fails, torch's allocator.
at::Tensor empty_streamed(int64_t numel, const at::TensorOptions& options) {
#if defined(__linux__)
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t bytes = size_t(numel) * options.dtype().itemsize();
  if (bytes >= kHuge) {
    const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
    void* p = nullptr;
    if (posix_memalign(&p, kHuge, rounded) == 0) {
      madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure leaves ordinary pages
      return torch::from_blob(p, {numel}, [](void* q) { std::free(q); }, options);
    }
  }
#endif
  return at::empty({numel}, options);
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

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias, const std::string& act,
                  const c10::optional<at::Tensor>& residual) {
  check_float(x, "x");
  BF_CHECK(x.dim() == 2, "x must be (rows, in_features), got ", x.sizes());
  BF_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "x must be contiguous along in_features, got strides ",
           x.strides());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  BF_CHECK(N > 0 && K > 0, "in_features and out_features must be positive, got ", K, " and ", N);
  check_packed(packed, x, N, K, "packed weight");
  const bc::Activation a = activation(act);
  const at::Tensor b = optional_operand(bias, x, {N}, Layout::Contiguous, "bias");
  const at::Tensor r = optional_operand(residual, x, {M, N}, Layout::Rows, "residual");
  at::Tensor out = at::empty({M, N}, x.options());
  const int64_t ldx = M > 1 ? x.stride(0) : K;
  {
    py::gil_scoped_release nogil;
    dispatch(x.scalar_type(), [&](auto tag) {
      using T_ = decltype(tag);
      bc::linear_packed<T_>(ptr<T_>(x), ldx, ptr<T_>(packed), ptr<T_>(b), ptr<T_>(r), r.defined() ? r.stride(0) : 0,
                             M, N, K, a, ptr<T_>(out), N);
    });
  }
  return out;
}

// The tensors of one encoder layer (Python: `_C.LayerWeights(qkv=..., ...)`, keyword arguments): the four
// GEMM weights packed by pack_linear (the dtype of the rest), or by pack_int8 with their per-channel scales
// and column sums (int8_scales, int8_colsums: one per GEMM, in the order qkv, attn_out, ffn_in, ffn_out; an
// fp32 layer), their biases and the two LayerNorms.
struct LayerTensors {
  at::Tensor qkv, qkv_bias, attn_out, attn_out_bias, attn_ln_weight, attn_ln_bias;
  at::Tensor ffn_in, ffn_in_bias, ffn_out, ffn_out_bias, ffn_ln_weight, ffn_ln_bias;
  c10::optional<std::vector<at::Tensor>> int8_scales, int8_colsums;
};

// One encoder layer on packed weights, run whole in C++ (csrc/cpu/layer.cpp): the weights are checked
// once here, each call checks only its input.
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
    check_vector(w.attn_ln_weight, ref, hidden, "attention LayerNorm weight");
    check_vector(w.attn_ln_bias, ref, hidden, "attention LayerNorm bias");
    check_vector(w.ffn_in_bias, ref, intermediate, "ffn input bias");
    check_vector(w.ffn_out_bias, ref, hidden, "ffn output bias");
    check_vector(w.ffn_ln_weight, ref, hidden, "ffn LayerNorm weight");
    check_vector(w.ffn_ln_bias, ref, hidden, "ffn LayerNorm bias");
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& cu_seqlens, int64_t max_seqlen, double scale,
                     const c10::optional<at::Tensor>& bias_table,
                     const c10::optional<at::Tensor>& bias_positions) const {
    const int64_t H = config_.hidden, I = config_.intermediate;
    check_like(x, w_.qkv_bias, "x");
    BF_CHECK(x.dim() == 2 && x.size(1) == H, "x must be (tokens, ", H, "), got ", x.sizes());
    check_contig(x, "x");
    const int64_t T = x.size(0);
    const int64_t B = check_cu_seqlens(cu_seqlens, T, max_seqlen, "x");
    const bc::AttnBias bias = check_attn_bias(bias_table, bias_positions, config_.heads, T, cu_seqlens);
    at::Tensor out = at::empty({T, H}, x.options());
    at::Tensor work = at::empty({bc::layer_work_numel(T, H, I)}, x.options());
    at::Tensor q, q_scale, q_zp;
    if (config_.int8) {
      q = at::empty({T * std::max(H, I)}, x.options().dtype(at::kChar));
      q_scale = at::empty({T}, x.options().dtype(at::kFloat));
      q_zp = at::empty({T}, x.options().dtype(at::kInt));
    }
    const bc::Int8Scratch q8{ptr<int8_t>(q), ptr<float>(q_scale), ptr<int32_t>(q_zp)};
    {
      py::gil_scoped_release nogil;
      dispatch(x.scalar_type(), [&](auto tag) {
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
                                     ptr<T_>(w_.attn_ln_weight),
                                     ptr<T_>(w_.attn_ln_bias),
                                     ptr<T_>(w_.ffn_ln_weight),
                                     ptr<T_>(w_.ffn_ln_bias)};
        bc::encoder_layer<T_>(ptr<T_>(x), T, cu_seqlens.data_ptr<int32_t>(), B, float(scale), w, config_,
                              ptr<T_>(work), q8, ptr<T_>(out), bias.table ? &bias : nullptr);
      });
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

std::string isa() { return bc::isa_name(bc::active_isa()); }
std::string detected_isa() { return bc::isa_name(bc::detected_isa()); }

bool set_isa(const std::string& name) {
  bc::Isa tier;
  BF_CHECK(bc::parse_isa(name.c_str(), &tier), "unknown ISA tier '", name,
           "' (expected one of amx, avx512_vnni, avx2, portable)");
  return bc::set_isa(tier);
}

}  // namespace

// ---- int8 dynamic quantization (quantize_rows.cpp, int8_linear*.cpp; bertfast/backends/cpu/quant.py) ----

namespace {

// x (M, K) float32, contiguous along K (rows any stride apart).
void check_rows_f32(const at::Tensor& x, const char* name) {
  check_tensor(x, name);
  BF_CHECK(x.scalar_type() == at::kFloat, name, " must be float32, got ", x.scalar_type());
  BF_CHECK(x.dim() == 2, name, " must be (tokens, features), got ", x.sizes());
  BF_CHECK(x.stride(1) == 1 || x.size(1) <= 1, name, " must be contiguous along features, got strides ", x.strides());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  check_rows_f32(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M}, x.options());
  at::Tensor zp = at::empty({M}, x.options().dtype(at::kInt));
  if (M > 0) {
    py::gil_scoped_release nogil;
    bc::quantize_rows(x.data_ptr<float>(), M > 1 ? x.stride(0) : K, M, K, q.data_ptr<int8_t>(),
                      scale.data_ptr<float>(), zp.data_ptr<int32_t>());
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
                        const c10::optional<at::Tensor>& residual) {
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
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor x_scale = at::empty({M}, x.options());
  at::Tensor x_zp = at::empty({M}, x.options().dtype(at::kInt));
  at::Tensor out = at::empty({M, N}, w_scale.options());
  if (M > 0) {
    py::gil_scoped_release nogil;
    bc::quantize_rows(x.data_ptr<float>(), M > 1 ? x.stride(0) : K, M, K, q.data_ptr<int8_t>(),
                      x_scale.data_ptr<float>(), x_zp.data_ptr<int32_t>());
    bc::int8_linear(q.data_ptr<int8_t>(), K, M, K, x_scale.data_ptr<float>(), x_zp.data_ptr<int32_t>(),
                    packed.data_ptr<int8_t>(), N, w_scale.data_ptr<float>(), colsum.data_ptr<float>(), ptr<float>(b),
                    a, ptr<float>(r), r.defined() ? r.stride(0) : 0, out.data_ptr<float>());
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "bertfast native CPU kernels (fp32 and bf16, packed [T, H] token layout)";
  m.def("embed", &embed,
        "LayerNorm(word[ids] + type[types] + position[positions]) -> (T, H); no token types or no position table "
        "(rotary models): those terms left out",
        py::arg("input_ids"), py::arg("position_ids"), py::arg("token_type_ids"), py::arg("word"),
        py::arg("position"), py::arg("token_type"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"));
  m.def("layernorm", &layernorm, "LayerNorm(x + residual) over the last dim, fp32 statistics", py::arg("x"),
        py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("attention", &attention,
        "varlen attention on packed q, k, v (T, heads, d) -> (T, heads * d); bf16_products: fp32 inputs may "
        "run the products on bf16 operands (AMX, fp32 accumulation and softmax); bias_table (heads, width) float32 "
        "and bias_positions (T,) int32: score(t, u) += bias_table[h, (width - 1) / 2 + pos[u] - pos[t]] (MPNet); "
        "window > 0: token t attends only to the tokens u of its sequence with |t - u| <= window",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens"), py::arg("max_seqlen"), py::arg("scale"),
        py::arg("bf16_products") = false, py::arg("bias_table") = py::none(), py::arg("bias_positions") = py::none(),
        py::arg("window") = 0);
  m.def("rotary_", &rotary_,
        "RoPE in place, half-split convention, exact fp32 math: x (T, heads, d) rows and heads any stride apart, "
        "cos and sin (T, d / 2) float32; returns x",
        py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("glu", &glu, "the gate of a GLU FFN: h (M, 2N) -> act(h[:, :N]) * h[:, N:] (M, N), fp32 math", py::arg("h"),
        py::arg("act"));
  m.def("pack_linear", &pack_linear, "pack a (N, K) weight for `linear`", py::arg("weight"));
  m.def("linear", &linear,
        "act(x @ w.T + bias) + residual on a packed weight (streaming at small M; fp32 blocked at large M); act in "
        "none|gelu|gelu_tanh|relu|tanh|silu",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("act") = "none", py::arg("residual") = py::none());
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
  py::class_<Layer>(m, "Layer",
                    "one post-LayerNorm encoder layer on packed weights (a LayerWeights), run whole in C++ on the "
                    "extension's GEMMs; call it with (x, cu_seqlens, max_seqlen, scale[, bias_table, bias_positions]), "
                    "the bias as in `attention`")
      .def(py::init<const LayerTensors&, int64_t, int64_t, int64_t, double, const std::string&>(), py::arg("weights"),
           py::arg("hidden"), py::arg("intermediate"), py::arg("heads"), py::arg("eps"), py::arg("act"))
      .def("__call__", &Layer::forward, py::arg("x"), py::arg("cu_seqlens"), py::arg("max_seqlen"), py::arg("scale"),
           py::arg("bias_table") = py::none(), py::arg("bias_positions") = py::none());
  m.def("isa", &isa, "the ISA tier the kernels dispatch to: 'amx', 'avx512_vnni', 'avx2' or 'portable'");
  m.def("detected_isa", &detected_isa, "the best ISA tier this CPU (and OS) supports");
  m.def("set_isa", &set_isa, "cap the kernels at an ISA tier; returns False if the CPU lacks it", py::arg("isa"));
  m.def("has_avx512_bf16", &bc::has_avx512_bf16,
        "whether the kernels use AVX-512 BF16 dot products (the CPU has them, not hidden)");
  m.def("set_avx512_bf16", &bc::set_avx512_bf16,
        "hide (False) or restore (True) AVX-512 BF16, as BERTFAST_ISA=avx512_vnni-nobf16 does at load; returns False if "
        "the CPU lacks it or the amx tier is active", py::arg("enabled"));
  m.def("has_avx_vnni", &bc::has_avx_vnni, "whether the avx2 tier's int8 GEMM uses AVX-VNNI (the CPU has it, not hidden)");
  m.def("set_avx_vnni", &bc::set_avx_vnni, "hide (False) or restore (True) AVX-VNNI; False if the CPU lacks it",
        py::arg("enabled"));
  m.def("num_threads", &bc::num_threads, "OpenMP threads the kernels use");
  // int8 dynamic quantization (bertfast/backends/cpu/quant.py)
  m.def("quantize_rows", &quantize_rows, "per-token asymmetric int8 quantization: x (M, K) fp32 -> (q int8, scale, zero_point)",
        py::arg("x"));
  m.def("pack_int8", &pack_int8, "pack an int8 (N, K) weight for quant_linear", py::arg("weight"));
  m.def("quant_linear", &quant_linear,
        "quantize_rows, then the int8 GEMM on pack_int8 weights with the dequantization epilogue fused (AMX-int8 / "
        "VNNI / AVX2 / portable by the ISA tier): act(x @ W.T + bias) + residual for fp32 x (M, K)",
        py::arg("x"), py::arg("packed"), py::arg("w_scale"), py::arg("colsum"), py::arg("bias") = py::none(),
        py::arg("act") = "none", py::arg("residual") = py::none());
}
