"""fp32 and bf16 linear layers on the CPU: the weight packed once in every form a GEMM may need
(`PackedLinear`), and `linear`, which runs the kernel `routing.gemm_kernel` names with bias, activation
and residual applied (fused in the extension's epilogue; oneDNN fuses the residual add)."""

from __future__ import annotations

import torch

from ...kernels import activation
from . import isa, routing
from .ext import _C


class PackedLinear:
    """One linear layer in the forms the cpu backend runs it.

    weight: (N, K) as loaded; weight_t: its (K, N) transpose view for torch's fp32 GEMM (MKL, large M);
    onednn: bf16 with native dot products only, the weight reordered once into oneDNN's blocked layout,
    or None; packed: the extension's panel layout for its GEMM (`_C.pack_linear`).
    """

    __slots__ = ("weight", "weight_t", "onednn", "packed", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise ValueError(f"a linear weight must be (out_features, in_features), got {tuple(weight.shape)}")
        self.weight = weight.contiguous()
        self.weight_t = self.weight.t()
        self.onednn = _onednn_weight(self.weight) if isa.native_bf16() else None
        self.packed = _C.pack_linear(self.weight)
        self.out_features, self.in_features = self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def shape(self):
        return self.weight.shape


# oneDNN's prepacked linear (what inductor's freezing uses) reorders the weight once instead of per call
# and fuses the residual add: docs/cpu-gemm.md#onednn-bf16.
_ONEDNN_BATCH_HINT = 1024  # the M the blocked layout is tuned for; any M runs correctly


def _onednn_weight(weight: torch.Tensor):
    if weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT)
    except (RuntimeError, AttributeError):  # a torch build without the op: the widened fp32 GEMM is used
        return None


def _onednn_linear(x, weight, out_features, bias, residual):
    """x @ W.T + bias (+ residual) on a oneDNN-prepacked bf16 weight, in row blocks where faster."""
    def block(lo, hi):
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x[lo:hi], weight, bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x[lo:hi], residual[lo:hi], weight, bias, "add")

    M = x.shape[0]
    step = routing.onednn_row_block(M, out_features, x.shape[1])
    if step >= M:
        return block(0, M)
    return torch.cat([block(lo, min(M, lo + step)) for lo in range(0, M, step)])


def packed(weight) -> PackedLinear:
    """A PackedLinear as is; a plain (N, K) weight packed on the fly (so op-level tests need no `prepare`)."""
    return weight if isinstance(weight, PackedLinear) else PackedLinear(weight)


def linear(x, weight, bias, act: str = "none", residual=None):
    """act(x @ weight.T + bias) + residual. x: (M, K) fp32/bf16; weight: PackedLinear or (N, K) of x's dtype;
    bias: (N,) or None; residual: (M, N) or None (not with an activation past the extension's rows).
    The kernel is `routing.gemm_kernel`'s choice on the active tier."""
    w = packed(weight)
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be (M, {w.in_features}), got {tuple(x.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"x has dtype {x.dtype} but the weight has {w.dtype}")
    activation.check(act)
    kernel = routing.gemm_kernel(x.dtype, x.shape[0], _C.isa(), isa.native_bf16())
    if kernel == routing.EXT:
        return _C.linear(x, w.packed, w.out_features, bias, act, residual)
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and act != "none":
        raise ValueError("an activation and a residual together are not supported")
    if kernel == routing.ONEDNN and w.onednn is not None:
        return activation.apply_(_onednn_linear(x, w.onednn, w.out_features, bias, residual), act)
    # fp32 GEMM (MKL); bf16 without native bf16 dot products on widened operands
    wide = x.dtype != torch.float32
    xf, wf = (x.float(), w.weight_t.float()) if wide else (x, w.weight_t)
    out = torch.addmm(bias.to(xf.dtype), xf, wf) if bias is not None else torch.mm(xf, wf)
    if residual is not None:
        out += residual
    out = activation.apply_(out, act)
    return out.to(x.dtype) if wide else out
