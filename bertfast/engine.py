"""The layer pipeline, written once for every backend.

embed (-> projection) -> per layer: qkv -> attention (varlen) -> linear_residual -> layernorm -> linear_gelu ->
linear_residual -> layernorm -> pooler. The pipeline runs on the packed real tokens only
(`padding.unpad` at the start, `padding.pad` at the end); the backend supplies the ops. A layer is the
backend's `layer` op: by default `reference.layer` over the backend's own ops (the cpu backend runs
it whole in C++ where it can, the same kernels in the same order).
Inputs are assumed validated (see `encoder.check_inputs`).
"""

from __future__ import annotations

import math

import torch

from .backends import Backend
from .loading import ModelWeights
from .padding import pad, unpad
from .reference import default_position_ids


class Engine:
    def __init__(self, weights: ModelWeights, backend: Backend):
        self.config = weights.config
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
        for layer in w.layers:
            x = ops.layer(x, layer, cu_seqlens, max_seqlen, heads, scale, eps, act)
            if hidden is not None:
                hidden.append(x)

        last = pad(x, indices, B, S)
        pooled = None
        if w.pooler_weight is not None:
            pooled = ops.pooler(last[:, 0].contiguous(), w.pooler_weight, w.pooler_bias)
        states = tuple(pad(h, indices, B, S) for h in hidden) if hidden is not None else None
        return last, pooled, states
