// The activations of the GEMM epilogues: one enum, its names, the parser and a compile-time dispatch.
#pragma once

#include <cstring>
#include <type_traits>

#include "cpu/common/types.h"

namespace bertfast {
namespace cpu {

enum class Activation : int { None = 0, Gelu = 1, GeluTanh = 2, Relu = 3, Tanh = 4, Silu = 5 };

// The names Python passes, in enum order.
constexpr const char* kActivationNames[] = {"none", "gelu", "gelu_tanh", "relu", "tanh", "silu"};
constexpr int kActivations = sizeof(kActivationNames) / sizeof(kActivationNames[0]);
constexpr const char* kActivationChoices = "none, gelu, gelu_tanh, relu, tanh or silu";

// The activation named `name`; false (and *act untouched) if none has that name.
inline bool parse_activation(const char* name, Activation* act) {
  for (int i = 0; i < kActivations; ++i) {
    if (std::strcmp(name, kActivationNames[i]) == 0) {
      *act = static_cast<Activation>(i);
      return true;
    }
  }
  return false;
}

template <Activation A>
using ActivationTag = std::integral_constant<Activation, A>;

// f(ActivationTag<act>{}): the run-time activation as a compile-time one, so that each instantiation's
// loops are straight vectorizable bodies. f must not force-inline targeted code into itself (GCC will not
// inline a function compiled for an ISA into one that is not): call non-inline per-ISA functions from it.
template <typename F>
BF_INLINE decltype(auto) with_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::Gelu:
      return f(ActivationTag<Activation::Gelu>{});
    case Activation::GeluTanh:
      return f(ActivationTag<Activation::GeluTanh>{});
    case Activation::Relu:
      return f(ActivationTag<Activation::Relu>{});
    case Activation::Tanh:
      return f(ActivationTag<Activation::Tanh>{});
    case Activation::Silu:
      return f(ActivationTag<Activation::Silu>{});
    default:
      return f(ActivationTag<Activation::None>{});
  }
}

}  // namespace cpu
}  // namespace bertfast
