"""The LoRA shrink on AMX tiles (csrc/cpu/gemm/lora_amx.cpp): a bf16 or int8 engine's adapters packed on an AMX tier
keep A^T in tile form (hi and lo bf16 halves) and shrink on the tiles, checked on the amx_emulated tier (any AVX-512
VNNI CPU) and, where the CPU has them, the amx tier.

- s within 2^-15 of the fp32 shrink (max over max), fp32 and bf16 inputs, K a multiple of 32 and not, ranks under
  16, at it, past it and past three rank groups; each row's bits alone as in a batch of runs longer than a 16-row
  block, base rows zero; a tier without tiles ignores the tile form (the fp32 shrink's bits).
- Engines: bf16 and int8 pack the tile form on the amx tiers, fp32 never, nor any with BERTFAST_LORA_TILES=0; the
  bf16 engine on the tiles within twice PEFT's own bf16 error, int8 as accurate as its fp32 shrink.
(Rows alone against a 481-token mixed batch on amx_emulated, whole layers against the ops: test_adapters_forward.py.)
"""

from __future__ import annotations

import warnings

import pytest
import torch

from bertfast import Encoder
from bertfast.accuracy import within
from bertfast.backends import available_backends
from bertfast.backends.cpu import isa as isa_module
from conftest import rel_err
from helpers import families
from helpers.adapters import CASES, peft_names, save_lora
from helpers.caps import on_cap

CPU_REASON = available_backends("cpu").get("cpu")
pytestmark = pytest.mark.skipif(CPU_REASON is not None, reason=f"backend 'cpu' unavailable: {CPU_REASON}")

AMX_TIERS = ["amx_emulated", "amx"]


def _tier(tier):
    if isa_module.unsupported(tier) is not None:
        pytest.skip(isa_module.unsupported(tier))


def _factors(K, ranks, seed=0):
    """Per rank, the factors packed for the fp32 shrink and for the tiles, from the same A and B."""
    from bertfast.backends.cpu import lora
    g = torch.Generator().manual_seed(seed)
    pairs = [(torch.randn(r, K, generator=g) * 0.1, torch.randn(64, r, generator=g)) for r in ranks]
    return ([lora.pack_factors(A, B, 1) for A, B in pairs],
            [lora.pack_factors(A, B, 1, tiles=True) for A, B in pairs])


