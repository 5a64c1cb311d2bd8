"""LoRA on the embedding tables (PEFT's `lora_embedding_A` / `lora_embedding_B` of an `nn.Embedding`): which modules
of a family are its tables, and a forward's adapted rows.

PEFT adds (A^T[id] B^T) * scale to the table's row for each looked-up id, before the model sums the tables and
normalizes. An adapter's tokens here get that sum and norm from the embeddings op itself, run on tables made of their
own adapted rows (looked up by position 0..n-1): the same kernel on the same values, so the base rows keep the fused
op unchanged and an adapted row's bits depend on its own ids alone.
"""

from __future__ import annotations

import dataclasses

import torch

from .backends.weights import EmbeddingWeights
from .config import ModelConfig
from .loading import ROTARY_LAYOUTS

TABLES = ("word", "position", "token_type")  # `EmbeddingWeights` fields an adapter may adapt


def embedding_modules(config: ModelConfig) -> dict[str, str]:
    """module name (relative to the encoder, as the checkpoints name it) -> the table it holds, for the family."""
    if config.rotary:
        return {lay[t]: t for lay in ROTARY_LAYOUTS[config.family] for t in ("word", "token_type") if t in lay}
    return {f"embeddings.{t}_embeddings": t for t in TABLES}


def adapted_rows(table: torch.Tensor, at: torch.Tensor, bt: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] + at[ids] bt in the table's dtype, the term in fp32: at (V, r) = A^T, bt (r, E) = B^T with the scale
    folded in. The term is summed over the ranks in order, one elementwise step each, so a row's bits do not
    depend on how many rows are computed with it (a matmul's blocking could)."""
    a = at.index_select(0, ids)
    term = torch.zeros(ids.numel(), bt.shape[1], dtype=torch.float32, device=table.device)
    for k in range(bt.shape[0]):
        term.addcmul_(a[:, k:k + 1], bt[k:k + 1])
    return (table.index_select(0, ids).float() + term).to(table.dtype)


def adapted_embeddings(ops, emb: EmbeddingWeights, pairs: dict, ids: torch.Tensor, positions: torch.Tensor,
                       types: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The embeddings op's output (n, E) for n tokens of one adapter, whose packed pairs (table -> (A^T, B^T),
    `adapters_rows.pack_adapter`) adapt some of the tables."""
    index = {"word": ids, "position": positions, "token_type": types}
    if types is None and emb.token_type is not None:
        index["token_type"] = torch.zeros_like(ids)  # what the op reads for a model called without token types
    tables = {}
    for name, (at, bt) in pairs.items():
        tables[name] = adapted_rows(getattr(emb, name), at, bt, index[name])
        index[name] = torch.arange(ids.numel(), dtype=ids.dtype, device=ids.device)
    return ops.embeddings(index["word"], index["position"], index["token_type"],
                          dataclasses.replace(emb, **tables), eps)


__all__ = ["TABLES", "embedding_modules", "adapted_rows", "adapted_embeddings"]
