"""DeBERTa-v2's per-token position terms in plain torch: the math of the backends' `disentangled` op
(`bertfast.disentangled` explains the terms), used by the oracle and by the triton backend (batched products on the
device); the cpu backend has its own kernel (`_C.position_scores`)."""

from __future__ import annotations

import torch


def tables(q, k, pos_key, pos_query, scale: float):
    """The reference `disentangled` op: c2p[t, h, r] = scale * q[t, h] . pos_key[r, h], p2c[t, h, r] = scale *
    k[t, h] . pos_query[r, h]. q, k: (T, heads, d); pos_key, pos_query: (R, heads * d) or None. Returns (c2p, p2c),
    each (T, heads, R) in float32 (float64 for float64 inputs) or None."""
    heads, d = q.shape[1], q.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)

    def table(x, pos):
        if pos is None:
            return None
        return (torch.einsum("thd,rhd->thr", x.to(dtype), pos.to(dtype).view(-1, heads, d)) * scale).contiguous()

    return table(q, pos_key), table(k, pos_query)
