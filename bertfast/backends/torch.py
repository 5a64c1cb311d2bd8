"""The "torch" backend: the reference ops themselves. Always available, any device, any float dtype."""

from __future__ import annotations

import torch.nn.functional as F

from .. import reference
from ..kernels import activation
from .contract import Backend


class TorchBackend(Backend):
    name = "torch"

    @classmethod
    def unavailable_reason(cls, device):
        return None

    embeddings = staticmethod(reference.embeddings)
    qkv = staticmethod(reference.qkv)
    attention = staticmethod(reference.attention)
    layernorm = staticmethod(reference.layernorm)
    disentangled = staticmethod(reference.disentangled)

    @staticmethod
    def linear(x, weight, bias, act="none", residual=None, gated=False):
        if gated:
            if residual is not None:
                raise ValueError("a gated linear takes no residual")
            return reference.linear_glu(x, weight, bias, act)
        out = activation.apply(F.linear(x, weight, bias), act)
        return out if residual is None else out + residual
