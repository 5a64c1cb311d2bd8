"""LoRA adapters per row inside the cpu backend's native layer (`CpuBackend.whole_layer(x, layer, lora)`: `_C.Layer`
with each GEMM's `_C.LoraSlot`).

The layer shrinks each GEMM's own input (qkv: the layer input x; attn_out: the attention output; ffn_in: the normalized
attention block; ffn_out: the FFN's hidden) and adds the terms in that GEMM's epilogue, as the ops composed one by one
do: bit for bit the same in fp32, bf16 and int8 on every ISA cap, on batches crossing its groups (fp32's of up to 192
rows, int8's of up to 96, int8's FFN chunks of 96), with GEMMs no adapter of the call adapts (no LoraSlot), adapters
that leave a GEMM alone (their rows get no term there) and base rows; under int8 also when the layer's input codes are
carried from the previous layer (`_C.LayerCarry`: the QKV shrink still reads x). A row alone gets its bits in the
batch. The slots of a set of adapters are kept for its next forwards (`LayerSlots`), each with its own rows' index.
"""

from __future__ import annotations

import pytest
import torch

from bertfast.adapters import Adapter
from bertfast.adapters_rows import RowAdapters, pack_adapter
from bertfast.backends import available_backends
from bertfast.engine import compose_layer
from helpers.adapters import native_layer_calls

CPU_REASON = available_backends("cpu").get("cpu")
pytestmark = pytest.mark.skipif(CPU_REASON is not None, reason=f"backend 'cpu' unavailable: {CPU_REASON}")

H, HEADS, INTER = 96, 3, 384
# 815 tokens: fp32 groups 146 | 93 | 133 | 83 | 200 | 160, int8 groups 96 | 50 | 93 | 130 | 86 | 200 | 160 (the
# FFN's chunks: one of 130, two of 100, one of 160); rows of 1 and 3 tokens.
LENGTHS = [60, 36, 50, 47, 46, 130, 3, 77, 5, 1, 200, 160]
ROWS = ["a", None, "b", "c", "a", "b", None, "c", "a", "b", "c", "a"]


def _pair(g, rank, n, k=H, runs=1, used=None):
    """(A (runs * rank, k), B (n, runs * rank)) of a slot of n outputs in `runs` runs (q | k | v: 3), B block-diagonal
    by run and zero in the runs not `used` (default: all)."""
    A = torch.randn(runs * rank, k, generator=g) * 0.2
    B = torch.zeros(n, runs * rank)
    width = n // runs
    for r in range(runs):
        if used is None or r in used:
            B[r * width:(r + 1) * width, r * rank:(r + 1) * rank] = torch.randn(width, rank, generator=g) * 0.2
    return A, B


def _adapters(g, only_c: bool):
    """Three adapters: "a" adapts every GEMM (ranks 4 per q | k | v, 20 on ffn_in: past the shrink's 16 lanes), "b"
    only v of qkv and ffn_out, "c" only attn_out; only_c: "c" alone in the batch (three GEMMs without a LoraSlot)."""
    a = {"qkv": _pair(g, 4, 3 * H, runs=3), "attn_out": _pair(g, 8, H), "ffn_in": _pair(g, 20, INTER),
         "ffn_out": _pair(g, 6, H, k=INTER)}
    b = {"qkv": _pair(g, 5, 3 * H, runs=3, used=(2,)), "ffn_out": _pair(g, 3, H, k=INTER)}
    c = {"attn_out": _pair(g, 16, H)}
    return {name: Adapter(name, [slots]) for name, slots in (("a", a), ("b", b), ("c", c))
            if not only_c or name == "c"}


def _whole(backend, x, layer, lora, cu, scale, carry=None):
    """The layer run whole with the rows' adapters (asserted to be `_C.Layer` handed each GEMM's LoraSlot or None)."""
    with native_layer_calls(backend) as calls:
        run = backend.whole_layer(x, layer, lora=lora)
        out = run(x, cu, int((cu[1:] - cu[:-1]).max()), scale, None, carry)
    assert len(calls) == 1 and calls[0] is not None and len(calls[0]) == 4
    return out, [s is not None for s in calls[0]]


def _layer(dtype):
    from bertfast.backends.cpu.backend import CpuBackend
    from bertfast.tools.validate.cases import random_weights, tiny_config

    quantize, dtype = ("int8", torch.float32) if dtype == "int8" else (None, dtype)
    cfg = tiny_config(H, HEADS, INTER)
    backend = CpuBackend(quantize=quantize)
    weights = backend.prepare(random_weights(cfg, torch.Generator().manual_seed(0)).to(dtype=dtype))
    return backend, weights, cfg


