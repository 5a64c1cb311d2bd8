// The (sequence, head) work items of an attention call and the prefetch of their rows, for every kernel's driver
// (attention_impl.h's attention_thread, attention_avx512bf16.cpp, attention_avx512int16.cpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "cpu/common/kernels.h"
#include "cpu/common/types.h"

namespace bertfast {
namespace cpu {
namespace attention_detail {

// The (sequence, head) work items of one call, claimed from a counter the threads share until none are
// left: a dynamic schedule, since sequences differ in length and so items in cost. Empty sequences are
// skipped.
struct WorkItems {
  std::atomic<int64_t>* next;
  const int32_t* cu_seqlens;
  int64_t total, heads;
  bool claim(int64_t* h, int64_t* start, int64_t* len) {
    for (;;) {
      const int64_t w = next->fetch_add(1, std::memory_order_relaxed);
      if (w >= total) return false;
      const int64_t b = w / heads;
      *h = w % heads;
      *start = cu_seqlens[b];
      *len = cu_seqlens[b + 1] - *start;
      if (*len > 0) return true;
    }
  }
};

// Pulls the q, k, v and output rows of the item a thread claimed next toward L2, a few rows per call of
// step() while the current item computes: they come from a [T, 3H] tensor larger than L2, one head's
// slice of each row at a time, which the hardware prefetchers do not follow.
struct RowPrefetch {
  const char* src[4];
  int64_t stride[4];  // bytes between rows
  int64_t bytes = 0, out_bytes = 0, rows = 0, next = 0;

  template <typename T, typename O>  // q, k, v of T, out of O
  void start(const T* q, const T* k, const T* v, O* out, const AttnStrides& st, int64_t heads, int64_t d,
             int64_t h, int64_t row0, int64_t len) {
    const T* base[3] = {q + row0 * st.q_row + h * st.q_head, k + row0 * st.k_row + h * st.k_head,
                        v + row0 * st.v_row + h * st.v_head};
    const int64_t strides[3] = {st.q_row, st.k_row, st.v_row};
    for (int i = 0; i < 3; ++i) {
      src[i] = reinterpret_cast<const char*>(base[i]);
      stride[i] = strides[i] * int64_t(sizeof(T));
    }
    src[3] = reinterpret_cast<const char*>(out + row0 * heads * d + h * d);
    stride[3] = heads * d * int64_t(sizeof(O));
    bytes = d * int64_t(sizeof(T));
    out_bytes = d * int64_t(sizeof(O));
    rows = len;
    next = 0;
  }

  BF_INLINE void step(int64_t n) {
    for (const int64_t end = std::min(rows, next + n); next < end; ++next) {
      for (int i = 0; i < 3; ++i) lines<0>(src[i] + next * stride[i], bytes);
      lines<1>(src[3] + next * stride[3], out_bytes);
    }
  }

  // Paced (item_by_key): the rows spread over the item's work instead of a run's share at each run. pace(units)
  // before the item, with the units of work it will report; work(u) as it goes prefetches the rows due for u units,
  // a row or two at a time, so the lines in flight stay within the core's fill buffers (a run's rows at once, 160
  // lines for a MiniLM item, stalled it on them: benchmarks/results/2026-12-06-native-notes).
  float rate = 0.f, credit = 0.f;

  void pace(int64_t units) {
    rate = units > 0 ? float(rows) / float(units) : 0.f;
    credit = 0.f;
  }

  BF_INLINE void work(int64_t units) {
    credit += float(units) * rate;
    if (credit >= 1.f) {
      const int64_t n = int64_t(credit);
      credit -= float(n);
      step(n);
    }
  }

  template <int kWrite>
  BF_INLINE void lines(const char* row, int64_t n) const {
    const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63));
    for (; line < row + n; line += 64) __builtin_prefetch(line, kWrite, 2);
  }
};

// f(h, start, len, pf) for each item this thread claims: one claimed ahead, so that pf, started on it (pf.rows its
// length; 0 after the last), pulls its rows in while this one computes.
template <typename T, typename O, typename F>
BF_INLINE void for_each_item(WorkItems& items, const T* q, const T* k, const T* v, O* out, const AttnStrides& st,
                             int64_t d, const F& f) {
  int64_t h, start, len, h_next = 0, start_next = 0, len_next = 0;
  for (bool have = items.claim(&h, &start, &len); have; h = h_next, start = start_next, len = len_next) {
    RowPrefetch pf;
    have = items.claim(&h_next, &start_next, &len_next);
    if (have) pf.start(q, k, v, out, st, items.heads, d, h_next, start_next, len_next);
    f(h, start, len, pf);
  }
}

}  // namespace attention_detail
}  // namespace cpu
}  // namespace bertfast
