// Varlen fused attention on packed tokens: softmax(q k^T * scale) v per sequence and head, tiled over
// queries (kQBlock rows) and keys (kKBlock keys) with an online softmax, so no score buffer is larger
// than one [kQBlock, kKBlock] tile. Q/K/V are read in place through row/head strides (views of the
// fused [T, 3H] QKV output). A work item is one (sequence, head): its K (transposed, per key tile) and V
// are widened to fp32 once and reused by all its query blocks; all math is fp32. bf16 with head_dim <= 64
// on a CPU with AMX runs the two products on tiles instead (attention_amx: same tiling, bf16 operands,
// fp32 accumulation and softmax); fp32 inputs with bf16 products (the int8 path) on AVX-512 BF16 without AMX run
// them on vdpbf16ps where the layer has no position bias or window (attention_avx512bf16), and on AVX-512 VNNI
// without AVX-512 BF16 on int16 codes (attention_avx512int16). An optional relative position bias (MPNet's table, or
// DeBERTa-v2's c2p / p2c, `AttnBias`) is added to each score tile between the product and the softmax, on every tier,
// the AMX tiles included.
//
// Sliding window (window > 0, ModernBERT's local layers): query t sees key u iff |t - u| <= window. A query
// block visits only the key tiles that meet its rows' windows, its diagonal tile first (it holds every row's
// own key, so each row's running max is finite from then on); in a boundary tile the scores outside the window
// are set to -inf before the softmax and their probabilities to 0 after it. Work is linear in length then,
// like the memory (K and V widened once per (sequence, head), nothing quadratic). A window reaching the whole
// sequence (window >= len - 1) is no window for that sequence: the same tiles in the same order as global
// attention. The AMX tiles take windowed calls too (they skip the key blocks outside the windows as well), so which
// kernel runs depends on the layer (dtype, head_dim), never on the lengths in the call: a row's bits do not
// depend on its batch.
//
// The files: attention_items.h (the work items, their row prefetch), attention_impl.h (tiles, scratch, the fp32-math
// driver attention_thread), attention_portable.cpp, attention_avx2.cpp and attention_avx512.cpp (the fp32-math tiers'
// blocks), attention_avx512bf16.cpp (the int8 path's bf16 products on AVX-512 BF16), attention_avx512int16.cpp (its
// int16 products on AVX-512 VNNI without BF16), attention_amx.cpp (bf16 products on AMX tiles); this one chooses
// (choose_attention) and dispatches.
#include <omp.h>

#include <algorithm>
#include <cstdlib>

#include "cpu/attention/attention_impl.h"

