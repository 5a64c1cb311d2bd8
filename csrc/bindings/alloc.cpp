// The huge-page allocation policy for packed weights (declared in alloc.h), used by pack_linear.
#include "bindings/alloc.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/generated/variable_factories.h>

#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace bertfast {
namespace bindings {

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

}  // namespace bindings
}  // namespace bertfast
