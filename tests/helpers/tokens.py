"""Packed `Tokens` built by hand, for tests of what runs on them (buckets, static buffers) without a model, and the
attention masks of padded batches laid out as the relative-position families' tests need them."""

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


def layout_mask(lengths, layout: str = "right") -> torch.Tensor:
    """(B, S) 0/1 mask of rows with real `lengths`: "right" or "left" padding, or "holes" (3 more columns, a few
    masked inside every row, the first row whole), which relative positions must count as transformers does."""
    S = max(lengths) + (3 if layout == "holes" else 0)
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    if layout == "left":
        mask = mask.flip(1)
    elif layout == "holes":
        mask[:, 2:5] = 0
        mask[0, :] = 1
    return mask
