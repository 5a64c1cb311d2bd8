"""The op interface every backend implements; the engine pipeline calls nothing else.

All ops work on the packed token layout: activations are (T, features) with T the real tokens of
all sequences, sequences delimited by `cu_seqlens` (B+1,) int32. `prepare` runs once at load and
may replace weight tensors by backend-specific packed forms; the ops then receive those forms.
"""

from __future__ import annotations

import torch

from .. import reference
from ..loading import ModelWeights


class BackendUnavailable(RuntimeError):
    """A backend's module cannot be imported here (missing dependency or extension)."""


class Backend:
    name = "base"
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    quantizations: tuple[str, ...] = ()  # weight quantization schemes `prepare` can apply, e.g. "int8"

    def __init__(self, quantize: str | None = None):
        if quantize is not None and quantize not in self.quantizations:
            offered = ", ".join(self.quantizations) or "none"
            raise ValueError(f"backend {self.name!r} does not support {quantize!r} quantization "
                             f"(it offers: {offered})")
        self.quantize = quantize

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        """None if the backend runs on this device type, else why not."""
        raise NotImplementedError

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            raise ValueError(f"backend {self.name!r} does not support dtype {dtype}; it supports {names}")

    def prepare(self, weights: ModelWeights) -> ModelWeights:
        """Pack weights once for this backend (layouts, prepacked GEMM operands). Default: as is."""
        self.check_dtype(weights.dtype)
        return weights

    # --- ops (shapes in bertfast.reference) ---
    def embed(self, input_ids, position_ids, token_type_ids, emb, eps):
        raise NotImplementedError

    def qkv(self, x, weight, bias, num_heads):
        raise NotImplementedError

    def attention(self, q, k, v, cu_seqlens, max_seqlen, scale):
        raise NotImplementedError

    def linear_residual(self, x, weight, bias, residual):
        raise NotImplementedError

    def layernorm(self, x, weight, bias, eps):
        raise NotImplementedError

    def linear_gelu(self, x, weight, bias, act):
        raise NotImplementedError

    def pooler(self, cls_hidden, weight, bias):
        raise NotImplementedError

    def layer(self, x, layer, cu_seqlens, max_seqlen, heads, scale, eps, act):
        """One encoder layer (post-LayerNorm) on x (T, H). Default: the ops above, composed as
        `reference.layer` composes its own; a backend may run it whole (the cpu backend does)."""
        return reference.layer(x, layer, cu_seqlens, max_seqlen, heads, scale, eps, act, ops=self)

    # Used once per forward (embedding projection of ELECTRA/ALBERT); backends may override.
    linear = staticmethod(reference.linear)
