// The input checks of `bertfast._C`, one place for all: each op wrapper (ops.cpp) and Layer (layer.h) validates
// every input here (device, dtype, shape, strides, index ranges) and raises ValueError with a message before any
// kernel runs.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "cpu/common/activation.h"
#include "cpu/common/kernels.h"

namespace bertfast {
namespace bindings {

namespace bc = ::bertfast::cpu;

#define BF_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, __VA_ARGS__)

inline void check_tensor(const at::Tensor& t, const char* name) {
  BF_CHECK(t.defined(), name, " is undefined");
  BF_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  BF_CHECK(t.layout() == at::kStrided, name, " must be a dense (strided) tensor");
}

inline void check_float(const at::Tensor& t, const char* name) {
  check_tensor(t, name);
  BF_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
           " must be float32 or bfloat16, got ", t.scalar_type());
}

inline void check_like(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  check_tensor(t, name);
  BF_CHECK(t.scalar_type() == ref.scalar_type(), name, " has dtype ", t.scalar_type(), " but the input has ",
           ref.scalar_type());
}

inline void check_contig(const at::Tensor& t, const char* name) {
  BF_CHECK(t.is_contiguous(), name, " must be contiguous (got strides ", t.strides(), ")");
}

// How an operand's elements must lie: all contiguous, or contiguous along the last dim (rows any stride apart).
enum class Layout { Contiguous, Rows };

// An operand of `ref`'s dtype and of shape `shape`, laid out as `layout` says.
inline void check_operand(const at::Tensor& t, const at::Tensor& ref, at::IntArrayRef shape, Layout layout,
                          const char* name) {
  check_like(t, ref, name);
  BF_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
  if (layout == Layout::Contiguous)
    check_contig(t, name);
  else
    BF_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, name, " must be contiguous along features, got strides ",
             t.strides());
}

inline void check_vector(const at::Tensor& t, const at::Tensor& ref, int64_t n, const char* name) {
  check_operand(t, ref, {n}, Layout::Contiguous, name);
}

// An optional operand (a bias, a residual): undefined when absent, else checked as check_operand does.
inline at::Tensor optional_operand(const c10::optional<at::Tensor>& t, const at::Tensor& ref, at::IntArrayRef shape,
                                   Layout layout, const char* name) {
  if (!t.has_value()) return at::Tensor();
  check_operand(*t, ref, shape, layout, name);
  return *t;
}

// A weight packed by pack_linear for an (n, k) linear, in `ref`'s dtype.
inline void check_packed(const at::Tensor& w, const at::Tensor& ref, int64_t n, int64_t k, const char* name) {
  check_like(w, ref, name);
  const int64_t want = bc::packed_numel(n, k, ref.scalar_type() == at::kBFloat16);
  BF_CHECK(w.dim() == 1 && w.numel() == want, name, " does not match (", n, ", ", k, "): expected ", want,
           " elements from pack_linear, got ", w.sizes());
  check_contig(w, name);
}

// A weight packed by pack_int8 for an (n, k) linear.
inline void check_packed_int8(const at::Tensor& w, int64_t n, int64_t k, const char* name) {
  check_tensor(w, name);
  const int64_t want = bc::int8_packed_numel(n, k);
  BF_CHECK(w.scalar_type() == at::kChar && w.dim() == 1 && w.numel() == want, name, " does not match (", n, ", ", k,
           "): expected ", want, " int8 elements from pack_int8, got ", w.scalar_type(), " ", w.sizes());
  check_contig(w, name);
}