@pytest.mark.parametrize("tier", AMX_TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-x", "bf16-x"])
@pytest.mark.parametrize("K", [40, 768])
def test_shrink_on_tiles(K, dtype, tier):
    from bertfast.backends.cpu.ext import _C
    _tier(tier)
    plain, packed = _factors(K, (4, 16, 21, 70))  # 70: R 80, two passes of three rank groups
    assert all(f.at is None for f in packed)  # the tile form instead of A^T: the adapter's own size
    M = 90
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    index = (torch.arange(M, dtype=torch.int32) // 20 + 1) % 5 - 1  # runs of 20 rows: past a 16-row block
    tiles = [f.tiles for f in packed]
    fp32 = _C.lora_shrink(x, index, [f.at for f in plain])
    with on_cap(tier):
        s = _C.lora_shrink(x, index, [], tiles)
        alone = torch.cat([_C.lora_shrink(x[m:m + 1], index[m:m + 1], [], tiles) for m in range(M)])
        both = _C.lora_shrink(x, index, [f.at for f in plain], tiles)
    err = ((s - fp32).abs().max() / fp32.abs().max()).item()
    assert 0 < err <= 2 ** -15, err  # 0: the fp32 shrink ran, not the tiles
    assert torch.equal(alone, s) and torch.equal(both, s)
    assert torch.equal(s[index < 0], torch.zeros_like(s[index < 0]))


def test_tile_form_without_tiles():
    """A tier without tiles: given A^T too, the tile form is ignored (the fp32 shrink's bits); given only the tile
    form, the native shrink refuses, and the backend's term shrinks A^T unpacked from it (hi + lo)."""
    from bertfast.backends.cpu import lora
    from bertfast.backends.cpu.ext import _C
    _tier("avx2")
    plain, packed = _factors(64, (8, 16))
    x = torch.randn(20, 64)
    index = torch.tensor([0] * 9 + [-1] + [1] * 10, dtype=torch.int32)
    with on_cap("avx2"):
        fp32 = _C.lora_shrink(x, index, [f.at for f in plain])
        assert torch.equal(_C.lora_shrink(x, index, [f.at for f in plain], [f.tiles for f in packed]), fp32)
        with pytest.raises(ValueError, match="only in tile form, which only the amx tiers shrink"):
            _C.lora_shrink(x, index, [], [f.tiles for f in packed])
        unpacked = _C.lora_shrink(x, index, [f.at_fp32() for f in packed])
        term = lora.term(x, index, packed)  # a LoraTerm: its shrink is `unpacked`'s
    assert term is not None and (unpacked - fp32).abs().max() <= 2 ** -15 * fp32.abs().max()
    for a, b in zip(packed, plain):
        assert (a.at_fp32() - b.at).abs().max() <= 2 ** -16 * b.at.abs().max()


def test_tile_form_checked():
    from bertfast.backends.cpu.ext import _C
    _, packed = _factors(64, (16,))
    tiles = packed[0].tiles
    x, index = torch.randn(3, 64), torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"lora tiles 0 must be contiguous bfloat16 \(1, 2, 2, 16, 16, 2\)"):
        _C.lora_shrink(x, index, [packed[0].at_fp32()], [tiles[:, :1].contiguous()])
    with pytest.raises(ValueError, match="one tiles per at"):
        _C.lora_shrink(x, index, [packed[0].at_fp32()] * 2, [tiles])
    with pytest.raises(ValueError, match="lora tiles 0 must be"):
        _C.LoraSlot(index, [], [packed[0].bt], [packed[0].seg], packed[0].width, [tiles.flatten()])


LENGTHS = [7, 1, 40, 5, 19, 3, 11]
ROWS = ["a", None, "b", "a", "b", None, "a"]


@pytest.fixture(scope="module")
def bert_peft(tmp_path_factory):
    model = CASES["bert"][0]()
    root = tmp_path_factory.mktemp("tiles")
    pm = save_lora(model, root / "a", seed=0, r=8, lora_alpha=16, target_modules=CASES["bert"][1])
    save_lora(model, root / "b", seed=1, r=16, lora_alpha=16, target_modules=CASES["bert"][1])
    pm.load_adapter(root / "b", adapter_name="b")
    return model, pm.eval(), root


def _encoder(model, root, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 measured slower on some tiers
        enc = Encoder.from_hf(model, backend="cpu", dtype=dtype)
    for name in ("a", "b"):
        enc.load_adapter(name, root / name)
    return enc


def _slot_tiles(enc):
    adapter = enc._adapters["a"]
    return [f.tiles is not None for layer in adapter.layers for f in layer.values()]


@pytest.mark.parametrize("tier", AMX_TIERS)
def test_engines_on_tiles(tier, bert_peft, monkeypatch):
    _tier(tier)
    model, pm, root = bert_peft
    kwargs, mask = families.batch_for(model, LENGTHS, seed=2)
    names = peft_names(["default" if r == "a" else r for r in ROWS])
    with torch.no_grad():
        ref = pm(**kwargs, adapter_names=names).last_hidden_state
        low = pm.to(torch.bfloat16)(**kwargs, adapter_names=names).last_hidden_state
        pm.float()
    with on_cap(tier):
        assert not any(_slot_tiles(_encoder(model, root, torch.float32)))
        bf16 = _encoder(model, root, torch.bfloat16)
        assert all(_slot_tiles(bf16))
        ours = rel_err(bf16(**kwargs, adapter_ids=ROWS).last_hidden_state, ref, mask)
        int8 = {}
        for tiles in ("1", "0"):
            monkeypatch.setenv("BERTFAST_LORA_TILES", tiles)
            enc = _encoder(model, root, "int8")
            assert all(_slot_tiles(enc)) == (tiles == "1") and any(_slot_tiles(enc)) == (tiles == "1")
            int8[tiles] = rel_err(enc(**kwargs, adapter_ids=ROWS).last_hidden_state, ref, mask)
    theirs = rel_err(low, ref, mask)
    assert within(ours, theirs, torch.bfloat16, floor=0.0, cap=False), f"bf16 {ours:.3g} vs PEFT bf16 {theirs:.3g}"
    assert int8["1"] <= 1.1 * int8["0"], int8
