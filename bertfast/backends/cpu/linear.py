"""fp32 and bf16 linear layers on the CPU: the weight packed once for the extension's GEMM (`PackedLinear`), and
`linear`, which runs that GEMM with bias, activation and residual fused in its epilogue, at every token count.

One kernel per tier and dtype for every row count is what makes the engine batch-invariant: a row's arithmetic
(the blocking of K, the epilogue's order) never depends on how many rows share the call. Libraries (oneDNN, MKL)
are not called, since their blocking changes with M (docs/cpu-gemm.md#batch-invariance)."""

from __future__ import annotations

import torch

from ...kernels import activation
from .ext import _C


class PackedLinear:
    """One linear layer as the cpu backend runs it: weight (N, K) as loaded; packed: the extension's panel layout
    for its GEMM (`_C.pack_linear`)."""

    __slots__ = ("weight", "packed", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise ValueError(f"a linear weight must be (out_features, in_features), got {tuple(weight.shape)}")
        self.weight = weight.contiguous()
        self.packed = _C.pack_linear(self.weight)
        self.out_features, self.in_features = self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def shape(self):
        return self.weight.shape


def packed(weight) -> PackedLinear:
    """A PackedLinear as is; a plain (N, K) weight packed on the fly (so op-level tests need no `prepare`)."""
    return weight if isinstance(weight, PackedLinear) else PackedLinear(weight)


def linear(x, weight, bias, act: str = "none", residual=None, addend=None, float_out: bool = False):
    """act(x @ weight.T + bias + addend) + residual on the extension's GEMM. x: (M, K) fp32/bf16; weight: PackedLinear
    or (N, K) of x's dtype; bias: (N,) or None; residual: (M, N) or None; addend: a `_C.LoraTerm` (`lora.term`) or
    None, added in fp32 before the activation. bf16 weights also take fp32 x (rounded to bf16 once, as
    x.to(torch.bfloat16) would) and an fp32 residual, which makes the output fp32: the residual stream of a bf16
    forward (`CpuBackend.stream_dtype`); float_out makes it fp32 without one (a head on the stream)."""
    w = packed(weight)
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be (M, {w.in_features}), got {tuple(x.shape)}")
    if x.dtype != w.dtype and not (w.dtype == torch.bfloat16 and x.dtype == torch.float32):
        raise ValueError(f"x has dtype {x.dtype} but the weight has {w.dtype}")
    activation.check(act)
    return _C.linear(x, w.packed, w.out_features, bias, act, residual, lora=addend, float_out=float_out)