namespace bertfast {
namespace cpu {

using namespace attention_detail;

// int16 products on AVX-512 VNNI without AVX-512 BF16 (attention_avx512int16.cpp): fp32 q, k, v, head_dim <= 64, no
// position bias, no window.
#if BF_X86
namespace attention_detail {
BF_TARGET_VNNI void attention_avx512int16(const float* q, const float* k, const float* v, const AttnStrides& st,
                                          const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t d,
                                          float scale, float* out, std::atomic<int64_t>* next);
}  // namespace attention_detail
#endif

Scratch& attention_detail::thread_scratch() {
  static thread_local Scratch sc;
  return sc;
}

// The threads a call takes (0: nothing to compute). Work items are whole (sequence, head) pairs: worth a second
// thread from a few of them on.
static int attention_threads(const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t head_dim,
                             int64_t window) {
  int64_t work = 0;  // score elements computed (about: boundary tiles are computed whole)
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = cu_seqlens[b + 1] - cu_seqlens[b];
    work += len * (window > 0 ? std::min(len, 2 * window + 1) : len);
  }
  return work == 0 ? 0 : int(std::min<int64_t>(batch * heads, threads_for(work * heads * head_dim)));
}

const char* attention_path_name(AttentionPath path) {
  switch (path) {
    case AttentionPath::Portable: return "Portable";
    case AttentionPath::Avx2: return "Avx2";
    case AttentionPath::Avx512: return "Avx512";
    case AttentionPath::Avx512Bf16: return "Avx512Bf16";
    case AttentionPath::Int16: return "Int16";
    case AttentionPath::Amx: return "Amx";
    case AttentionPath::AmxEmulated: return "AmxEmulated";
  }
  return "?";
}

// The one rule. Batch invariance: it reads the layer (dtype, head_dim, bias, window) and the tier, never a length,
// so a sequence runs on the same kernel alone and beside others. Its thresholds: head_dim <= 64, the bf16-product
// kernels' (AMX tiles, vdpbf16ps, int16) largest head, and on the amx tiers head_dim < 64, below which the tiles lose.
AttentionPath choose_attention(const AttentionCall& c) {
  const bool products16 = (c.bf16 || c.bf16_products) && c.head_dim <= 64;
  if (products16 && (c.isa == Isa::Amx || c.isa == Isa::AmxEmulated)) {
    // The tiles lose to the AVX-512 kernels on the int8 path's bf16 products and on heads under 64 wide
    // (docs/tiers.md#attention-on-the-amx-tier); the emulated tier makes the same choice it stands in for.
    if (c.bf16_products && !c.bf16 && !c.has_bias && c.window <= 0) return AttentionPath::Int16;
    if (c.bf16 && c.head_dim < 64) return AttentionPath::Avx512;
    return c.isa == Isa::Amx ? AttentionPath::Amx : AttentionPath::AmxEmulated;
  }
  // Without AMX: no position bias; the bf16 dtype's kernel takes its window (P in two parts, as the amx tiers carry
  // it, so a window reaching every key stays global attention bit for bit), the int8 path's (P rounded once: its
  // output is quantized next) none.
  if (products16 && c.isa == Isa::Avx512Vnni && !c.has_bias && (c.bf16 || c.window <= 0)) {
    if (c.avx512_bf16) return AttentionPath::Avx512Bf16;
    if (!c.bf16) return AttentionPath::Int16;
  }
  if (c.isa >= Isa::Avx512Vnni) return AttentionPath::Avx512;
  return c.isa == Isa::Avx2 ? AttentionPath::Avx2 : AttentionPath::Portable;
}

template <typename T>
void attention(const T* q, const T* k, const T* v, const AttnStrides& s, const int32_t* cu_seqlens,
               int64_t batch, int64_t heads, int64_t head_dim, float scale, T* out, bool bf16_products,
               const AttnBias* bias, int64_t window) {
  const AttentionPath path = choose_attention(
      {sizeof(T) == 2, bf16_products, head_dim, bias != nullptr, window, active_isa(), has_avx512_bf16()});
  const int nt = attention_threads(cu_seqlens, batch, heads, head_dim, window);
  if (nt == 0) return;
  // Every thread claims (sequence, head) items from one counter until none are left.
  std::atomic<int64_t> next{0};
  parallel_for(nt, nt, [&](int64_t) {
    switch (path) {
#if BF_X86
      case AttentionPath::Amx:
        return attention_amx(q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out, &next, bias, window);
      case AttentionPath::AmxEmulated:
        return attention_amx_emulated(q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out, &next, bias,
                                      window);
      case AttentionPath::Avx512Bf16:
        if constexpr (sizeof(T) == 4)
          return attention_avx512bf16<float, float, false>(q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out,
                                                           &next, 0);
        else
          return attention_avx512bf16<bf16, bf16, true>(q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out,
                                                        &next, window);
      case AttentionPath::Int16:
        if constexpr (sizeof(T) == 4)
          return attention_avx512int16(q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out, &next);
        else
          std::abort();  // choose_attention gives Int16 to fp32 inputs only
      case AttentionPath::Avx512:
        return attention_avx512(q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out, &next, bias, window);
      case AttentionPath::Avx2:
        return attention_avx2(q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out, &next, bias, window);
#endif
      case AttentionPath::Portable:
      default:
        return attention_generic(q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out, &next, bias, window);
    }
  });
}

// The layer's questions (kernels.h), answered by the same rule on fp32 inputs with bf16 products and no window.
bool attention_from_bf16(int64_t head_dim, bool bias_or_window) {
  return choose_attention({false, true, head_dim, bias_or_window, 0, active_isa(), has_avx512_bf16()}) ==
         AttentionPath::Avx512Bf16;
}

bool attention_int16(int64_t head_dim, bool bias_or_window) {
  return choose_attention({false, true, head_dim, bias_or_window, 0, active_isa(), has_avx512_bf16()}) ==
         AttentionPath::Int16;
}

void attention_bf16_products(const bf16* q, const bf16* k, const bf16* v, const AttnStrides& s,
                             const int32_t* cu_seqlens, int64_t batch, int64_t heads, int64_t head_dim, float scale,
                             float* out) {
#if BF_X86
  const int nt = attention_threads(cu_seqlens, batch, heads, head_dim, 0);
  if (nt == 0) return;
  std::atomic<int64_t> next{0};
  parallel_for(nt, nt, [&](int64_t) {
    attention_avx512bf16<bf16, float, false>(q, k, v, s, cu_seqlens, batch, heads, head_dim, scale, out, &next, 0);
  });
#else
  (void)q, (void)k, (void)v, (void)s, (void)cu_seqlens, (void)batch, (void)heads, (void)head_dim, (void)scale,
      (void)out;
#endif
}

template void attention<float>(const float*, const float*, const float*, const AttnStrides&, const int32_t*,
                               int64_t, int64_t, int64_t, float, float*, bool, const AttnBias*, int64_t);
template void attention<bf16>(const bf16*, const bf16*, const bf16*, const AttnStrides&, const int32_t*, int64_t,
                              int64_t, int64_t, float, bf16*, bool, const AttnBias*, int64_t);

}  // namespace cpu
}  // namespace bertfast
