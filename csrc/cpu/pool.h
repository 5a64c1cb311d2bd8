// How the kernels use threads: `parallel_for(tokens, threads, n, f)` runs f(i) for i in [0, n).
//
// Two mechanisms, chosen by the size of the forward the op belongs to, so that one forward never mixes
// them. Large batches (more than kPoolMaxTokens tokens) run on OpenMP, the runtime torch's GEMMs (MKL,
// oneDNN) use between our ops: one team, no competition. Small batches run every op on our own kernels
// (small-M GEMMs included) and use `HelperPool`: OpenMP's fork-join makes each call wait until every team
// thread has been scheduled and has checked in, which on a busy machine (another process, or another
// library's thread pool spinning after its call) costs a scheduler time slice per op against tens of
// microseconds of work. In the pool the caller runs chunks itself, helpers that wake in time take some
// too, and a helper that wakes late finds none left and is not waited for.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace bertfast {
namespace cpu {

// Ops on at most this many tokens use the helper pool (the small-M GEMMs run up to 256 tokens).
constexpr int64_t kPoolMaxTokens = 256;

using ChunkFn = void (*)(const void* ctx, int64_t i);

// Runs fn(ctx, i) for every i in [0, n) on the calling thread and the pool's helpers (num_threads() - 1
// threads); returns when all have run. Calls from several threads are serialized.
void pool_run(ChunkFn fn, const void* ctx, int64_t n);

// f(i) for every i in [0, n), on up to `threads` threads (1: inline). `tokens`: the op's token count,
// which picks the mechanism (see above). Chunks are claimed dynamically in both.
template <typename F>
void parallel_for(int64_t tokens, int threads, int64_t n, const F& f) {
  threads = int(std::min<int64_t>(threads, n));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
  } else if (tokens <= kPoolMaxTokens) {
    pool_run([](const void* ctx, int64_t i) { (*static_cast<const F*>(ctx))(i); }, &f, n);
  } else {
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) f(i);
  }
}

}  // namespace cpu
}  // namespace bertfast
