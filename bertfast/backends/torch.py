"""The "torch" backend: the reference ops themselves. Always available, any device, any float dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import reference
from ..kernels import activation
from .contract import Backend, Precision, cuda_precision
from .cpu import isa


class TorchBackend(Backend):
    name = "torch"

    @classmethod
    def unavailable_reason(cls, device):
        return None

    def precision(self, device):
        """CUDA: `cuda_precision`. Elsewhere bf16 where the active ISA tier has native bf16 dot products
        (`isa.native_bf16`: amx, amx_emulated, or avx512_vnni with AVX-512 BF16), else fp32 with bf16 marked slower:
        torch's bf16 GEMM there is ATen's scalar bf16 dot (docs/cpu-gemm.md#bf16-without-native-dot-products)."""
        if device == "cuda":
            return cuda_precision()
        if isa.native_bf16():
            return Precision(torch.bfloat16)
        return Precision(torch.float32, slower=(torch.bfloat16,))

    embeddings = staticmethod(reference.embeddings)
    attention = staticmethod(reference.attention)
    layernorm = staticmethod(reference.layernorm)

    @staticmethod
    def disentangled(q, k, pos_key, pos_query, scale, windows):
        return reference.disentangled(q, k, pos_key, pos_query, scale)  # every entry: windows only allow fewer

    @staticmethod
    def qkv(x, weight, bias, num_heads, rotary=None, addend=None):
        if addend is None:
            return reference.qkv(x, weight, bias, num_heads, rotary)
        out = _added(F.linear(x, weight, bias), addend).view(x.shape[0], 3, num_heads, -1)
        q, k, v = out[:, 0], out[:, 1], out[:, 2]
        if rotary is not None:
            q, k = reference.rotate(q, rotary), reference.rotate(k, rotary)
        return q, k, v

    @staticmethod
    def linear(x, weight, bias, act="none", residual=None, gated=False, addend=None):
        if gated:
            if residual is not None:
                raise ValueError("a gated linear takes no residual")
            if addend is None:
                return reference.linear_glu(x, weight, bias, act)
            return reference.glu(_added(F.linear(x, weight, bias), addend), act)
        out = activation.apply(_added(F.linear(x, weight, bias), addend), act)
        return out if residual is None else out + residual


def _added(y: torch.Tensor, addend: torch.Tensor | None) -> torch.Tensor:
    """y + addend (fp32, a LoRA delta) summed in fp32, in y's dtype."""
    return y if addend is None else (y.float() + addend).to(y.dtype)
