"""The weights a backend receives: plain tensors in named slots, Q, K and V already fused.

`loading` fills these once from a checkpoint; a backend's `prepare` may replace a weight tensor by its
own packed form (the ops then receive that form). Layers shared across depth (ALBERT) are one object
listed several times, and stay shared through `map`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from ..config import ModelConfig


@dataclass
class EmbeddingWeights:
    word: torch.Tensor  # [V, E], E = embedding_size (= hidden_size outside ELECTRA/ALBERT)
    position: torch.Tensor  # [P, E]
    token_type: torch.Tensor | None  # [TT, E]; None for DistilBERT
    ln_weight: torch.Tensor  # [E]
    ln_bias: torch.Tensor  # [E]
    projection_weight: torch.Tensor | None = None  # [H, E] when embedding_size != hidden (ELECTRA, ALBERT)
    projection_bias: torch.Tensor | None = None  # [H]
    relative_bias: torch.Tensor | None = None  # [buckets, heads]: MPNet's relative position bias, for every layer


@dataclass
class LayerWeights:
    qkv_weight: torch.Tensor  # [3H, H], rows q | k | v
    qkv_bias: torch.Tensor  # [3H]
    attn_out_weight: torch.Tensor  # [H, H]
    attn_out_bias: torch.Tensor  # [H]
    attn_ln_weight: torch.Tensor  # [H]
    attn_ln_bias: torch.Tensor  # [H]
    ffn_in_weight: torch.Tensor  # [I, H]
    ffn_in_bias: torch.Tensor  # [I]
    ffn_out_weight: torch.Tensor  # [H, I]
    ffn_out_bias: torch.Tensor  # [H]
    ffn_ln_weight: torch.Tensor  # [H]
    ffn_ln_bias: torch.Tensor  # [H]


@dataclass
class ModelWeights:
    config: ModelConfig
    embeddings: EmbeddingWeights
    layers: list[LayerWeights]
    pooler_weight: torch.Tensor | None = None  # [H, H]
    pooler_bias: torch.Tensor | None = None  # [H]
    extra: dict = field(default_factory=dict)  # backend-packed forms (e.g. prepacked GEMM weights)

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.word.dtype

    @property
    def device(self) -> torch.device:
        return self.embeddings.word.device

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "ModelWeights":
        """A new ModelWeights with `fn` applied to every tensor (shared layers stay shared)."""

        def conv(obj):
            return type(obj)(**{name: fn(value) if isinstance(value, torch.Tensor) else value
                                for name, value in vars(obj).items()})

        seen: dict[int, LayerWeights] = {}
        layers = []
        for layer in self.layers:
            if id(layer) not in seen:
                seen[id(layer)] = conv(layer)
            layers.append(seen[id(layer)])
        return ModelWeights(
            config=self.config,
            embeddings=conv(self.embeddings),
            layers=layers,
            pooler_weight=None if self.pooler_weight is None else fn(self.pooler_weight),
            pooler_bias=None if self.pooler_bias is None else fn(self.pooler_bias),
        )

    def to(self, dtype: torch.dtype | None = None, device=None) -> "ModelWeights":
        return self.map(lambda t: t.to(device=device, dtype=dtype).contiguous())
