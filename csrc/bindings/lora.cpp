// The LoRA operands' checks (lora.h), shared by LoraTerm and LoraSlot, and the shrink's wrapper.
#include "bindings/lora.h"

#include <ATen/ops/zeros.h>
#include <pybind11/pybind11.h>

#include <algorithm>

#include "bindings/checks.h"
#include "cpu/common/kernels.h"

namespace py = pybind11;

namespace bertfast {
namespace bindings {

namespace {

void check_index_rows(const at::Tensor& index, int64_t factors) {
  check_tensor(index, "lora index");
  BF_CHECK(index.scalar_type() == at::kInt && index.dim() == 1 && index.is_contiguous(),
           "lora index must be a contiguous (rows,) int32 tensor, got ", index.scalar_type(), " ", index.sizes());
  const int32_t* p = index.data_ptr<int32_t>();
  for (int64_t i = 0; i < index.size(0); ++i)
    BF_CHECK(p[i] >= -1 && p[i] < factors, "lora index[", i, "] = ", p[i], " is out of range [-1, ", factors, ")");
}

// Each factor's A^T, (K, r) float32 contiguous with r a multiple of 16: their pointers and ranks.
void check_at(const std::vector<at::Tensor>& at, int64_t K, std::vector<const float*>* ptrs,
              std::vector<int64_t>* ranks) {
  BF_CHECK(!at.empty(), "lora needs at least one factor");
  for (size_t f = 0; f < at.size(); ++f) {
    check_tensor(at[f], "lora at");
    BF_CHECK(at[f].scalar_type() == at::kFloat && at[f].is_contiguous() && at[f].dim() == 2 &&
                 at[f].size(0) == K && at[f].size(1) % 16 == 0,
             "lora at ", f, " must be contiguous float32 (", K, ", a multiple of 16), got ", at[f].scalar_type(), " ",
             at[f].sizes());
    ptrs->push_back(at[f].data_ptr<float>());
    ranks->push_back(at[f].size(1));
  }
}

// Each factor's A^T in tile form (cpu/gemm/lora.h: bfloat16 (R / 16, steps, 2, 16, 16, 2), steps = ceil(K / 32)), or
// none at all: their pointers; and, where `ranks` is empty (no A^T but the tile form), the ranks they hold.
void check_tiles(const std::vector<at::Tensor>& tiles, int64_t steps, std::vector<int64_t>* ranks,
                 std::vector<const cpu::bf16*>* ptrs) {
  if (tiles.empty()) return;
  const bool given = !ranks->empty();
  BF_CHECK(!given || tiles.size() == ranks->size(), "lora needs one tiles per at or none, got ", tiles.size(),
           " and ", ranks->size());
  for (size_t f = 0; f < tiles.size(); ++f) {
    const at::Tensor& t = tiles[f];
    check_tensor(t, "lora tiles");
    BF_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.dim() == 6 && t.size(1) == steps &&
                 t.size(2) == 2 && t.size(3) == 16 && t.size(4) == 16 && t.size(5) == 2 &&
                 (!given || t.size(0) * 16 == (*ranks)[f]),
             "lora tiles ", f, " must be contiguous bfloat16 (", given ? (*ranks)[f] / 16 : -1, ", ", steps,
             ", 2, 16, 16, 2) (A.T in tile form), got ", t.scalar_type(), " ", t.sizes());
    if (!given) ranks->push_back(t.size(0) * 16);
    ptrs->push_back(reinterpret_cast<const cpu::bf16*>(t.data_ptr()));
  }
  if (!given) ranks->resize(tiles.size());
}

// Where a shrink has only the factors' tile forms (no A^T), the tier must run it on the tiles.
void check_tiles_only(bool tiles_only) {
  BF_CHECK(!tiles_only || cpu::amx_kernels(cpu::active_isa()), "lora: the factors' A^T is given only in tile form, "
           "which only the amx tiers shrink (the active tier has no tiles)");
}

// Each factor's bt (or B's tile form: bt_tiles, then bts is empty) and seg as the epilogue reads them
// (cpu/gemm/lora.h): the same segments of `width` columns for all, factor f's ranks within ranks[f] (its shrunk
// values) and its runs within its bt. Returns the segments.
int64_t check_factors(const std::vector<at::Tensor>& bts, const std::vector<at::Tensor>& segs, int64_t width,
                      const std::vector<int64_t>& ranks, std::vector<cpu::LoraFactor>* factors,
                      const std::vector<at::Tensor>& bt_tiles = {}) {
  BF_CHECK(width > 0, "lora width must be positive, got ", width);
  const bool tiles = !bt_tiles.empty();
  const std::vector<at::Tensor>& forms = tiles ? bt_tiles : bts;
  BF_CHECK(!tiles || bts.empty(), "lora takes bt or bt_tiles, not both");
  BF_CHECK(forms.size() == segs.size() && !forms.empty(), "lora needs one seg per bt and at least one, got ",
           forms.size(), " and ", segs.size());
  const int64_t segments = segs[0].dim() == 2 ? segs[0].size(0) : 0;
  for (size_t f = 0; f < forms.size(); ++f) {
    const at::Tensor &bt = forms[f], &seg = segs[f];
    check_tensor(bt, "lora bt");
    check_tensor(seg, "lora seg");
    BF_CHECK(bt.scalar_type() == (tiles ? at::kBFloat16 : at::kFloat) && bt.is_contiguous(), "lora ",
             tiles ? "bt_tiles " : "bt ", f, " must be contiguous ", tiles ? "bfloat16" : "float32");
    BF_CHECK(seg.scalar_type() == at::kInt && seg.is_contiguous() && seg.dim() == 2 && seg.size(1) == 3 &&
                 seg.size(0) == segments && segments > 0,
             "lora seg ", f, " must be contiguous int32 (", segments, ", 3), got ", seg.scalar_type(), " ",
             seg.sizes());
    const int32_t* g = seg.data_ptr<int32_t>();
    const int64_t padded = (width + 15) / 16 * 16;  // a segment's columns in whole 16-column groups
    for (int64_t i = 0; i < segments; ++i, g += 3) {
      const int64_t r = int64_t(g[1] - g[0]);
      const int64_t values = tiles ? padded * ((r + 15) / 16) * 32 : r * padded;  // tiles: 16 ranks in 512 per group
      BF_CHECK(0 <= g[0] && g[0] <= g[1] && g[1] <= ranks[f] && g[2] >= 0 && g[2] + values <= bt.numel(),
               "lora seg ", f, " segment ", i, " (", g[0], ", ", g[1], ", ", g[2], ") does not fit s of rank ",
               ranks[f], " and ", tiles ? "bt_tiles" : "bt", " of ", bt.numel(), " values");
    }
    if (tiles)
      factors->push_back({nullptr, seg.data_ptr<int32_t>(), reinterpret_cast<const cpu::bf16*>(bt.data_ptr())});
    else
      factors->push_back({bt.data_ptr<float>(), seg.data_ptr<int32_t>()});
  }
  return segments;
}

// A call's M rows and N outputs against the operands' index rows and segments.
void check_call(const at::Tensor& index, int64_t segments, int64_t width, int64_t M, int64_t N) {
  BF_CHECK(index.size(0) == M, "lora has ", index.size(0), " rows but x has ", M);
  BF_CHECK(segments * width == N, "lora covers ", segments, " x ", width, " columns but the output has ", N);
  BF_CHECK(segments == 1 || width % 16 == 0, "lora segments must be a multiple of 16 wide, got ", width);
}

}  // namespace

LoraOperands::LoraOperands(at::Tensor s, at::Tensor index, std::vector<at::Tensor> bts, std::vector<at::Tensor> segs,
                           int64_t width, std::vector<at::Tensor> bt_tiles)
    : s_(std::move(s)),
      index_(std::move(index)),
      bts_(std::move(bts)),
      segs_(std::move(segs)),
      bt_tiles_(std::move(bt_tiles)),
      width_(width) {
  check_tensor(s_, "lora s");
  BF_CHECK(s_.scalar_type() == at::kFloat && s_.dim() == 2 && (s_.stride(1) == 1 || s_.size(1) <= 1),
           "lora s must be (rows, rank) float32 contiguous along rank, got ", s_.scalar_type(), " ", s_.sizes());
  segments_ = check_factors(bts_, segs_, width_, std::vector<int64_t>(segs_.size(), s_.size(1)), &factors_, bt_tiles_);
  check_index_rows(index_, int64_t(factors_.size()));
  BF_CHECK(index_.size(0) == s_.size(0), "lora index has ", index_.size(0), " rows but s has ", s_.size(0));
}

cpu::LoraTerm LoraOperands::term(int64_t M, int64_t N) const {
  check_call(index_, segments_, width_, M, N);
  return {s_.data_ptr<float>(), s_.size(0) > 1 ? s_.stride(0) : s_.size(1), index_.data_ptr<int32_t>(),
          factors_.data(), width_};
}

LoraSlotOperands::LoraSlotOperands(at::Tensor index, std::vector<at::Tensor> at, std::vector<at::Tensor> bts,
                                   std::vector<at::Tensor> segs, int64_t width, std::vector<at::Tensor> tiles,
                                   std::vector<at::Tensor> bt_tiles)
    : index_(std::move(index)),
      at_(std::move(at)),
      bts_(std::move(bts)),
      segs_(std::move(segs)),
      tiles_(std::move(tiles)),
      bt_tiles_(std::move(bt_tiles)),
      width_(width) {
  const size_t factors = at_.empty() ? tiles_.size() : at_.size();
  BF_CHECK(factors > 0 && factors == segs_.size(), "lora needs one at (or tiles) per seg and at least one, got ",
           at_.size(), " (", tiles_.size(), ") and ", segs_.size());
  if (!at_.empty()) {
    check_tensor(at_[0], "lora at");
    k_ = at_[0].dim() == 2 ? at_[0].size(0) : 0;
    check_at(at_, k_, &at_ptrs_, &ranks_);
  }
  steps_ = at_.empty() ? (tiles_[0].dim() == 6 ? tiles_[0].size(1) : 0) : (k_ + 31) / 32;
  check_tiles(tiles_, steps_, &ranks_, &tile_ptrs_);
  rank_ = *std::max_element(ranks_.begin(), ranks_.end());
  segments_ = check_factors(bts_, segs_, width_, ranks_, &factors_, bt_tiles_);
  check_index_rows(index_, int64_t(factors_.size()));
}

cpu::LoraSlot LoraSlotOperands::slot(int64_t M, int64_t K, int64_t N, float* s, const at::Tensor* index) const {
  if (index != nullptr) check_index_rows(*index, int64_t(factors_.size()));
  const at::Tensor& rows = index != nullptr ? *index : index_;
  check_call(rows, segments_, width_, M, N);
  if (at_ptrs_.empty()) {
    BF_CHECK((K + 31) / 32 == steps_, "lora tiles hold ", steps_, " steps of 32 rows but the GEMM's input has ", K,
             " features");
  } else {
    BF_CHECK(k_ == K, "lora at has ", k_, " rows but the GEMM's input has ", K, " features");
  }
  check_tiles_only(at_ptrs_.empty());
  return {rows.data_ptr<int32_t>(), at_ptrs_.empty() ? nullptr : at_ptrs_.data(), ranks_.data(), factors_.data(),
          width_, s, rank(), tile_ptrs_.empty() ? nullptr : tile_ptrs_.data()};
}

at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& index, const std::vector<at::Tensor>& at,
                       const std::vector<at::Tensor>& tiles) {
  check_float(x, "x");
  BF_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(1) <= 1), "x must be (rows, in_features) contiguous along "
           "in_features, got ", x.sizes(), " strides ", x.strides());
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<const float*> ptrs;
  std::vector<int64_t> ranks;
  BF_CHECK(!at.empty() || !tiles.empty(), "lora needs at least one factor");
  if (!at.empty()) check_at(at, K, &ptrs, &ranks);
  std::vector<const cpu::bf16*> tile_ptrs;
  check_tiles(tiles, (K + 31) / 32, &ranks, &tile_ptrs);
  check_tiles_only(at.empty());
  const cpu::bf16* const* tp = tile_ptrs.empty() ? nullptr : tile_ptrs.data();
  const float* const* ap = ptrs.empty() ? nullptr : ptrs.data();
  check_index_rows(index, int64_t(ranks.size()));
  BF_CHECK(index.size(0) == M, "lora index has ", index.size(0), " rows but x has ", M);
  const int64_t R = *std::max_element(ranks.begin(), ranks.end());
  at::Tensor s = at::zeros({M, R}, x.options().dtype(at::kFloat));
  if (M == 0 || R == 0) return s;
  const int64_t ldx = M > 1 ? x.stride(0) : K;
  py::gil_scoped_release nogil;
  if (x.scalar_type() == at::kBFloat16)
    cpu::lora_shrink(reinterpret_cast<const cpu::bf16*>(x.data_ptr()), ldx, M, K, index.data_ptr<int32_t>(),
                     ap, ranks.data(), s.data_ptr<float>(), R, tp);
  else
    cpu::lora_shrink(x.data_ptr<float>(), ldx, M, K, index.data_ptr<int32_t>(), ap, ranks.data(),
                     s.data_ptr<float>(), R, tp);
  return s;
}

}  // namespace bindings
}  // namespace bertfast
