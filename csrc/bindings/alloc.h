// Allocation of packed weights and of the native ops' large activations (the policies: alloc.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace bertfast {
namespace bindings {

// A 1-D tensor of `numel` elements for a packed weight, on 2 MB huge pages where it is large enough.
at::Tensor empty_streamed(int64_t numel, const at::TensorOptions& options);

// at::empty(sizes, options) for an op's output or scratch: blocks of 1 MiB and more come from a cache of the blocks
// such tensors freed (alloc.cpp), so a forward's activations do not take fresh pages from the kernel every call.
at::Tensor empty_activation(at::IntArrayRef sizes, const at::TensorOptions& options);

// The cache's state: (bytes cached now, its cap in bytes, blocks reused, blocks allocated) since the process began.
std::tuple<int64_t, int64_t, int64_t, int64_t> activation_cache_stats();

}  // namespace bindings
}  // namespace bertfast
