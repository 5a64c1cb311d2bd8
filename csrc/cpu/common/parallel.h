// Threads: parallel_for, how many threads a piece of work gets, static and meet-in-the-middle splits of it.
//
// `parallel_for(threads, n, f)` runs f(i) for i in [0, n).
//
// Always on OpenMP, the runtime torch's own GEMMs (MKL, oneDNN) and ops run on: one team for the whole
// forward, whichever ops it mixes. After a parallel region libgomp's workers spin for a while before
// they sleep, so the next region (ours or torch's) starts without a wake-up; a second thread pool
// would compete with those spinning workers for the cores instead. Chunks are claimed dynamically, so a
// thread that joins late takes fewer.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "cpu/common/types.h"

namespace bertfast {
namespace cpu {

// OpenMP threads the kernels use: the calling thread's own setting (each thread has its own, and a thread the
// runtime did not start has the process default until it sets it).
inline int num_threads() { return omp_get_max_threads(); }

// Sets num_threads() for the calling thread only: the parallel regions it starts from now on, its kernels' and
// torch's ops' alike (bertfast/workers.py gives each worker thread its share of the cores this way).
inline void set_num_threads(int n) { omp_set_num_threads(n); }

// Static split of [0, n) into nt contiguous chunks; chunk `tid` is [*lo, *hi).
BF_INLINE void split_range(int64_t n, int tid, int nt, int64_t* lo, int64_t* hi) {
  int64_t base = n / nt, rem = n % nt;
  *lo = tid * base + (tid < rem ? tid : rem);
  *hi = *lo + base + (tid < rem ? 1 : 0);
}

// Threads worth using for `work` elementwise operations: one thread below ~32k elements, where
// waking the OpenMP team costs more than it saves.
BF_INLINE int threads_for(int64_t work) { return work < 32768 ? 1 : num_threads(); }

// f(i) for every i in [0, n), on up to `threads` threads (1: inline on the caller, no region).
template <typename F>
void parallel_for(int threads, int64_t n, const F& f) {
  threads = int(std::min<int64_t>(threads, n));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) f(i);
}

// Items [0, n) shared out to `parts` workers so that each reads one contiguous stretch and none waits
// for another: workers 2r and 2r + 1 share run r, the first walking it up from its front, the second
// down from its back, claiming one item at a time until they meet (a lone last worker walks its run
// alone). A worker that starts late or is descheduled takes fewer items instead of holding the rest
// up. Made for the small-M GEMM, whose items are weight panels streamed from memory: with static
// halves the two threads of this 2-core machine finished a BERT-base GEMM 16% of its time apart.
class MeetInTheMiddle {
 public:
  MeetInTheMiddle(int64_t n, int parts) : n_(n), parts_(parts), taken_(new std::atomic<int64_t>[(parts + 1) / 2]) {
    for (int r = 0; r < (parts + 1) / 2; ++r) taken_[r].store(0, std::memory_order_relaxed);
  }

  class Walker {
   public:
    // The next item for this worker, or -1 once its run is used up.
    int64_t claim() {
      if (taken_->fetch_add(1, std::memory_order_relaxed) >= size_) return -1;
      const int64_t item = next_;
      next_ += step_;
      return item;
    }
    // The item this worker would claim next (its partner may get it first), or -1 past the run's end.
    int64_t peek() const { return next_ >= lo_ && next_ < hi_ ? next_ : -1; }

   private:
    friend class MeetInTheMiddle;
    std::atomic<int64_t>* taken_;
    int64_t lo_, hi_, size_, next_, step_;
  };

  Walker walker(int part) const {
    const int run = part / 2;
    // Run r covers the share of the items of the workers it has (two, or one for a lone last worker).
    const int64_t lo = n_ * (2 * run) / parts_, hi = n_ * std::min(2 * run + 2, parts_) / parts_;
    const bool down = part % 2 == 1;
    Walker w;
    w.taken_ = &taken_[run];
    w.lo_ = lo;
    w.hi_ = hi;
    w.size_ = hi - lo;
    w.next_ = down ? hi - 1 : lo;
    w.step_ = down ? -1 : 1;
    return w;
  }

 private:
  int64_t n_;
  int parts_;
  std::unique_ptr<std::atomic<int64_t>[]> taken_;
};

}  // namespace cpu
}  // namespace bertfast
