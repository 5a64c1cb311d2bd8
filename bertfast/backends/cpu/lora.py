"""LoRA terms on the cpu backend: the low-rank product of each row's own adapter computed inside the GEMM's epilogue
(csrc/cpu/gemm/lora.h) from the row's shrunk values x A^T (`_C.lora_shrink`), never stored as an (M, N) delta. An op's
term (`term`) is shrunk here; a whole layer's (`LayerSlots`) inside `_C.Layer`, from each GEMM's own input.

A slot's factors (`Factors`) hold A^T (K, r rounded up to 16, zero columns) and, per run of the slot's outputs
(q | k | v; gate | up; or the whole slot), only the ranks that run reads: B's block-diagonal zeros are skipped.
Both the shrink and the epilogue sum each value as an fma chain in a fixed order, so a row's bits depend on its
own tokens and adapter alone. A bf16 or int8 engine packed on an AMX tier keeps A^T, and B where the slot's GEMM
runs on the tiles, in tile form instead (`tiles`, `bt_tiles`): the shrink and the terms run on the tiles
(csrc/cpu/gemm/lora_amx.cpp), each row's values from its own row alone."""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .ext import _C


@dataclass(frozen=True)
class Factors:
    """One adapter's factors of one slot. at: A^T (K, r16) float32, or None where `tiles` holds it (`shrink_tiles`);
    bt: per segment, per 16-column group of it (the last zero-padded), its rank rows [k0, k1) of B^T, 16 floats each
    (csrc/cpu/gemm/lora.h), or None where `bt_tiles` holds it (`expand_tiles`); seg: (segments, 3) int32 rows (k0,
    k1, offset in bt or bt_tiles); in_features: K."""
    at: torch.Tensor | None
    bt: torch.Tensor | None
    seg: torch.Tensor
    width: int
    tiles: torch.Tensor | None = None
    in_features: int = 0
    bt_tiles: torch.Tensor | None = None

    def at_fp32(self) -> torch.Tensor:
        """A^T (K, r16) float32: `at`, or hi + lo from the tile form (16 significant bits of each value)."""
        if self.at is not None:
            return self.at
        t = self.tiles.float()
        groups, steps = t.shape[:2]
        return (t[:, :, 0] + t[:, :, 1]).permute(1, 2, 4, 0, 3).reshape(steps * 32, groups * 16)[:self.in_features]

    def bt_fp32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(bt, seg) for the fp32 epilogue: `bt` and `seg`, or hi + lo from the tile form with seg's offsets into it."""
        if self.bt is not None:
            return self.bt, self.seg
        padded = -(-self.width // 16) * 16
        blocks, seg, offset = [], [], 0
        for k0, k1, start in self.seg.tolist():
            r, steps = k1 - k0, -(-(k1 - k0) // 16)
            t = self.bt_tiles[start:start + padded * steps * 32].view(padded // 16, steps, 16, 16, 2)
            cols = t.permute(0, 3, 1, 2, 4).reshape(padded, steps * 32).float()
            part = cols[:, :r] + cols[:, r:2 * r]
            blocks.append(part.view(padded // 16, 16, r).transpose(1, 2).reshape(-1))
            seg.append((k0, k1, offset))
            offset += r * padded
        return torch.cat(blocks).contiguous(), torch.tensor(seg, dtype=torch.int32)


def _amx() -> bool:
    return _C.isa() in ("amx", "amx_emulated")


def use_tiles() -> bool:
    """Whether a bf16 or int8 engine packs its adapters for the tiles: on the amx and amx_emulated tiers, unless
    BERTFAST_LORA_TILES=0 (read at each pack)."""
    return _amx() and os.environ.get("BERTFAST_LORA_TILES", "1") != "0"


def shrink_tiles(at: torch.Tensor) -> torch.Tensor:
    """A^T (K, R) float32, R a multiple of 16, in the AMX shrink's tile form (csrc/cpu/gemm/lora.h): per 16-rank
    group and 32-row step of K (zero past K), hi = bf16(A^T) then lo = bf16(A^T - hi), each 16 pairs of K rows x 16
    ranks x 2, as (R / 16, steps, 2, 16, 16, 2) bfloat16."""
    K, R = at.shape
    steps = -(-K // 32)
    padded = torch.zeros(steps * 32, R, dtype=torch.float32)
    padded[:K] = at
    hi = padded.bfloat16()
    halves = torch.stack([hi, (padded - hi.float()).bfloat16()])  # (2, steps * 32, R)
    return halves.view(2, steps, 16, 2, R // 16, 16).permute(4, 1, 0, 2, 5, 3).contiguous()


def expand_tiles(part: torch.Tensor) -> torch.Tensor:
    """A segment's B rows, part (columns padded to 16, r) float32, in the AMX expand's tile form (csrc/cpu/gemm/lora.h):
    per 16-column group and 16 ranks, one B tile of 16 pairs x 16 columns x 2 holding K' = [hi; lo] (hi = bf16(B),
    lo = bf16(B - hi), rank by rank, zero past 2r), flattened."""
    padded, r = part.shape
    steps = -(-r // 16)
    hi = part.bfloat16()
    stacked = torch.zeros(padded, steps * 32, dtype=torch.bfloat16)
    stacked[:, :r] = hi
    stacked[:, r:2 * r] = (part - hi.float()).bfloat16()
    return stacked.view(padded // 16, 16, steps, 16, 2).permute(0, 2, 3, 1, 4).reshape(-1)


def pack_factors(A: torch.Tensor, B: torch.Tensor, segments: int, tiles: bool = False,
                 expand: bool = False) -> Factors:
    """A (r, K), B (N, r) float32 (scale folded) -> Factors; N in `segments` runs of equal width where each run is a
    multiple of 16 wide (the epilogue's 16-lane groups then never straddle two), else one run. tiles: A^T in the
    shrink's tile form instead (`shrink_tiles`); expand: B in the expand's (`expand_tiles`)."""
    r, K = A.shape
    N = B.shape[0]
    if segments < 1 or N % segments or (segments > 1 and (N // segments) % 16):
        segments = 1
    width = N // segments
    at = torch.zeros(K, -(-r // 16) * 16, dtype=torch.float32, device=A.device)
    at[:, :r] = A.T.float()
    padded = -(-width // 16) * 16
    blocks, seg, offset = [], [], 0
    for i in range(segments):
        rows = B[i * width:(i + 1) * width].float()
        used = rows.ne(0).any(0).nonzero().flatten().tolist()  # the ranks this run reads; the rest are zeros in B
        k0, k1 = (used[0], used[-1] + 1) if used else (0, 0)
        part = torch.zeros(padded, k1 - k0, dtype=torch.float32, device=B.device)
        part[:width] = rows[:, k0:k1]
        if expand:
            blocks.append(expand_tiles(part))
        else:
            blocks.append(part.view(padded // 16, 16, k1 - k0).transpose(1, 2).reshape(-1))  # (group, k, lane)
        seg.append((k0, k1, offset))
        offset += blocks[-1].numel()
    bt = torch.cat(blocks).contiguous()
    return Factors(None if tiles else at.contiguous(), None if expand else bt,
                   torch.tensor(seg, dtype=torch.int32, device=A.device), width, shrink_tiles(at) if tiles else None,
                   K, bt if expand else None)


def _shrink_operands(used: list[Factors]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(A^T per factor, tile forms) as the native shrink takes them: on an AMX tier the tile forms alone where all
    factors have one; else A^T, from the tile form where a factor keeps only that (a tier switched since packing)."""
    if all(f.tiles is not None for f in used) and _amx():
        return [], [f.tiles for f in used]
    return [f.at_fp32() for f in used], []


def _expand_operands(used: list[Factors]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(bt per factor, seg per factor, B tile forms) as the native epilogues take them: the tile forms on an AMX tier
    where all factors have one, else bt (unpacked where a factor keeps only the tile form)."""
    if all(f.bt_tiles is not None for f in used) and _amx():
        return [], [f.seg for f in used], [f.bt_tiles for f in used]
    pairs = [f.bt_fp32() for f in used]
    return [bt for bt, _ in pairs], [seg for _, seg in pairs], []


# `_C.Layer`'s GEMMs, in the order its `lora` takes them.
LAYER_SLOTS = ("qkv", "attn_out", "ffn_in", "ffn_out")


def _used(factors: list[Factors | None]) -> tuple[tuple | None, list[Factors]]:
    """(the positions of the factors present, None where all are; those factors)."""
    present = tuple(i for i, f in enumerate(factors) if f is not None)
    return (None if len(present) == len(factors) else present), [factors[i] for i in present]


def _present(index: torch.Tensor, factors: list[Factors | None]) -> tuple[torch.Tensor, list[Factors]]:
    """(index into the factors present, those factors): rows of an adapter that leaves the slot alone get -1."""
    present, used = _used(factors)
    return _indexed(index, present, len(factors), {}), used


def term(x: torch.Tensor, index: torch.Tensor, factors: list[Factors | None]):
    """The `_C.LoraTerm` of one call: x (M, K) the slot's input, index (M,) int32 each row's position in `factors`
    or -1, factors per adapter (None: the adapter leaves the slot alone, its rows get no term)."""
    index, used = _present(index, factors)
    if x.stride(-1) != 1:
        x = x.contiguous()
    s = _C.lora_shrink(x, index, *_shrink_operands(used))
    bts, segs, bt_tiles = _expand_operands(used)
    return _C.LoraTerm(s, index, bts, segs, used[0].width, bt_tiles)


class LayerSlots:
    """`_C.Layer`'s lora for the forwards of one backend: per executed layer, per GEMM (LAYER_SLOTS) its factors as
    `term` takes them (`_C.LoraSlot`), or None where no adapter of the forward adapts it, and its rows' index. The
    slots depend only on the forward's adapters (in order) and the tier, so they are kept for the next forward of the
    same adapters (a single adapter's, a repeated mix), which only gives the layer its rows' index (`lora_index`).
    Entries go with their adapters (unloaded, freed), and the least recently used past `size`."""

    def __init__(self, size: int = 16):
        self.size = size
        self._entries: OrderedDict[tuple, list] = OrderedDict()
        self._watched: set[int] = set()  # the adapters whose freeing drops their entries
        self._lock = threading.RLock()  # re-entered by _forget should a collection inside it free an adapter

    def __call__(self, rows) -> list[tuple[list, list]]:
        """Per executed layer of `rows` (`adapters_rows.RowAdapters`) `_C.Layer`'s (lora, lora_index): the 4 slots and
        their tokens' index (None: no slot)."""
        key = (tuple(id(a) for a in rows.adapters), _amx())
        with self._lock:
            layers = self._entries.get(key)
            if layers is not None:
                self._entries.move_to_end(key)
        if layers is None:
            built = [self._layer(rows, i) for i in range(rows.layers)]
            layers = [slots for slots, _ in built]
            if all(own for _, own in built):  # not when fp32 forms were unpacked from tile forms (a tier switched)
                self._keep(key, rows.adapters, layers)
        indexed = {}  # each slot's index, once per set of adapters present
        return [([None if slot is None else slot[2] for slot in layer],
                 [None if slot is None else _indexed(rows.token_index, slot[0], slot[1], indexed) for slot in layer])
                for layer in layers]

    def _keep(self, key: tuple, adapters: list, layers: list) -> None:
        with self._lock:
            for adapter in adapters:
                if id(adapter) not in self._watched:
                    self._watched.add(id(adapter))
                    weakref.finalize(adapter, _forget, weakref.ref(self), id(adapter))
            self._entries[key] = layers
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    @staticmethod
    def _layer(rows, i: int) -> tuple[list, bool]:
        """Layer i's slots without an index, each (the positions of the adapters that have the slot, or None for all;
        the forward's adapter count; `_C.LoraSlot`), and whether they hold only the factors' own tensors."""
        slots, own = [], True
        for name in LAYER_SLOTS:
            factors = rows.factors(i, name)
            if factors is None:
                slots.append(None)
                continue
            present, used = _used(factors)
            at, tiles = _shrink_operands(used)
            bts, segs, bt_tiles = _expand_operands(used)
            own = own and all(a is f.at for a, f in zip(at, used)) and all(b is f.bt for b, f in zip(bts, used))
            slot = _C.LoraSlot(torch.empty(0, dtype=torch.int32), at, bts, segs, used[0].width, tiles, bt_tiles)
            slots.append((present, len(factors), slot))
        return slots, own


def _indexed(index: torch.Tensor, present: tuple | None, adapters: int, memo: dict) -> torch.Tensor:
    """index (T,) int32, each token's position among the forward's adapters (-1: base), as its position among the
    `present` ones (None: all), -1 for the rows of an adapter that leaves the slot alone."""
    if present is None:
        return index
    if present not in memo:
        lut = torch.full((adapters + 1,), -1, dtype=torch.int32)  # lut[-1]: the base rows' -1 stays -1
        lut[list(present)] = torch.arange(len(present), dtype=torch.int32)
        memo[present] = lut[index.long()]
    return memo[present]


def _forget(ref, adapter: int) -> None:
    """A freed adapter's entries out of the LayerSlots `ref` (weakref.finalize's callback)."""
    slots = ref()
    if slots is not None:
        with slots._lock:
            for key in [k for k in slots._entries if adapter in k[0]]:
                del slots._entries[key]
            slots._watched.discard(adapter)
