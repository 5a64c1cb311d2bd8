"""A forward's LoRA adapters per row: each loaded adapter's factors in its backend's form (`pack_adapter`), and per
forward which rows use which adapter (`RowAdapters`) and each slot's terms from the backend (`Backend.lora`); the
adapters themselves and their math: `adapters`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .adapters import Adapter
from .adapters_embeddings import adapted_embeddings
from .backends.weights import LayerWeights, ModelWeights


def pack_adapter(adapter: Adapter, base: ModelWeights, pack_lora) -> Adapter:
    """`adapter` with each slot's factors in the form its backend's `lora` takes (pack_lora: `Backend.pack_lora`
    with the tensors on the weights' device, given the slot's runs of outputs, `_segments`), and DeBERTa-v2's
    pos_key / pos_query slots as the adapted tables themselves (the base's (2 span, H) table + relative_inputs A^T B^T,
    in float64, then the table's dtype): the position projections read the same rows in every forward; the
    embedding tables' pairs as (A^T, B^T) on the weights' device (`adapters_embeddings.adapted_rows`). Slot dicts
    shared between layers (ALBERT) stay shared."""
    seen: dict[int, dict] = {}
    for slots, layer in zip(adapter.layers, base.layers):
        if id(slots) not in seen:
            seen[id(slots)] = {slot: _position_table(base, layer, slot, A, B) if slot.startswith("pos_") else
                               pack_lora(A, B, _segments(layer, slot)) for slot, (A, B) in slots.items()}
    pooler, projection = (None if p is None else pack_lora(*p, 1, layer=False)
                          for p in (adapter.pooler, adapter.projection))
    device = base.embeddings.word.device
    tables = {name: (A.T.contiguous().to(device), B.T.contiguous().to(device))
              for name, (A, B) in adapter.embeddings.items()}
    return dataclasses.replace(adapter, layers=[seen[id(slots)] for slots in adapter.layers], pooler=pooler,
                               projection=projection, embeddings=tables)


def _segments(layer: LayerWeights, slot: str) -> int:
    """The equal runs a slot's outputs come in, each fed by its own modules: q | k | v, a gated FFN's gate | up."""
    if slot == "qkv":
        return 3
    if slot == "ffn_in" and layer.ffn_in_weight.shape[0] == 2 * layer.ffn_out_weight.shape[1]:
        return 2
    return 1


def _position_table(base: ModelWeights, layer: LayerWeights, slot: str, A, B) -> torch.Tensor:
    table, inputs = getattr(layer, slot), base.embeddings.relative_inputs
    delta = inputs.double() @ A.double().to(inputs.device).T @ B.double().to(inputs.device).T
    return (table.double() + delta).to(table.dtype).contiguous()


class RowAdapters:
    """One forward's adapters, one (packed, `pack_adapter`) or None per row: `adapters`, the distinct ones in order of
    first appearance; each token's and each batch row's position among them (-1: the base model, indices on
    `device`); and where each one's rows are: runs of consecutive rows as token slices (`spans`) and as batch row
    slices (`rows`, the pooler reads one token a row).

    `addend` is a slot's LoRA terms in the backend's form (`Backend.lora`): a row's depends on its own tokens and
    adapter alone, as its base output does, so a row gets the same bits alone and in any batch. `memo`: what a
    backend builds once per forward for all its layers."""

    def __init__(self, adapters: Sequence[Adapter | None], cu_seqlens: torch.Tensor, device):
        bounds, position = cu_seqlens.tolist(), {}
        self.adapters: list[Adapter] = []
        self.spans: list[tuple[int, slice]] = []
        self.rows: list[tuple[int, slice]] = []
        row_index = []
        for i, adapter in enumerate(adapters):
            if adapter is None:
                row_index.append(-1)
                continue
            p = position.setdefault(id(adapter), len(self.adapters))
            if p == len(self.adapters):
                self.adapters.append(adapter)
            row_index.append(p)
            _extend(self.spans, p, bounds[i], bounds[i + 1])
            _extend(self.rows, p, i, i + 1)
        lengths = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], dtype=torch.int64)
        self.row_index = torch.tensor(row_index, dtype=torch.int32)
        self.token_index = torch.repeat_interleave(self.row_index, lengths).to(device)
        self.row_index = self.row_index.to(device)
        self.memo: dict = {}

    @property
    def layers(self) -> int:
        """The executed layers of the model the adapters adapt."""
        return len(self.adapters[0].layers)

    def factors(self, layer: int | None, slot: str) -> list | None:
        """Per adapter its packed factors of the slot (None: it leaves the slot alone), None where none has it; layer
        None: the model's own slots, "pooler" and "projection" (factorised embeddings)."""
        factors = [getattr(a, slot) if layer is None else a.layers[layer].get(slot) for a in self.adapters]
        return None if all(f is None for f in factors) else factors

    def addend(self, ops, x: torch.Tensor, layer: int | None, slot: str):
        """x (T, K) the slot's input (a row per batch row for the pooler, layer None) -> the slot's terms in the
        backend's form (`Backend.lora`), or None where no adapter of the forward has the slot."""
        if (factors := self.factors(layer, slot)) is None:
            return None
        index, groups = (self.row_index, self.rows) if slot == "pooler" else (self.token_index, self.spans)
        return ops.lora(x, index, factors, groups)

    def embeddings(self, ops, x: torch.Tensor, tokens, emb, eps: float) -> torch.Tensor:
        """x (T, E), the embeddings op's output for every token, with the tokens of each adapter that adapts an
        embedding table recomputed from its adapted rows (`adapters_embeddings`); tokens: the forward's `Tokens`."""
        for p, adapter in enumerate(self.adapters):
            if adapter.embeddings:
                idx = self._tokens(p)
                ids, positions, types = (None if t is None else t.index_select(0, idx)
                                         for t in (tokens.ids, tokens.positions, tokens.types))
                x.index_copy_(0, idx, adapted_embeddings(ops, emb, adapter.embeddings, ids, positions, types, eps))
        return x

    def positions(self, ops, layer: int, bias, q, k, index, scale: float, windows):
        """DeBERTa-v2: `bias` (the layer's DisentangledBias from the base tables, `disentangled.layer_bias`) with the
        c2p / p2c rows of each group whose adapter has pos_key / pos_query computed from its adapter's tables."""
        c2p, p2c = bias.c2p, bias.p2c
        for p, adapter in enumerate(self.adapters):
            slots = adapter.layers[layer]
            key, query = slots.get("pos_key"), slots.get("pos_query")
            if key is None and query is None:
                continue
            idx = self._tokens(p)
            rows = [None if t is None else t[index.lo:index.hi] for t in (key, query)]
            group = ops.disentangled(q.index_select(0, idx), k.index_select(0, idx), *rows, scale,
                                     tuple(w.index_select(0, idx) for w in windows))
            for table, part in zip((c2p, p2c), group):
                if part is not None:
                    table.index_copy_(0, idx, part)
        return bias

    def _tokens(self, p: int) -> torch.Tensor:
        """The tokens of the forward's adapter p, in order."""
        return (self.token_index == p).nonzero().flatten()

    def layer(self, ops, i: int | None) -> "LayerAdapters":
        """Executed layer i's view (`engine.compose_layer`'s lora); None: the model's own slots (the embedding
        projection, the pooler)."""
        return LayerAdapters(self, ops, i)


def _extend(runs: list[tuple[int, slice]], p: int, start: int, stop: int) -> None:
    """Add rows [start, stop) of adapter p to `runs`, joining the last run where it is p's and ends at start."""
    if runs and runs[-1][0] == p and runs[-1][1].stop == start:
        runs[-1] = (p, slice(runs[-1][1].start, stop))
    else:
        runs.append((p, slice(start, stop)))


class LayerAdapters:
    """One layer's share of a forward's `RowAdapters`: called with (slot, x), the slot's addend or None; `factors(slot)`
    and `index` (T,) int32 for a whole layer (`Backend.whole_layer`); `positions`: DeBERTa-v2's per-row terms."""

    def __init__(self, rows: RowAdapters, ops, layer: int | None):
        self.rows, self.ops, self.layer, self.index = rows, ops, layer, rows.token_index

    def __call__(self, slot: str, x: torch.Tensor) -> torch.Tensor | None:
        return self.rows.addend(self.ops, x, self.layer, slot)

    def factors(self, slot: str) -> list | None:
        return self.rows.factors(self.layer, slot)

    def positions(self, bias, q, k, index, scale: float, windows):
        return self.rows.positions(self.ops, self.layer, bias, q, k, index, scale, windows)


__all__ = ["RowAdapters", "LayerAdapters", "pack_adapter"]
