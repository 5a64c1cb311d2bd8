"""LoRA terms on the cpu backend: the low-rank product of each row's own adapter computed inside the GEMM's epilogue
(csrc/cpu/gemm/lora.h) from the row's shrunk values x A^T (`_C.lora_shrink`), never stored as an (M, N) delta. An op's
term (`term`) is shrunk here; a whole layer's (`layer_slots`) inside `_C.Layer`, from each GEMM's own input.

A slot's factors (`Factors`) hold A^T (K, r rounded up to 16, zero columns) and, per run of the slot's outputs
(q | k | v; gate | up; or the whole slot), only the ranks that run reads: B's block-diagonal zeros are skipped.
Both the shrink and the epilogue sum each value as an fma chain in a fixed order, so a row's bits depend on its
own tokens and adapter alone."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ext import _C


@dataclass(frozen=True)
class Factors:
    """One adapter's factors of one slot. at: A^T (K, r16) float32; bt: per segment, per 16-column group of it (the
    last zero-padded), its rank rows [k0, k1) of B^T, 16 floats each (csrc/cpu/gemm/lora.h); seg: (segments, 3) int32
    rows (k0, k1, offset in bt)."""
    at: torch.Tensor
    bt: torch.Tensor
    seg: torch.Tensor
    width: int


def pack_factors(A: torch.Tensor, B: torch.Tensor, segments: int) -> Factors:
    """A (r, K), B (N, r) float32 (scale folded) -> Factors; N in `segments` runs of equal width where each run is a
    multiple of 16 wide (the epilogue's 16-lane groups then never straddle two), else one run."""
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
        blocks.append(part.view(padded // 16, 16, k1 - k0).transpose(1, 2).reshape(-1))  # (group, k, lane)
        seg.append((k0, k1, offset))
        offset += (k1 - k0) * padded
    bt = torch.cat(blocks).contiguous()
    return Factors(at.contiguous(), bt, torch.tensor(seg, dtype=torch.int32, device=A.device), width)


# `_C.Layer`'s GEMMs, in the order its `lora` takes them.
LAYER_SLOTS = ("qkv", "attn_out", "ffn_in", "ffn_out")


def _present(index: torch.Tensor, factors: list[Factors | None]) -> tuple[torch.Tensor, list[Factors]]:
    """(index into the factors present, those factors): rows of an adapter that leaves the slot alone get -1."""
    present = [i for i, f in enumerate(factors) if f is not None]
    if len(present) < len(factors):
        lut = torch.full((len(factors) + 1,), -1, dtype=torch.int32)  # lut[-1]: the base rows' -1 stays -1
        lut[present] = torch.arange(len(present), dtype=torch.int32)
        index = lut[index.long()]
    return index, [factors[i] for i in present]


def term(x: torch.Tensor, index: torch.Tensor, factors: list[Factors | None]):
    """The `_C.LoraTerm` of one call: x (M, K) the slot's input, index (M,) int32 each row's position in `factors`
    or -1, factors per adapter (None: the adapter leaves the slot alone, its rows get no term)."""
    index, used = _present(index, factors)
    if x.stride(-1) != 1:
        x = x.contiguous()
    s = _C.lora_shrink(x, index, [f.at for f in used])
    return _C.LoraTerm(s, index, [f.bt for f in used], [f.seg for f in used], used[0].width)


def layer_slots(lora) -> list:
    """`_C.Layer`'s lora: per GEMM (LAYER_SLOTS) its rows' operands before their shrink (`_C.LoraSlot`: index and
    factors as `term` takes them), or None where no adapter of the forward adapts it. lora: the layer's
    `adapters_rows.LayerAdapters` (`factors`, `index`)."""
    slots = []
    for name in LAYER_SLOTS:
        factors = lora.factors(name)
        if factors is None:
            slots.append(None)
            continue
        index, used = _present(lora.index, factors)
        slots.append(_C.LoraSlot(index, [f.at for f in used], [f.bt for f in used], [f.seg for f in used],
                                 used[0].width))
    return slots
