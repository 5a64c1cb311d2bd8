"""MPNet's relative position bias: T5-style bidirectional buckets, a per-head value per bucket, added to every
layer's attention scores.

transformers computes it once per forward from the columns of the padded batch (`MPNetEncoder.compute_position_bias`
with no position ids: the relative position of key column j to query column i is j - i, whatever the position ids).
Here it is computed once per forward too, compactly: `bias_table` holds one value per head and distance (linear in
length, never a (T, T) matrix), and each token keeps its column, so any 0/1 mask gives transformers' bias.
"""

from __future__ import annotations

import math

import torch

from .backends.contract import AttentionBias
from .config import RELATIVE_BUCKETS, RELATIVE_MAX_DISTANCE


def relative_position_bucket(relative_position: torch.Tensor) -> torch.Tensor:
    """transformers' MPNetEncoder.relative_position_bucket (32 buckets, max distance 128), op for op so the
    float rounding of the log matches. relative_position: key minus query position, int64 -> int64 buckets."""
    n = -relative_position
    half = RELATIVE_BUCKETS // 2
    ret = (n < 0).to(torch.long) * half
    n = torch.abs(n)
    max_exact = half // 2
    val_if_large = max_exact + (torch.log(n.float() / max_exact) / math.log(RELATIVE_MAX_DISTANCE / max_exact)
                                * (half - max_exact)).to(torch.long)
    val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, half - 1))
    return ret + torch.where(n < max_exact, n, val_if_large)


def bias_table(relative_bias: torch.Tensor, span: int) -> torch.Tensor:
    """Per-distance bias: relative_bias (buckets, heads) -> (heads, 2 * span - 1), column span - 1 + r holding the
    bias of relative position r in [-(span - 1), span - 1]; float32 (float64 for float64 weights)."""
    distances = torch.arange(-(span - 1), span, device=relative_bias.device)
    dtype = torch.promote_types(relative_bias.dtype, torch.float32)
    return relative_bias[relative_position_bucket(distances)].t().to(dtype).contiguous()


def attention_bias(relative_bias: torch.Tensor, columns: torch.Tensor, width: int) -> AttentionBias:
    """The bias of one forward on the packed layout: the table for a padded width `width` and each real token's
    column. columns: (T,) int32, each token's column in the (B, width) batch (`Tokens.columns`); a larger width
    gives the same bias (the table holds one value per distance), which CUDA-graph buckets rely on."""
    return AttentionBias(bias_table(relative_bias, width), columns)


def dense_bias(bias: AttentionBias, query_positions: torch.Tensor, key_positions: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """The bias as a dense (..., heads, Sq, Sk) tensor in `dtype` (the oracle's form, not the engine's).

    query_positions (..., Sq), key_positions (..., Sk) int; distances outside the table (padding) are clamped."""
    width = bias.table.shape[1]
    r = key_positions[..., None, :].long() - query_positions[..., :, None].long() + (width - 1) // 2
    values = bias.table[:, r.clamp(0, width - 1)]  # (heads, ..., Sq, Sk)
    return values.movedim(0, -3).to(dtype)
