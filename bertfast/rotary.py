"""Rotary position embeddings (RoPE) of ModernBERT, NomicBERT and GTE: the cos/sin tables of one forward.

transformers computes, per position p and frequency i < d/2, the angle p * inv_freq[i] in fp32 with
inv_freq[i] = 1 / theta^(2i/d), and rotates q and k by it (the half-split `rotate_half` convention). Here the
tables are computed the same way, once per forward and per base theta, for the packed tokens' own position ids;
the backends apply them (`backends.Rotary`).
"""

from __future__ import annotations

import torch

from .backends.contract import Rotary


def inverse_frequencies(theta: float, head_dim: int, device=None) -> torch.Tensor:
    """(head_dim / 2,) float32: 1 / theta^(2i / head_dim), op for op as transformers' default RoPE."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))


def tables(positions: torch.Tensor, theta: float, head_dim: int) -> Rotary:
    """cos/sin (T, head_dim / 2) float32 for positions (T,) int64."""
    angles = positions.float()[:, None] * inverse_frequencies(theta, head_dim, positions.device)[None, :]
    return Rotary(angles.cos(), angles.sin())
