"""The engine: one forward pass over the real tokens only, the same for every backend.

unpad -> embed (-> projection) -> layers -> pad -> pooler (MPNet: its relative position bias computed once, after
unpad, for every layer's attention). A layer is `compose_layer` over the backend's
ops (qkv -> varlen attention -> linear + residual -> layernorm -> linear + activation -> linear +
residual -> layernorm, post-LayerNorm as in BERT), unless the backend runs it whole
(`Backend.whole_layer`: the same kernels in the same order). Inputs are assumed validated
(`encoder.check_inputs`); padded positions of the outputs hold 0.
"""

from __future__ import annotations

import math

import torch

from . import relative
from .backends import AttentionBias, Backend
from .backends.weights import LayerWeights, ModelWeights
from .config import ConfigError
from .padding import pad, unpad


def default_position_ids(config, input_ids: torch.Tensor) -> torch.Tensor:
    """Position ids transformers uses when none are given. input_ids: (B, S) -> (B, S) int64.

    Columns 0..S-1, except RoBERTa/XLM-R/MPNet: real tokens (ids != pad) count up from pad + 1 and pad
    tokens get pad (fairseq's make_positions), pad = `config.position_padding_idx`.
    """
    B, S = input_ids.shape
    if config.positions_from_input_ids:
        pad = config.position_padding_idx
        real = input_ids.ne(pad).long()
        return torch.cumsum(real, dim=1) * real + pad
    return torch.arange(S, device=input_ids.device).expand(B, S)


def compose_layer(ops: Backend, x, layer: LayerWeights, cu_seqlens, max_seqlen: int, heads: int,
                  scale: float, eps: float, act: str, bias: AttentionBias | None = None) -> torch.Tensor:
    """One post-LayerNorm encoder layer on x (T, H) from the backend's ops; cu_seqlens (B+1,) int32; bias: the
    relative position bias (MPNet) or None."""
    q, k, v = ops.qkv(x, layer.qkv_weight, layer.qkv_bias, heads)
    ctx = ops.attention(q, k, v, cu_seqlens, max_seqlen, scale, bias)
    x = ops.layernorm(ops.linear(ctx, layer.attn_out_weight, layer.attn_out_bias, "none", x),
                      layer.attn_ln_weight, layer.attn_ln_bias, eps)
    h = ops.linear(x, layer.ffn_in_weight, layer.ffn_in_bias, act)
    return ops.layernorm(ops.linear(h, layer.ffn_out_weight, layer.ffn_out_bias, "none", x),
                         layer.ffn_ln_weight, layer.ffn_ln_bias, eps)


def run_layer(ops: Backend, x, layer: LayerWeights, cu_seqlens, max_seqlen: int, heads: int, scale: float,
              eps: float, act: str, bias: AttentionBias | None = None) -> torch.Tensor:
    """The layer whole where the backend offers it for these tokens, else `compose_layer`."""
    whole = ops.whole_layer(x, layer)
    if whole is not None:
        return whole(x, cu_seqlens, int(max_seqlen), float(scale), bias)
    return compose_layer(ops, x, layer, cu_seqlens, max_seqlen, heads, scale, eps, act, bias)


class Engine:
    def __init__(self, weights: ModelWeights, backend: Backend):
        self.config = weights.config
        if self.config.family in backend.unsupported_families:
            raise ConfigError(f"backend {backend.name!r} does not run {self.config.family} models yet: "
                              f"{backend.unsupported_families[self.config.family]}")
        self.backend = backend
        self.weights = backend.prepare(weights)

    @torch.inference_mode()
    def forward(self, input_ids, attention_mask, token_type_ids=None, position_ids=None,
                output_hidden_states: bool = False):
        """input_ids, attention_mask, token_type_ids, position_ids: (B, S) int64 (mask 0/1).

        Returns (last_hidden_state (B, S, H), pooler_output (B, H) or None, hidden_states or None);
        padded positions hold 0.
        """
        cfg, ops, w = self.config, self.backend, self.weights
        B, S = input_ids.shape
        ids, indices, cu_seqlens, max_seqlen = unpad(input_ids, attention_mask)
        if position_ids is None:
            position_ids = default_position_ids(cfg, input_ids)
        positions = position_ids.reshape(-1)[indices]
        types = None
        if w.embeddings.token_type is not None:
            types = (torch.zeros_like(ids) if token_type_ids is None
                     else token_type_ids.reshape(-1)[indices])

        x = ops.embed(ids, positions, types, w.embeddings, cfg.layer_norm_eps)
        if w.embeddings.projection_weight is not None:  # factorised embeddings (ELECTRA, ALBERT)
            x = ops.linear(x, w.embeddings.projection_weight, w.embeddings.projection_bias)
        hidden = [x] if output_hidden_states else None
        heads, eps, act = cfg.num_attention_heads, cfg.layer_norm_eps, cfg.activation
        scale = 1.0 / math.sqrt(cfg.head_dim)
        bias = None
        if w.embeddings.relative_bias is not None:  # MPNet: once per forward, shared by every layer
            bias = relative.attention_bias(w.embeddings.relative_bias, indices, S)
        for layer in w.layers:
            x = run_layer(ops, x, layer, cu_seqlens, max_seqlen, heads, scale, eps, act, bias)
            if hidden is not None:
                hidden.append(x)

        last = pad(x, indices, B, S)
        pooled = None
        if w.pooler_weight is not None:  # tanh(W h[CLS] + b)
            pooled = ops.linear(last[:, 0].contiguous(), w.pooler_weight, w.pooler_bias, "tanh")
        states = tuple(pad(h, indices, B, S) for h in hidden) if hidden is not None else None
        return last, pooled, states
