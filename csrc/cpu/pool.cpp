// The helper pool behind `parallel_for` for small batches (see pool.h).
#include "pool.h"

#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"

namespace bertfast {
namespace cpu {
namespace {

class HelperPool {
 public:
  using Fn = void (*)(const void*, int64_t);
  static constexpr int64_t kMaxChunks = 0xffff;

  explicit HelperPool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~HelperPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      job_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // Runs fn(ctx, i) for i in [0, chunks) (chunks <= kMaxChunks), in the caller and any helper that
  // joins in time; returns when every chunk has run.
  void run(Fn fn, const void* ctx, int64_t chunks) {
    std::lock_guard<std::mutex> one_job(run_mu_);  // callers serialize here
    const uint32_t job = uint32_t(job_.load(std::memory_order_relaxed) + 1);
    fn_ = fn;
    ctx_ = ctx;
    done_.store(0, std::memory_order_relaxed);
    // One word holds the job id, the chunk count and the next chunk: a helper claims a chunk only
    // with a compare-exchange on the word of the job it woke for, so a late helper can never take a
    // chunk of a later job with a stale count (and fn_/ctx_ it then reads are that job's).
    next_.store((uint64_t(job) << 32) | (uint64_t(chunks) << 16), std::memory_order_release);
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_.store(job, std::memory_order_release);
    }
    cv_.notify_all();
    drain(job);
    while (done_.load(std::memory_order_acquire) < chunks) spin_pause();
  }

 private:
  static void spin_pause() {
#if BF_X86
    _mm_pause();
#endif
  }

  void drain(uint32_t job) {
    for (;;) {
      uint64_t v = next_.load(std::memory_order_acquire);
      int64_t i;
      for (;;) {
        if (uint32_t(v >> 32) != job) return;
        i = int64_t(v & 0xffff);
        if (i >= int64_t((v >> 16) & 0xffff)) return;
        if (next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) break;
      }
      fn_(ctx_, i);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void loop() {
    uint64_t seen = job_.load();
    for (;;) {
      uint64_t j = job_.load(std::memory_order_acquire);
      for (int spin = 0; j == seen && spin < 4000; ++spin) {  // ~20 us of spinning before sleeping
        spin_pause();
        j = job_.load(std::memory_order_acquire);
      }
      if (j == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return job_.load() != seen; });
        j = job_.load();
        if (stop_) return;
      }
      seen = j;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (stop_) return;
      }
      drain(uint32_t(j));
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> job_{0};
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0};
  Fn fn_ = nullptr;
  const void* ctx_ = nullptr;
  bool stop_ = false;
};


HelperPool& helper_pool() {
  static HelperPool pool(std::max(0, num_threads() - 1));
  return pool;
}

}  // namespace

void pool_run(ChunkFn fn, const void* ctx, int64_t n) {
  // More chunks than the job word can count run in rounds (never in practice: ops pass a few).
  for (int64_t lo = 0; lo < n; lo += HelperPool::kMaxChunks) {
    const int64_t count = std::min<int64_t>(HelperPool::kMaxChunks, n - lo);
    struct Shifted {
      ChunkFn fn;
      const void* ctx;
      int64_t lo;
    } s{fn, ctx, lo};
    helper_pool().run([](const void* c, int64_t i) {
      const Shifted& s = *static_cast<const Shifted*>(c);
      s.fn(s.ctx, s.lo + i);
    }, &s, count);
  }
}

}  // namespace cpu
}  // namespace bertfast