@pytest.mark.parametrize("only_c", [False, True], ids=["mixed", "one-gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"], ids=["fp32", "bf16", "int8"])
def test_layer_with_adapters_equals_composed(dtype, only_c, isa):
    backend, weights, cfg = _layer(dtype)
    layer = weights.layers[0]
    g = torch.Generator().manual_seed(1)
    packed = {name: pack_adapter(a, weights, backend.pack_lora) for name, a in _adapters(g, only_c).items()}
    rows = [r if r is None or r in packed else None for r in ROWS]
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    view = RowAdapters([packed.get(r) for r in rows], cu, "cpu").layer(backend, 0)
    x = torch.randn(int(cu[-1]), H, generator=g)
    scale = cfg.head_dim ** -0.5
    args = (cu, max(LENGTHS), HEADS, scale, cfg.layer_norm_eps, cfg.activation)
    whole, slots = _whole(backend, x, layer, view, cu, scale)
    assert slots == [not only_c, True, not only_c, not only_c]
    assert torch.equal(whole, compose_layer(backend, x, layer, *args, lora=view))
    base = backend.whole_layer(x, layer)(x, cu, max(LENGTHS), scale, None)
    for i, (r, t0, t1) in enumerate(zip(rows, cu[:-1].tolist(), cu[1:].tolist())):
        assert torch.equal(whole[t0:t1], base[t0:t1]) == (r is None), f"row {i} ({r})"
        one_cu = torch.tensor([0, t1 - t0], dtype=torch.int32)
        alone = RowAdapters([packed.get(r)], one_cu, "cpu").layer(backend, 0)
        if r is None:
            continue  # a forward without adapters: no lora at all
        assert torch.equal(_whole(backend, x[t0:t1], layer, alone, one_cu, scale)[0], whole[t0:t1]), \
            f"row {i} ({r}) differs alone"
    if dtype != "int8":
        return
    # The next layer's QKV codes carried from this one's output: its shrink still reads that output in fp32.
    carry = backend.layer_carry()
    y = _whole(backend, x, layer, view, cu, scale, carry)[0]
    assert torch.equal(y, whole) and carry.codes is not None
    carried = _whole(backend, y, layer, view, cu, scale, carry)[0]
    assert torch.equal(carried, compose_layer(backend, y, layer, *args, lora=view))


def _slots_call(backend, x, layer, lora, cu, scale):
    """The layer run whole with the rows' adapters, and the `_C.LoraSlot`s it was handed."""
    with native_layer_calls(backend) as calls:
        out = backend.whole_layer(x, layer, lora=lora)(x, cu, int((cu[1:] - cu[:-1]).max()), scale, None)
    return out, calls[0]


@pytest.mark.parametrize("dtype", [torch.float32, "int8"], ids=["fp32", "int8"])
def test_slots_kept_for_the_same_adapters(dtype):
    """The LoraSlots of a set of adapters are built once and handed to every later forward of the same set (in the
    same order) with that forward's own rows' index: the same tokens on other rows equal the layer composed op by op;
    another order is another set. Unloaded (the packed adapters freed), their factors go with them."""
    import gc
    import weakref

    backend, weights, cfg = _layer(dtype)
    layer, scale = weights.layers[0], cfg.head_dim ** -0.5
    g = torch.Generator().manual_seed(3)
    packed = {name: pack_adapter(a, weights, backend.pack_lora) for name, a in _adapters(g, False).items()}
    x = torch.randn(21, H, generator=g)
    outs, slots = [], []
    for rows, lengths in ((["a", "b", "a"], [5, 7, 9]), (["a", "b", "b"], [9, 7, 5]), (["b", "a"], [9, 12])):
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        view = RowAdapters([packed[r] for r in rows], cu, "cpu").layer(backend, 0)
        out, handed = _slots_call(backend, x, layer, view, cu, scale)
        composed = compose_layer(backend, x, layer, cu, max(lengths), HEADS, scale, cfg.layer_norm_eps,
                                 cfg.activation, lora=view)
        assert torch.equal(out, composed), rows
        outs.append(out)
        slots.append(handed)
    assert all(a is b for a, b in zip(slots[0], slots[1]))
    assert not any(a is b for a, b in zip(slots[0], slots[2]) if a is not None)
    assert not torch.equal(outs[0], outs[1])
    ffn_in = packed["a"].layers[0]["ffn_in"]
    factor = weakref.ref(ffn_in.at if ffn_in.at is not None else ffn_in.tiles)  # tiles: an int8 engine on an amx tier
    del ffn_in
    del packed, view, slots, handed
    gc.collect()
    assert factor() is None


