"""Packed `Tokens` built by hand, for tests of what runs on them (buckets, static buffers) without a model."""

from __future__ import annotations

import torch

from bertfast.backends import Tokens


def tokens_of(lengths, width=None, bias=False):
    """Packed Tokens of sequences with `lengths` (ids 1.., positions 0..n-1 per sequence)."""
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    columns = positions.to(torch.int32) if bias else None
    return Tokens(torch.arange(1, T + 1), positions, torch.zeros(T, dtype=torch.int64), columns, cu,
                  max(lengths), width or max(lengths))