// Rows of `ids` must index into a table of `rows` rows.
inline void check_index(const at::Tensor& ids, int64_t n, int64_t rows, const char* name) {
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
inline int64_t check_cu_seqlens(const at::Tensor& cu_seqlens, int64_t tokens, int64_t max_seqlen, const char* input) {
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

// positions (T,) int32 contiguous, every distance between two tokens of one sequence at most `reach` (what the
// per-distance table `what` covers); returns its data.
inline const int32_t* check_positions(const at::Tensor& positions, int64_t tokens, const at::Tensor& cu_seqlens,
                                      int64_t reach, const char* what) {
  check_tensor(positions, "bias_positions");
  BF_CHECK(positions.scalar_type() == at::kInt, "bias_positions must be int32, got ", positions.scalar_type());
  BF_CHECK(positions.dim() == 1 && positions.size(0) == tokens, "bias_positions must be (", tokens, ",), got ",
           positions.sizes());
  check_contig(positions, "bias_positions");
  const int32_t* pos = positions.data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  for (int64_t b = 0; b + 1 < cu_seqlens.size(0); ++b) {
    if (cu[b + 1] == cu[b]) continue;
    const auto [lo, hi] = std::minmax_element(pos + cu[b], pos + cu[b + 1]);
    BF_CHECK(int64_t(*hi) - *lo <= reach, "bias_positions of sequence ", b, " span ", int64_t(*hi) - *lo,
             " but ", what, " (width ", 2 * reach + 1, ") covers distances up to ", reach);
  }
  return pos;
}

// The optional relative position bias of attention (`bc::AttnBias`; table and positions go together): table
// (heads, width) float32 contiguous with width odd, positions (T,) int32 contiguous, and every distance between
// two tokens of one sequence inside the table. table == nullptr in the result when absent.
inline bc::AttnBias check_attn_bias(const c10::optional<at::Tensor>& table, const c10::optional<at::Tensor>& positions,
                                    int64_t heads, int64_t tokens, const at::Tensor& cu_seqlens) {
  BF_CHECK(table.has_value() == positions.has_value(), "bias_table and bias_positions go together");
  if (!table.has_value()) return {nullptr, 0, nullptr};
  check_tensor(*table, "bias_table");
  BF_CHECK(table->scalar_type() == at::kFloat, "bias_table must be float32, got ", table->scalar_type());
  BF_CHECK(table->dim() == 2 && table->size(0) == heads && table->size(1) % 2 == 1,
           "bias_table must be (heads = ", heads, ", width) with width odd, got ", table->sizes());
  check_contig(*table, "bias_table");
  const int32_t* pos = check_positions(*positions, tokens, cu_seqlens, (table->size(1) - 1) / 2, "bias_table");
  return {table->data_ptr<float>(), table->size(1), pos};
}

// DeBERTa-v2's disentangled terms for attention (`bc::AttnBias` with an index): c2p / p2c (T, heads, cols) float32
// contiguous (either may be absent, not both), index (width,) int32 contiguous with width odd and values in
// [0, cols), positions (T,) int32 contiguous with every distance within a sequence inside the index. Fills `bias`.
inline void check_disentangled(const c10::optional<at::Tensor>& c2p, const c10::optional<at::Tensor>& p2c,
                               const c10::optional<at::Tensor>& index, const c10::optional<at::Tensor>& positions,
                               int64_t heads, int64_t tokens, const at::Tensor& cu_seqlens, bc::AttnBias* bias) {
  BF_CHECK(index.has_value() && positions.has_value() && (c2p.has_value() || p2c.has_value()),
           "the disentangled terms need rel_index, bias_positions and at least one of c2p, p2c");
  int64_t cols = -1;
  for (const auto& [t, name] : {std::pair{&c2p, "c2p"}, std::pair{&p2c, "p2c"}}) {
    if (!t->has_value()) continue;
    const at::Tensor& x = **t;
    check_tensor(x, name);
    BF_CHECK(x.scalar_type() == at::kFloat, name, " must be float32, got ", x.scalar_type());
    BF_CHECK(x.dim() == 3 && x.size(0) == tokens && x.size(1) == heads && x.size(2) > 0, name, " must be (T = ",
             tokens, ", heads = ", heads, ", cols > 0), got ", x.sizes());
    BF_CHECK(cols < 0 || x.size(2) == cols, "c2p and p2c must have one number of columns, got ", cols, " and ",
             x.size(2));
    check_contig(x, name);
    cols = x.size(2);
  }
  check_tensor(*index, "rel_index");
  BF_CHECK(index->scalar_type() == at::kInt && index->dim() == 1 && index->size(0) % 2 == 1,
           "rel_index must be (width,) int32 with width odd, got ", index->scalar_type(), " ", index->sizes());
  check_contig(*index, "rel_index");
  const int32_t* idx = index->data_ptr<int32_t>();
  const auto [lo, hi] = std::minmax_element(idx, idx + index->size(0));
  BF_CHECK(*lo >= 0 && *hi < cols, "rel_index values must lie in [0, ", cols, "), got [", *lo, ", ", *hi, "]");
  *bias = {nullptr, index->size(0), check_positions(*positions, tokens, cu_seqlens, (index->size(0) - 1) / 2,
                                                   "rel_index")};
  bias->c2p = c2p.has_value() ? c2p->data_ptr<float>() : nullptr;
  bias->p2c = p2c.has_value() ? p2c->data_ptr<float>() : nullptr;
  bias->index = idx;
  bias->cols = cols;
}

inline bc::Activation activation(const std::string& name) {
  bc::Activation act = bc::Activation::None;
  BF_CHECK(bc::parse_activation(name.c_str(), &act), "unknown activation '", name, "' (expected ",
           bc::kActivationChoices, ")");
  return act;
}

// x (M, K) float32, contiguous along K (rows any stride apart).
inline void check_rows_f32(const at::Tensor& x, const char* name) {
  check_tensor(x, name);
  BF_CHECK(x.scalar_type() == at::kFloat, name, " must be float32, got ", x.scalar_type());
  BF_CHECK(x.dim() == 2, name, " must be (tokens, features), got ", x.sizes());
  BF_CHECK(x.stride(1) == 1 || x.size(1) <= 1, name, " must be contiguous along features, got strides ", x.strides());
}

}  // namespace bindings
}  // namespace bertfast
