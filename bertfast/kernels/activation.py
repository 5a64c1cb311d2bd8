"""The one table of activation functions: the engine's ids, the Hugging Face names that map to them, and
each id as a torch function (out of place for the reference, in place after a large GEMM). The C++
kernels take the same ids by name (csrc enum `Activation`); Triton's linear takes them as a constexpr."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# id -> (out-of-place function, in-place function)
_FUNCTIONS = {
    "none": (lambda t: t, lambda t: t),
    "gelu": (F.gelu, lambda t: torch.ops.aten.gelu_(t)),
    "gelu_tanh": (lambda t: F.gelu(t, approximate="tanh"), lambda t: torch.ops.aten.gelu_(t, approximate="tanh")),
    "relu": (F.relu, torch.relu_),
    "tanh": (torch.tanh, torch.tanh_),
    "silu": (F.silu, lambda t: F.silu(t, inplace=True)),
}
IDS = tuple(_FUNCTIONS)  # every id an epilogue takes
LAYER_IDS = ("gelu", "gelu_tanh", "relu")  # the ids an encoder layer's FFN may use
GATED_IDS = ("gelu", "gelu_tanh", "relu", "silu")  # the ids a gated FFN (GeGLU, SwiGLU) may use on its gate

# Hugging Face `hidden_act` names -> id. `gelu_new` and `gelu_pytorch_tanh` are the same function (the
# tanh approximation), computed by torch in one case and spelled out in the other.
HF_NAMES = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
            "silu": "silu", "swish": "silu"}


def check(act: str, allowed: tuple[str, ...] = IDS) -> str:
    """`act` if it is one of `allowed`, else ValueError naming them."""
    if act not in allowed:
        raise ValueError(f"unknown activation {act!r} (expected one of {', '.join(allowed)})")
    return act


def apply(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(x), a new tensor."""
    return _FUNCTIONS[check(act)][0](x)


def apply_(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(x) in place; returns x."""
    return _FUNCTIONS[check(act)][1](x)


def glu(h: torch.Tensor, act: str) -> torch.Tensor:
    """The gated half of a GLU FFN: h (M, 2N) with halves [a | b] -> act(a) * b, (M, N), a new tensor."""
    a, b = h.chunk(2, dim=-1)
    return apply(a, check(act, GATED_IDS)) * b
