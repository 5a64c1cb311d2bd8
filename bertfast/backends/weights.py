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
    position: torch.Tensor | None  # [P, E]; None for rotary models (ModernBERT, NomicBERT, GTE)
    token_type: torch.Tensor | None  # [TT, E]; None for DistilBERT
    ln_weight: torch.Tensor  # [E]
    ln_bias: torch.Tensor  # [E] (zeros where the checkpoint's norm has no bias)
    projection_weight: torch.Tensor | None = None  # [H, E] when embedding_size != hidden (ELECTRA, ALBERT)
    projection_bias: torch.Tensor | None = None  # [H]
    relative_bias: torch.Tensor | None = None  # [buckets, heads]: MPNet's relative position bias, for every layer
    # [2 span, H]: DeBERTa-v2's relative embeddings as its position projections read them (LayerNorm'd when
    # norm_rel_ebd), kept for LoRA adapters of those projections (`adapters_rows.pack_adapter`)
    relative_inputs: torch.Tensor | None = None


@dataclass
class LayerWeights:
    """One layer. Linear biases are None where the checkpoint has none (ModernBERT, NomicBERT); LayerNorm biases
    are always tensors (zeros where it has none). Post-LN (BERT): attn_ln follows attention, ffn_ln the FFN.
    Pre-LN (config.norm_first, ModernBERT): attn_ln precedes attention (None for an identity, ModernBERT's first
    layer) and ffn_ln the FFN. A gated FFN's ffn_in holds both halves, rows gate | up."""

    qkv_weight: torch.Tensor  # [3H, H], rows q | k | v
    qkv_bias: torch.Tensor | None  # [3H]
    attn_out_weight: torch.Tensor  # [H, H]
    attn_out_bias: torch.Tensor | None  # [H]
    attn_ln_weight: torch.Tensor | None  # [H]
    attn_ln_bias: torch.Tensor | None  # [H]
    ffn_in_weight: torch.Tensor  # [I, H], gated: [2I, H]
    ffn_in_bias: torch.Tensor | None  # [I], gated: [2I]
    ffn_out_weight: torch.Tensor  # [H, I]
    ffn_out_bias: torch.Tensor | None  # [H]
    ffn_ln_weight: torch.Tensor  # [H]
    ffn_ln_bias: torch.Tensor  # [H]
    # DeBERTa-v2: the layer's key / query projections of its relative embeddings (`disentangled`), or None
    pos_key: torch.Tensor | None = None  # [2 span, H]: the c2p term's
    pos_query: torch.Tensor | None = None  # [2 span, H]: the p2c term's


@dataclass
class ModelWeights:
    config: ModelConfig
    embeddings: EmbeddingWeights
    layers: list[LayerWeights]
    pooler_weight: torch.Tensor | None = None  # [H, H]
    pooler_bias: torch.Tensor | None = None  # [H]
    final_ln_weight: torch.Tensor | None = None  # [H]: the norm after the last layer of pre-LN models
    final_ln_bias: torch.Tensor | None = None  # [H]
    extra: dict = field(default_factory=dict)  # backend-packed forms (e.g. prepacked GEMM weights)

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.word.dtype

    @property
    def device(self) -> torch.device:
        return self.embeddings.word.device

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor],
            stream: Callable[[torch.Tensor], torch.Tensor] | None = None) -> "ModelWeights":
        """A new ModelWeights with `fn` applied to every tensor (shared layers stay shared), or `stream`, where given,
        to the residual stream's tensors (`STREAM_TENSORS`)."""

        def pick(kind, name):
            return stream if stream is not None and name in STREAM_TENSORS[kind] else fn

        def conv(obj):
            return type(obj)(**{name: pick(type(obj), name)(value) if isinstance(value, torch.Tensor) else value
                                for name, value in vars(obj).items()})

        seen: dict[int, LayerWeights] = {}
        layers = []
        for layer in self.layers:
            if id(layer) not in seen:
                seen[id(layer)] = conv(layer)
            layers.append(seen[id(layer)])
        def opt(t, name):
            return None if t is None else pick(ModelWeights, name)(t)

        return ModelWeights(
            config=self.config,
            embeddings=conv(self.embeddings),
            layers=layers,
            pooler_weight=opt(self.pooler_weight, "pooler_weight"),
            pooler_bias=opt(self.pooler_bias, "pooler_bias"),
            final_ln_weight=opt(self.final_ln_weight, "final_ln_weight"),
            final_ln_bias=opt(self.final_ln_bias, "final_ln_bias"),
        )

    def to(self, dtype: torch.dtype | None = None, device=None,
           stream_dtype: torch.dtype | None = None) -> "ModelWeights":
        """The weights in `dtype` on `device`; with stream_dtype, the residual stream's tensors (`STREAM_TENSORS`) in
        that dtype instead (a backend's `Backend.stream_dtype`), converted from the tensors as they are: from an fp32
        checkpoint, fp32 ones under bf16 GEMMs lose nothing to bf16."""
        def cast(dt):
            return lambda t: t.to(device=device, dtype=dt).contiguous()

        return self.map(cast(dtype), stream=None if stream_dtype is None else cast(stream_dtype))


# What only adds into or scales the residual stream, never a GEMM's operand: the position and token type tables
# (the word table is looked up the same way, but large: it stays in the weights' dtype) and every LayerNorm. A
# backend keeping the stream more precise than its GEMMs (`Backend.stream_dtype`) keeps these at the stream's
# precision: under bf16, the position and token type rows rounded to bf16 (the same rows in every sequence) were the
# largest error left outside the GEMMs' operands (docs/cpu-gemm.md#bf16-accuracy).
STREAM_TENSORS = {
    EmbeddingWeights: ("position", "token_type", "ln_weight", "ln_bias"),
    LayerWeights: ("attn_ln_weight", "attn_ln_bias", "ffn_ln_weight", "ffn_ln_bias"),
    ModelWeights: ("final_ln_weight", "final_ln_bias"),
}
