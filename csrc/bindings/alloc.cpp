// The allocation policies (declared in alloc.h): huge pages for packed weights (pack_linear), and a cache of
// freed blocks for the native ops' large outputs and scratch.
#include "bindings/alloc.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/generated/variable_factories.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace bertfast {
namespace bindings {

namespace {

constexpr size_t kHuge = size_t(2) << 20;

// A block of `bytes` (a multiple of 2 MB) aligned to 2 MB and marked for transparent huge pages (Linux, THP
// "madvise" or "always"; the advice is a hint: failure leaves ordinary pages), or nullptr.
void* huge_block(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kHuge, bytes) != 0) return nullptr;
#if defined(__linux__)
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return p;
}

size_t round_huge(size_t bytes) { return (bytes + kHuge - 1) / kHuge * kHuge; }

}  // namespace

// Packed weights are streamed once per forward: on 4 KB pages that is a TLB miss every 4 KB of a
// 100+ MB stream. Large packed weights get their own huge-page block; elsewhere, or if that fails, torch's
// allocator.
at::Tensor empty_streamed(int64_t numel, const at::TensorOptions& options) {
#if defined(__linux__)
  const size_t bytes = size_t(numel) * options.dtype().itemsize();
  if (bytes >= kHuge) {
    if (void* p = huge_block(round_huge(bytes)))
      return torch::from_blob(p, {numel}, [](void* q) { std::free(q); }, options);
  }
#endif
  return at::empty({numel}, options);
}

// A block of 113 MB (BERT-base's layer scratch at 4096 tokens) from torch's allocator is glibc's mmap: fresh pages
// every call, each zeroed by the kernel on first touch, then unmapped when freed (docs/threads.md). Blocks of
// kMinBytes and more are therefore kept when freed, up to a cap (BERTFAST_ACTIVATION_CACHE_MB, default 1024; 0 turns
// the cache off), and handed to the next request they fit (at most 1/4 larger, so a small tensor does not hold a large
// block): a steady workload's forward reuses its blocks and takes no new pages. Blocks are 2 MB aligned and advised as
// huge pages. The cache only ever holds memory no tensor uses, and is never destroyed (tensors may be freed at exit
// after static objects).
namespace {

constexpr size_t kMinBytes = size_t(1) << 20;

class BlockCache {
 public:
  BlockCache() {
    const char* env = std::getenv("BERTFAST_ACTIVATION_CACHE_MB");
    cap_ = size_t(env != nullptr && *env != '\0' ? std::max(0L, std::atol(env)) : 1024) << 20;
  }

  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= bytes + bytes / 4) {
        void* p = it->second;
        cached_ -= it->first;
        free_.erase(it);
        ++reused_;
        return p;
      }
      ++allocated_;
    }
    return huge_block(bytes);
  }

  void give(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_ + bytes <= cap_) {
        free_.emplace(bytes, p);
        cached_ += bytes;
        return;
      }
    }
    std::free(p);
  }

  bool enabled() const { return cap_ > 0; }

  std::tuple<int64_t, int64_t, int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {int64_t(cached_), int64_t(cap_), reused_, allocated_};
  }

 private:
  std::mutex mutex_;
  std::multimap<size_t, void*> free_;  // bytes -> block
  size_t cached_ = 0, cap_ = 0;
  int64_t reused_ = 0, allocated_ = 0;
};

BlockCache& block_cache() {
  static BlockCache* cache = new BlockCache();  // never destroyed: see above
  return *cache;
}

}  // namespace

at::Tensor empty_activation(at::IntArrayRef sizes, const at::TensorOptions& options) {
  int64_t numel = 1;
  for (const int64_t n : sizes) numel *= n;
  const size_t bytes = size_t(numel) * options.dtype().itemsize();
  BlockCache& cache = block_cache();
  if (bytes < kMinBytes || !cache.enabled() || options.device().type() != c10::DeviceType::CPU)
    return at::empty(sizes, options);
  const size_t rounded = round_huge(bytes);
  void* p = cache.take(rounded);
  if (p == nullptr) return at::empty(sizes, options);
  return torch::from_blob(p, sizes, [rounded](void* q) { block_cache().give(q, rounded); }, options);
}

std::tuple<int64_t, int64_t, int64_t, int64_t> activation_cache_stats() { return block_cache().stats(); }

}  // namespace bindings
}  // namespace bertfast
