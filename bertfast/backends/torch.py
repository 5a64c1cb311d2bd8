"""The "torch" backend: the reference ops themselves. Always available, any device, any float dtype."""

from __future__ import annotations

from .. import reference
from .base import Backend


class TorchBackend(Backend):
    name = "torch"

    @classmethod
    def unavailable_reason(cls, device):
        return None

    embed = staticmethod(reference.embed)
    qkv = staticmethod(reference.qkv)
    attention = staticmethod(reference.attention)
    linear_residual = staticmethod(reference.linear_residual)
    layernorm = staticmethod(reference.layernorm)
    linear_gelu = staticmethod(reference.linear_gelu)
    pooler = staticmethod(reference.pooler)
