"""MaxSim, ColBERT's late-interaction score, as PyLate's `pylate.scores.colbert_scores` computes it.

score(query, document) = sum over the query's tokens of the largest dot product with any of the document's tokens.
Inputs are padded batches (Q, s, dim) / (D, t, dim) with optional 0/1 masks, or lists of per-text (n, dim) arrays
or tensors (`ColBERT.encode`'s output), which are zero-padded: as in PyLate, a padded or masked token scores 0, not
minus infinity (a query token whose similarities to a document are all negative scores 0 there). The (Q, D, s, t)
similarities are held one block of documents at a time.
"""

from __future__ import annotations

import numpy as np
import torch

# Similarities held at once by `colbert_scores` (elements of the (Q, block, s, t) tensor).
SCORE_BLOCK = 1 << 24


def _batch(x, mask, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A padded (N, n, dim) float tensor and its (N, n) mask (None: none given and none needed)."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if isinstance(x, (list, tuple)):
        rows = [torch.from_numpy(r) if isinstance(r, np.ndarray) else torch.as_tensor(r) for r in x]
        if not rows:
            raise ValueError(f"{what}: an empty list")
        if any(r.dim() != 2 or r.shape[-1] != rows[0].shape[-1] for r in rows):
            raise ValueError(f"{what}: each element must be (tokens, dim) with one dim, got "
                             f"{sorted({tuple(r.shape) for r in rows})}")
        lengths = torch.tensor([r.shape[0] for r in rows])
        x = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        if mask is None and bool((lengths != x.shape[1]).any()):
            mask = (torch.arange(x.shape[1])[None, :] < lengths[:, None]).to(x.dtype)
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"{what}: expected (N, tokens, dim) or a list of (tokens, dim), got "
                         f"{tuple(x.shape) if hasattr(x, 'shape') else type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{what}: expected floating point vectors, got {x.dtype}")
    if mask is not None:
        mask = torch.as_tensor(mask, device=x.device)
        if tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"{what}: the mask is {tuple(mask.shape)}, the vectors {tuple(x.shape)}")
        mask = mask.to(x.dtype)
    return x, mask


def colbert_scores(queries, documents, queries_mask=None, documents_mask=None) -> torch.Tensor:
    """MaxSim of every query with every document: (Q, D), as `pylate.scores.colbert_scores`.

    queries: (Q, s, dim) or a list of Q (s_i, dim) arrays / tensors; documents: (D, t, dim) or a list of D (t_j, dim);
    queries_mask (Q, s), documents_mask (D, t): 0/1, padded tensors only (a list pads with zero vectors, which
    score 0 as a masked token does). Float32 in, float32 out (the inputs' promoted dtype)."""
    q, qm = _batch(queries, queries_mask, "queries")
    d, dm = _batch(documents, documents_mask, "documents")
    if q.shape[-1] != d.shape[-1]:
        raise ValueError(f"queries have dim {q.shape[-1]}, documents {d.shape[-1]}")
    dtype = torch.promote_types(q.dtype, d.dtype)
    q, d = q.to(dtype), d.to(device=q.device, dtype=dtype)
    Q, s, D, t = q.shape[0], q.shape[1], d.shape[0], d.shape[1]
    out = q.new_zeros(Q, D)
    step = max(1, SCORE_BLOCK // max(1, Q * s * t))
    for start in range(0, D, step):
        end = min(D, start + step)
        sim = torch.einsum("ash,bth->abst", q, d[start:end])  # [Q, block, s, t]
        if qm is not None:
            sim = sim * qm[:, None, :, None]
        if dm is not None:
            sim = sim * dm[None, start:end, None, :].to(sim.device)
        out[:, start:end] = sim.amax(-1).sum(-1)
    return out


def colbert_scores_pairwise(queries, documents) -> torch.Tensor:
    """MaxSim of query i with document i: (N,), as `pylate.scores.colbert_scores_pairwise`. queries, documents:
    N (s_i, dim) / (t_i, dim) arrays or tensors each (lists, or (N, n, dim) batches)."""
    if len(queries) != len(documents):
        raise ValueError(f"{len(queries)} queries but {len(documents)} documents")
    scores = []
    for i, (query, document) in enumerate(zip(queries, documents)):
        q, d = (torch.from_numpy(x) if isinstance(x, np.ndarray) else torch.as_tensor(x) for x in (query, document))
        if q.dim() != 2 or d.dim() != 2 or q.shape[-1] != d.shape[-1]:
            raise ValueError(f"pair {i}: expected (tokens, dim) each with one dim, got {tuple(q.shape)} and "
                             f"{tuple(d.shape)}")
        scores.append((q @ d.to(q).T).amax(-1).sum())
    return torch.stack(scores) if scores else torch.zeros(0)


__all__ = ["colbert_scores", "colbert_scores_pairwise"]
