"""The oracle's formulas for activations and positions (`bertfast.reference`), written from transformers' own: its
activations, MPNet's relative buckets, DeBERTa-v2's log buckets and RoPE. Imports nothing of bertfast
(tests/test_reference_independent.py checks it as it checks the oracle)."""

from __future__ import annotations

import math

import torch


def _gelu(x):  # transformers' GELUActivation (gelu_python spells it out; F.gelu is the same function)
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x):  # transformers' NewGELUActivation (gelu_pytorch_tanh is the same function in C)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS = {"none": lambda x: x, "gelu": _gelu, "gelu_tanh": _gelu_tanh, "relu": torch.relu, "tanh": torch.tanh,
               "silu": lambda x: x * torch.sigmoid(x)}
# transformers' ACT2FN names -> the ids above (the ids are the ops' `act`; `forward` reads config.hidden_act)
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_python_tanh": "gelu_tanh", "relu": "relu", "tanh": "tanh", "silu": "silu", "swish": "silu",
                  "linear": "none"}


def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """kind(x) in float64, rounded once to x's dtype: one of ACTIVATIONS ('gelu' erf, 'gelu_tanh', 'relu', 'tanh',
    'silu', 'none')."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"unknown activation {kind!r} (expected one of {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[kind](x.double()).to(x.dtype)


def relative_bucket(relative_position: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """MPNet's T5-style bidirectional bucket of each key-minus-query distance (transformers'
    MPNetEncoder.relative_position_bucket): int64 (any shape) -> int64 in [0, num_buckets). Half the buckets per
    sign, the nearest quarter exact, the rest log-spaced up to max_distance. The log runs in float32 as
    transformers' does, whatever the model's dtype: its rounding decides the buckets at their edges."""
    half = num_buckets // 2
    exact = half // 2
    n = -relative_position
    magnitude = n.abs()
    spaced = torch.log(magnitude.to(torch.float32) / exact) / math.log(max_distance / exact) * (half - exact)
    far = (exact + spaced.to(torch.int64)).clamp(max=half - 1)
    return (n < 0).to(torch.int64) * half + torch.where(magnitude < exact, magnitude, far)


def log_bucket(relative: torch.Tensor, buckets: int, max_position: int) -> torch.Tensor:
    """DeBERTa-v2's make_log_bucket_position: distances up to buckets / 2 kept, farther ones log-spaced (ceil) so
    that max_position - 1 lands on bucket buckets - 1, sign kept. relative: int64 -> int64. float32 as in
    transformers: in float64, 256 buckets over 512 positions would move |r| = 65317 one bucket."""
    mid = buckets // 2
    magnitude = relative.abs()
    kept = magnitude <= mid
    ratio = torch.where(kept, mid, magnitude).to(torch.float32) / mid  # the kept ones' log stays finite (unused)
    span = torch.log(torch.tensor((max_position - 1) / mid, dtype=torch.float32, device=relative.device))
    far = (torch.ceil(torch.log(ratio) / span * (mid - 1)) + mid).to(torch.int64)
    return torch.where(kept, relative, far * torch.sign(relative))


def deberta_span(config) -> int:
    """transformers' pos_ebd_size: position_buckets when > 0, else max_relative_positions."""
    return config.position_buckets if config.position_buckets > 0 else config.max_relative_positions


def rotary_tables(positions: torch.Tensor, theta: float, head_dim: int):
    """RoPE's (cos, sin), (..., head_dim / 2) float32 each, for positions (...) int: the angle of frequency i is
    position * theta^(-2i / head_dim) (transformers' default RoPE, ModernBertRotaryEmbedding), in float32 as
    transformers computes it for every model dtype (float64 angles would differ by up to ~1e-7 * position)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device).to(torch.float32) / head_dim
    angles = positions[..., None].to(torch.float32) * (1.0 / (theta ** exponents))
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: halves [a | b] -> [-b | a]."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb in fp32, rounded once to x's dtype: x * cos + rotate_half(x) * sin, the
    half-width cos/sin repeated over both halves (broadcast against x)."""
    xf = x.float()
    return (xf * torch.cat((cos, cos), -1) + rotate_half(xf) * torch.cat((sin, sin), -1)).to(x.dtype)
