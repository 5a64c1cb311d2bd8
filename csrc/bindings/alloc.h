// Allocation of packed weights (the policy: alloc.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace bertfast {
namespace bindings {

// A 1-D tensor of `numel` elements for a packed weight, on 2 MB huge pages where it is large enough.
at::Tensor empty_streamed(int64_t numel, const at::TensorOptions& options);

}  // namespace bindings
}  // namespace bertfast
