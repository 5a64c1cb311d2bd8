"""The unpad/pad boundary between padded (B, S) batches and the packed (T, ...) token layout.

Packed tokens keep row-major order, so any mask works (right or left padding, holes): a token
keeps its original column, which callers use as its position id. Padded positions come back as 0.
"""

from __future__ import annotations

import torch


def unpad(hidden: torch.Tensor, mask: torch.Tensor):
    """hidden: (B, S, ...) ; mask: (B, S) bool/0-1, True = real token.

    Returns (packed (T, ...), indices (T,) int64 into the flattened B*S, cu_seqlens (B+1,) int32,
    max_seqlen int).
    """
    B, S = mask.shape
    flat = mask.reshape(-1).bool()
    indices = flat.nonzero().squeeze(1)
    seqlens = mask.bool().sum(1, dtype=torch.int32)
    cu_seqlens = torch.zeros(B + 1, dtype=torch.int32, device=mask.device)
    torch.cumsum(seqlens, 0, dtype=torch.int32, out=cu_seqlens[1:])
    max_seqlen = int(seqlens.max()) if B else 0
    packed = hidden.reshape(B * S, *hidden.shape[2:]).index_select(0, indices)
    return packed, indices, cu_seqlens, max_seqlen


def pad(packed: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of `unpad`: packed (T, ...) -> (batch, seqlen, ...), zeros at padded positions."""
    out = packed.new_zeros(batch * seqlen, *packed.shape[1:])
    # index_copy_, not `out[indices] = packed`: torch's CPU index_put is milliseconds slower here.
    out.index_copy_(0, indices, packed)
    return out.view(batch, seqlen, *packed.shape[1:])
