"""DeBERTa-v2/v3's disentangled attention: relative positions, their buckets, and the position projections.

transformers' `DisentangledSelfAttention` adds to the scores of query i and key j (columns of the padded batch,
r = i - j, bucketed by `log_bucket` when position_buckets > 0, then c = clamp(bucket(r) + span, 0, 2 span - 1))
the content-to-position term q_i . pos_key[c] and the position-to-content term k_j . pos_query[c], both scaled as
q.k is. pos_key and pos_query are the layer's key / query projections of the (LayerNorm'd) relative embeddings:
functions of the weights alone, so `position_projections` computes them once, at load (as Q, K and V are fused).
Per forward, `distance_index` maps each distance to its column c once; per layer, each token's rows of both terms
are a (T, heads, R) table (linear in T; `tables` is the op's math, the backends' kernels its mirrors), gathered per
(query, key) inside the attention kernels (`backends.DisentangledBias`): no (S, S) tensor per head outside them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .backends.contract import DisentangledBias


def tables(q, k, pos_key, pos_query, scale: float):
    """The engine's plain `disentangled` op (what `_C.position_scores` and the Triton `position_scores` compute on the
    cpu and triton backends; the oracle writes its own, `reference.disentangled`): c2p[t, h, r] = scale * q[t, h] . pos_key[r, h], p2c[t, h, r]
    = scale * k[t, h] . pos_query[r, h]. q, k: (T, heads, d); pos_key, pos_query: (R, heads * d) or None. Returns
    (c2p, p2c), each (T, heads, R) in float32 (float64 for float64 inputs) or None."""
    heads, d = q.shape[1], q.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)

    def table(x, pos):
        if pos is None:
            return None
        return (torch.einsum("thd,rhd->thr", x.to(dtype), pos.to(dtype).view(-1, heads, d)) * scale).contiguous()

    return table(q, pos_key), table(k, pos_query)


def log_bucket(relative: torch.Tensor, buckets: int, max_position: int) -> torch.Tensor:
    """transformers' make_log_bucket_position, op for op so the float32 log and ceil round as they do:
    distances below buckets / 2 kept, farther ones log-spaced up to max_position. relative: int64 -> int64."""
    sign = torch.sign(relative)
    mid = buckets // 2
    near = (relative < mid) & (relative > -mid)
    abs_pos = torch.where(near, torch.tensor(mid - 1).type_as(relative), torch.abs(relative))
    log_pos = torch.ceil(torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid))
                         * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, relative.type_as(log_pos), log_pos * sign).to(torch.long)


def columns_of(config, relative: torch.Tensor) -> torch.Tensor:
    """The relative embedding row of each query-minus-key distance `relative` (int64): its bucket (when the config
    buckets) shifted by the span and clamped to [0, 2 span - 1]."""
    span = config.att_span
    if config.position_buckets > 0 and config.max_relative_positions > 0:
        relative = log_bucket(relative, config.position_buckets, config.max_relative_positions)
    return torch.clamp(relative + span, 0, 2 * span - 1)


class DistanceIndex(NamedTuple):
    """The columns of one forward's distances: index (2 width - 1,) int32, index[width - 1 + r] = the row of the
    position projections for distance r = query - key column, relative to `lo`; rows [lo, hi) of the projections
    are the only ones any pair of a batch `width` wide reads."""

    index: torch.Tensor
    lo: int
    hi: int


@functools.lru_cache(maxsize=64)
def distance_index(config, width: int, device: str = "cpu") -> DistanceIndex:
    """The DistanceIndex of a padded batch `width` columns wide (distances -(width - 1) .. width - 1) on `device`.
    Computed on the host and kept per (config, width, device): a forward reads it without a device sync (what
    CUDA-graph capture needs)."""
    cols = columns_of(config, torch.arange(-(width - 1), width))
    lo, hi = int(cols.min()), int(cols.max()) + 1
    return DistanceIndex((cols - lo).to(torch.int32).to(device).contiguous(), lo, hi)


def token_windows(index: DistanceIndex, positions: torch.Tensor, cu_seqlens: torch.Tensor):
    """The columns [lo, hi) of the tables (relative to `index.lo`) each token's rows are read at: (c2p, p2c), (T, 2)
    int32 each. Query t reads its c2p row at the distances positions[t] - positions[u] over its sequence's keys u,
    key u its p2c row at positions[t] - positions[u] over the queries t; a sequence's positions increase, so each
    window runs from its first to its last token's distance, and the index is monotone in the distance. A backend's
    `disentangled` may compute only those columns. No device sync: a CUDA graph captures it."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    pos = positions.long()
    if pos.numel() == 0:
        empty = torch.zeros(0, 2, dtype=torch.int32, device=positions.device)
        return empty, empty
    first = pos[cu_seqlens[:-1].long().clamp(max=pos.numel() - 1)].repeat_interleave(lengths, output_size=pos.numel())
    last = pos[(cu_seqlens[1:].long() - 1).clamp(min=0)].repeat_interleave(lengths, output_size=pos.numel())
    idx = index.index.long()
    centre = (idx.numel() - 1) // 2

    def window(near, far):  # distances near .. far (near <= far) -> columns [index(near), index(far) + 1)
        return torch.stack([idx[centre + near], idx[centre + far] + 1], dim=1).to(torch.int32).contiguous()

    return window(pos - last, pos - first), window(first - pos, last - pos)


