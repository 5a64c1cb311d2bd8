"""LoRA on AMX tiles (csrc/cpu/gemm/lora_amx.cpp): a bf16 or int8 engine's adapters packed on an AMX tier keep A^T
and B in tile form (hi and lo bf16 halves) and compute the shrink and the epilogue's terms on the tiles, checked on
the amx_emulated tier (any AVX-512 VNNI CPU) and, where the CPU has them, the amx tier.

- s within 2^-15 of the fp32 shrink (max over max), fp32 and bf16 inputs, K a multiple of 32 and not, in one chunk
  of split steps and in several, ranks under 16, at it, past it and past three rank groups; each row's bits alone as
  in a batch of runs longer than a 16-row block, base rows zero; a tier without tiles ignores the tile form (the fp32
  shrink's bits).
- Expand: a linear's terms from A and B in tile form within 2^-14 of the fp32 shrink and epilogue, bf16 and int8,
  streaming and blocked AMX kernels, one and three runs of outputs (one without ranks), ranks over two 16-rank steps;
  rows alone as in the batch, base rows exactly the bias; the streaming and blocked kernels the same bits on 300 rows
  (blocks mixing factors, pairs on one); B's tile form refused by any other kernel.
- Engines: bf16 and int8 pack A^T's tile form on the amx tiers and B's where the slot's GEMM runs on the tiles, fp32
  never, nor any with BERTFAST_LORA_TILES=0; the bf16 engine within twice PEFT's own bf16 error, int8 as accurate
  as with the fp32 shrink and epilogue.
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
@pytest.mark.parametrize("K", [40, 768, 808])  # 808: split in chunks of 8 steps, the last of 2, 8 values in
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


@pytest.mark.parametrize("tier", AMX_TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, "int8"], ids=["bf16", "int8"])
@pytest.mark.parametrize("M", [5, 300], ids=["M5-stream", "M300-blocked"])
@pytest.mark.parametrize("segments, N", [(1, 70), (3, 96)], ids=["one-run", "three-runs"])
def test_expand_on_tiles(segments, N, M, dtype, tier):
    """With zero weights a linear's output is bias + term: the terms from the tiles (A and B in tile form) against
    the fp32 shrink and epilogue (fp32 outputs: int8, bf16 into an fp32 residual) within 2^-14 of the largest, in the
    streaming and the blocked AMX kernels; rows alone as in the batch; base rows exactly the bias. Ranks 4, 21 (two
    steps of 16) and 40, three runs with the middle one unadapted in one factor."""
    from bertfast.backends.cpu import linear as cpu_linear, lora, quant
    _tier(tier)
    g = torch.Generator().manual_seed(0)
    K = 64
    x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g).bfloat16().float()
    plain, packed = [], []
    for i, r in enumerate((4, 21, 40)):
        A, B = torch.randn(segments * r, K, generator=g) * 0.1, torch.zeros(N, segments * r)
        for s in range(segments):
            if not (i == 1 and s == 1):  # one run of one factor without ranks: its terms are zero
                B[s * N // segments:(s + 1) * N // segments, s * r:(s + 1) * r] = torch.randn(N // segments, r,
                                                                                             generator=g)
        plain.append(lora.pack_factors(A, B, segments))
        packed.append(lora.pack_factors(A, B, segments, tiles=True, expand=True))
    index = (torch.arange(M, dtype=torch.int32) // (2 if M < 20 else 7) + 1) % 4 - 1

    def run(factors, rows=slice(None)):
        xs, ix = x[rows], index[rows]
        term = lora.term(xs, ix, factors)
        if dtype == "int8":
            return quant.linear(xs, quant.QuantLinear.from_float(torch.zeros(N, K)), bias, "none", None, term)
        zero16 = cpu_linear.PackedLinear(torch.zeros(N, K).bfloat16())
        return cpu_linear.linear(xs.bfloat16(), zero16, bias.bfloat16(), "none", torch.zeros(len(ix), N), term)

    from bertfast import _C
    mode = _C.testing.amx_gemm()
    _C.testing.set_amx_gemm("stream" if M < 20 else "blocked")  # int8 would run blocked at every M in auto
    try:
        with on_cap(tier):
            ref, out = run(plain), run(packed)
            alone = torch.cat([run(packed, slice(m, m + 1)) for m in range(M)])
    finally:
        _C.testing.set_amx_gemm(mode)
    assert out.dtype == torch.float32 and torch.equal(alone, out)
    assert torch.equal(out[index < 0], bias.expand(M, N)[index < 0])
    err = ((out - ref).abs().max() / (ref - bias).abs().max()).item()
    assert 0 < err <= 2 ** -14, err


@pytest.mark.parametrize("tier", AMX_TIERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, "int8"], ids=["bf16", "int8"])
@pytest.mark.parametrize("run", [7, 40], ids=["mixed-blocks", "whole-pairs"])
def test_stream_and_blocked_terms_agree(run, dtype, tier):
    """The streaming and the blocked AMX kernels give a 300-row batch of three factors and base rows the same bits,
    in runs of 7 rows (every 16-row block mixes factors) and of 40 (most 32-row pairs on one factor: the blocked bf16
    kernel's fold_pair): bf16 folds the terms into its C tiles in both, int8 takes them from the epilogue's expand
    (streaming) and from the pair's tiles (blocked)."""
    from bertfast import _C
    from bertfast.backends.cpu import linear as cpu_linear, lora, quant
    _tier(tier)
    g = torch.Generator().manual_seed(3)
    M, K, N = 300, 128, 96
    x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    factors = [lora.pack_factors(torch.randn(3 * r, K, generator=g) * 0.1,
                                 torch.block_diag(*[torch.randn(N // 3, r, generator=g) for _ in range(3)]), 3,
                                 tiles=True, expand=True) for r in (4, 21, 16)]
    index = (torch.arange(M, dtype=torch.int32) // run + 1) % 4 - 1
    w = torch.randn(N, K, generator=g) * 0.05

    def run(term):
        if dtype == "int8":
            return quant.linear(x, quant.QuantLinear.from_float(w), bias, "none", None, term)
        return cpu_linear.linear(x.bfloat16(), cpu_linear.PackedLinear(w.bfloat16()), bias.bfloat16(), "none",
                                 torch.zeros(M, N), term)

    out = {}
    mode = _C.testing.amx_gemm()
    try:
        with on_cap(tier):
            for kernel in ("stream", "blocked"):
                _C.testing.set_amx_gemm(kernel)
                out[kernel] = run(lora.term(x, index, factors))
            plain = run(None)
    finally:
        _C.testing.set_amx_gemm(mode)
    assert torch.equal(out["stream"], out["blocked"])
    adapted = index >= 0
    assert torch.equal(out["blocked"][~adapted], plain[~adapted])
    assert (out["blocked"][adapted] != plain[adapted]).any(1).all()  # every adapted row took its term


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
        bt, seg = a.bt_fp32()
        assert torch.equal(seg, b.seg) and (bt - b.bt).abs().max() <= 2 ** -16 * b.bt.abs().max()


def test_b_tile_form_needs_an_amx_gemm():
    """B in tile form reaches only the AMX GEMMs: a LoraTerm holding it in a call that takes another kernel (a tier
    without tiles; an amx tier's bf16 GEMM with K % 32 != 0) is refused, not read as fp32."""
    from bertfast.backends.cpu import linear as cpu_linear, lora
    from bertfast.backends.cpu.ext import _C
    _tier("amx_emulated")
    for K, cap in ((64, "avx2"), (40, "amx_emulated")):
        g = torch.Generator().manual_seed(K)
        A, B = torch.randn(8, K, generator=g), torch.randn(32, 8, generator=g)
        f = lora.pack_factors(A, B, 1, expand=True)
        x, index = torch.randn(3, K, generator=g), torch.zeros(3, dtype=torch.int32)
        with on_cap(cap):
            term = _C.LoraTerm(_C.lora_shrink(x, index, [f.at]), index, [], [f.seg], f.width, [f.bt_tiles])
            with pytest.raises(ValueError, match="B in tile form needs an AMX GEMM"):
                cpu_linear.linear(x.bfloat16(), cpu_linear.PackedLinear(torch.zeros(32, K).bfloat16()), None, "none",
                                  None, term)


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


def _forms(enc):
    """Per slot of adapter "a" (the first layer's, then the pooler), which of A^T and B are in tile form."""
    adapter = enc._adapters["a"]
    return {name: (f.tiles is not None, f.bt_tiles is not None)
            for name, f in [*adapter.layers[0].items(), ("pooler", adapter.pooler)]}


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
        slots = ("qkv", "attn_out", "ffn_in", "ffn_out", "pooler")
        assert _forms(_encoder(model, root, torch.float32)) == dict.fromkeys(slots, (False, False))
        bf16 = _encoder(model, root, torch.bfloat16)
        assert _forms(bf16) == dict.fromkeys(slots, (True, True))  # every K (64, 96) a multiple of 32
        ours = rel_err(bf16(**kwargs, adapter_ids=ROWS).last_hidden_state, ref, mask)
        int8 = {}
        for tiles in ("1", "0"):
            monkeypatch.setenv("BERTFAST_LORA_TILES", tiles)
            enc = _encoder(model, root, "int8")
            # B in tile form where the int8 GEMM runs on the tiles: K % 64 == 0 (ffn_out's K is 96; the pooler: fp32)
            forms = {**dict.fromkeys(slots[:3], (True, True)), "ffn_out": (True, False), "pooler": (True, False)}
            assert _forms(enc) == (forms if tiles == "1" else dict.fromkeys(slots, (False, False)))
            int8[tiles] = rel_err(enc(**kwargs, adapter_ids=ROWS).last_hidden_state, ref, mask)
    theirs = rel_err(low, ref, mask)
    assert within(ours, theirs, torch.bfloat16, floor=0.0, cap=False), f"bf16 {ours:.3g} vs PEFT bf16 {theirs:.3g}"
    assert int8["1"] <= 1.1 * int8["0"], int8
