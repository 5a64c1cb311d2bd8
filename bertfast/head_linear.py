"""A linear head on an encoder's last states, fp32 in and fp32 out: BGE-M3's sparse and ColBERT heads, ColBERT's
Dense projections. Its GEMM runs in bf16 where the engine's do on the cpu backend (bf16 weights take the fp32 stream,
on the AMX tiles where the tier has them, and give fp32), in fp32 otherwise: an int8 engine's heads stay fp32, as its
pooler does, and the other backends' run on their own terms.
"""

from __future__ import annotations

import torch


class HeadLinear:
    """weight (N, K) and bias (N,) or None, packed for `encoder`'s backend; call it as `backend.linear`."""

    def __init__(self, encoder, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.backend = encoder.engine.backend
        self.bf16 = encoder.backend == "cpu" and encoder.dtype == torch.bfloat16
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.weight = self.backend.pack(weight.detach().to(encoder.device, dtype).contiguous())
        self.bias = None if bias is None else bias.detach().to(encoder.device, dtype).contiguous()
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor, act: str = "none", residual: torch.Tensor | None = None) -> torch.Tensor:
        """act(x @ weight.T + bias) + residual, fp32 (M, N) from fp32 x (M, K)."""
        wide = {"float_out": True} if self.bf16 else {}
        return self.backend.linear(x, self.weight, self.bias, act, residual, **wide)