def test_slots_follow_the_tier():
    """A bf16 layer's adapters packed on amx_emulated keep their tile forms: the slots built on that tier shrink on the
    tiles and are kept for it; a forward on another tier gets slots of its own (fp32 forms unpacked, not kept), equal
    to the ops composed there."""
    from bertfast.backends.cpu import isa as isa_module
    from helpers.caps import on_cap

    if isa_module.unsupported("amx_emulated") is not None:
        pytest.skip(isa_module.unsupported("amx_emulated"))
    backend, weights, cfg = _layer(torch.bfloat16)
    layer, scale = weights.layers[0], cfg.head_dim ** -0.5
    g = torch.Generator().manual_seed(4)
    with on_cap("amx_emulated"):
        packed = {name: pack_adapter(a, weights, backend.pack_lora) for name, a in _adapters(g, False).items()}
    cu = torch.tensor([0, 7, 19], dtype=torch.int32)
    x = torch.randn(19, H, generator=g)
    args = (cu, 12, HEADS, scale, cfg.layer_norm_eps, cfg.activation)

    def forward():  # a forward's own RowAdapters, as the engine makes one per forward
        view = RowAdapters([packed["a"], packed["b"]], cu, "cpu").layer(backend, 0)
        out, slots = _slots_call(backend, x, layer, view, cu, scale)
        return out, view, slots

    with on_cap("amx_emulated"):
        tiles, _, tile_slots = forward()
    with on_cap("avx512_vnni-nobf16"):  # a tier without tiles on every CPU amx_emulated runs on
        plain, view, plain_slots = forward()
        assert torch.equal(plain, compose_layer(backend, x, layer, *args, lora=view))
        # fp32 forms unpacked from the tile forms are copies: built for each forward, never kept
        assert not any(a is b for a, b in zip(plain_slots, forward()[2]) if a is not None)
    assert not torch.equal(tiles, plain)
    with on_cap("amx_emulated"):
        again, _, kept = forward()
    assert torch.equal(again, tiles) and all(a is b for a, b in zip(tile_slots, kept))


def test_lora_slot_errors():
    from bertfast import _C
    from bertfast.backends.cpu import lora

    backend, weights, cfg = _layer(torch.float32)
    whole = backend._whole[id(weights.layers[0])]
    g = torch.Generator().manual_seed(2)
    f = lora.pack_factors(*_pair(g, 4, H), 1)
    index = torch.tensor([0, -1, 0], dtype=torch.int32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    x = torch.randn(3, H, generator=g)
    slot = _C.LoraSlot(index, [f.at], [f.bt], [f.seg], f.width)  # attn_out's factors; row 1 without
    out, base = whole(x, cu, 3, 0.125, lora=[None, slot, None, None]), whole(x, cu, 3, 0.125)
    assert torch.equal(out[1], base[1]) and not torch.equal(out[0], base[0])
    with pytest.raises(ValueError, match="one LoraSlot or None per GEMM"):
        whole(x, cu, 3, 0.125, lora=[slot])
    with pytest.raises(ValueError, match="columns but the output has 288"):  # attn_out's factors on qkv
        whole(x, cu, 3, 0.125, lora=[slot, None, None, None])
    with pytest.raises(ValueError, match="features"):  # attn_out's factors on ffn_out (K = 384)
        whole(x, cu, 3, 0.125, lora=[None, None, None, slot])
    with pytest.raises(ValueError, match="lora has 3 rows but x has 2"):
        whole(x[:2], torch.tensor([0, 2], dtype=torch.int32), 2, 0.125, lora=[None, slot, None, None])
    with pytest.raises(ValueError, match="out of range"):
        _C.LoraSlot(torch.tensor([1], dtype=torch.int32), [f.at], [f.bt], [f.seg], f.width)
    # A kept slot takes the call's rows' index instead of its own: checked the same way.
    empty = _C.LoraSlot(torch.empty(0, dtype=torch.int32), [f.at], [f.bt], [f.seg], f.width)
    assert torch.equal(whole(x, cu, 3, 0.125, lora=[None, empty, None, None], lora_index=[None, index, None, None]),
                       out)
    with pytest.raises(ValueError, match="one index or None per GEMM"):
        whole(x, cu, 3, 0.125, lora=[None, empty, None, None], lora_index=[index])
    with pytest.raises(ValueError, match="out of range"):
        whole(x, cu, 3, 0.125, lora=[None, empty, None, None], lora_index=[None, index + 1, None, None])
    with pytest.raises(ValueError, match="lora has 0 rows but x has 3"):
        whole(x, cu, 3, 0.125, lora=[None, empty, None, None])
    with pytest.raises(ValueError, match=r"one at \(or tiles\) per seg"):
        _C.LoraSlot(index, [f.at, f.at], [f.bt], [f.seg], f.width)
    with pytest.raises(ValueError, match="does not fit s of rank"):  # ranks past the factor's own
        _C.LoraSlot(index, [f.at[:, :0].contiguous()], [f.bt], [f.seg], f.width)
