"""The unpad/pad boundary between padded (B, S) batches and the packed (T, ...) token layout.

Packed tokens keep row-major order, so any mask works (right or left padding, holes): a token
keeps its original column, which callers use as its position id. Padded positions come back as 0.
"""

from __future__ import annotations

import torch


def unpad(hidden: torch.Tensor, mask: torch.Tensor):
    """hidden: (B, S, ...) ; mask: (B, S) bool/0-1, True = real token.

    Returns (packed (T, ...), indices (T,) int64 into the flattened B*S, cu_seqlens (B+1,) int32,
    max_seqlen int). One read from the device (the lengths): the token count and longest row come from it, and
    the indices need no second one (`nonzero_static` of the known size).
    """
    B, S = mask.shape
    flat = mask.reshape(-1).bool()
    seqlens = mask.bool().sum(1, dtype=torch.int32)
    lengths = seqlens.tolist()
    T = sum(lengths)
    try:
        indices = torch.nonzero_static(flat, size=T).squeeze(1)
    except NotImplementedError:  # a torch build without it for this device
        indices = flat.nonzero().squeeze(1)
    cu_seqlens = torch.zeros(B + 1, dtype=torch.int32, device=mask.device)
    torch.cumsum(seqlens, 0, dtype=torch.int32, out=cu_seqlens[1:])
    max_seqlen = max(lengths, default=0)
    packed = hidden.reshape(B * S, *hidden.shape[2:]).index_select(0, indices)
    return packed, indices, cu_seqlens, max_seqlen


def pad(packed: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of `unpad`: packed (T, ...) -> (batch, seqlen, ...), zeros at padded positions."""
    out = packed.new_zeros(batch * seqlen, *packed.shape[1:])
    # index_copy_, not `out[indices] = packed`: torch's CPU index_put is milliseconds slower here.
    out.index_copy_(0, indices, packed)
    return out.view(batch, seqlen, *packed.shape[1:])