def layer_bias(ops, q, k, pos_key, pos_query, index: DistanceIndex, positions, scale: float,
               windows) -> DisentangledBias:
    """One layer's DisentangledBias from its q, k (T, heads, d) through the backend's `disentangled` op: the rows
    [lo, hi) of the layer's pos_key / pos_query ((2 span, H) or None where pos_att_type lacks c2p / p2c); windows:
    `token_windows`."""
    def rows(t):
        return None if t is None else t[index.lo:index.hi]

    c2p, p2c = ops.disentangled(q, k, rows(pos_key), rows(pos_query), scale, windows)
    return DisentangledBias(c2p, p2c, index.index, positions)


def position_inputs(config, rel_embeddings, ln_weight, ln_bias) -> torch.Tensor:
    """The position projections' input: the relative embeddings (2 span, H), LayerNorm'd when config.norm_rel_ebd,
    in float64."""
    rel = rel_embeddings.double()
    if config.norm_rel_ebd:
        rel = F.layer_norm(rel, (rel.shape[-1],), ln_weight.double(), ln_bias.double(), config.layer_norm_eps)
    return rel


def position_projections(config, rel_embeddings, ln_weight, ln_bias, key, query):
    """(pos_key, pos_query) of one layer, (2 span, H) each or None: `position_inputs` through key = (weight, bias)
    (c2p) and query = (weight, bias) (p2c), or None where pos_att_type has no such term. Computed in float64,
    returned in the embeddings' dtype."""
    rel = position_inputs(config, rel_embeddings, ln_weight, ln_bias)

    def project(pair):
        return None if pair is None else F.linear(rel, pair[0].double(), pair[1].double()).to(rel_embeddings.dtype)

    return project(key), project(query)


def dense_bias(bias: DisentangledBias, query_positions, key_positions, dtype) -> torch.Tensor:
    """The bias as a dense (..., heads, Sq, Sk) tensor in `dtype` (the oracle's form): query_positions (..., Sq),
    key_positions (..., Sk) int; c2p rows follow the queries and p2c rows the keys ((..., S, heads, R) each, or
    None). Distances outside the index (padding) are clamped."""
    width = bias.index.shape[0]
    r = query_positions[..., :, None].long() - key_positions[..., None, :].long() + (width - 1) // 2
    cols = bias.index.long()[r.clamp(0, width - 1)]  # (..., Sq, Sk)
    out = 0
    if bias.c2p is not None:  # (..., Sq, heads, R): row i, column cols[i, j]
        c2p = bias.c2p.movedim(-2, -3)  # (..., heads, Sq, R)
        out = out + torch.gather(c2p, -1, cols.unsqueeze(-3).expand(*c2p.shape[:-1], cols.shape[-1]))
    if bias.p2c is not None:  # (..., Sk, heads, R): row j, column cols[i, j]
        p2c = bias.p2c.movedim(-2, -3)  # (..., heads, Sk, R)
        idx = cols.transpose(-1, -2).unsqueeze(-3).expand(*p2c.shape[:-1], cols.shape[-2])
        out = out + torch.gather(p2c, -1, idx).transpose(-1, -2)
    return out.to(dtype) if torch.is_tensor(out) else None
