"""The AMX tile kernels against the Intel SDM: on the amx_emulated tier (the tile instructions emulated, any CPU
with AVX-512 VNNI) and on the amx tier (the hardware) alike.

The bf16 GEMM (linear_amx.cpp's kernel) against a model of TDPBF16PS written here from the SDM's pseudo-code, bit
for bit: per 32-wide K step and output row, the even and the odd bf16 products each summed over the step's 16
pairs in an fp32 chain of their own, the two chains added, then added to the accumulator; bf16 denormal inputs read
as zero. On amx_emulated this checks the kernel and the emulation; on amx, that the hardware sums as the SDM says
(docs/tiers.md#amx_emulated: where that fails, the emulation's bf16 bits are not the hardware's). The shapes cross
every tile edge of the kernel: 16-row blocks and their tails, 48-column panels of three 16-column tiles and a short
last panel, one to five K steps. The model-level tests (test_tiers.py, test_embed.py, ...) run both tiers through
the `isa` fixture like every other.

SPLADE's pooled vocabulary GEMM (sparse_pool_amx.cpp) against the same model (its accuracy and invariance:
test_splade.py).

The attention (attention_amx.cpp's kernel) with ModernBERT's sliding window and MPNet's / DeBERTa-v2's position bias:
against the eager reference at lengths and windows crossing the kernel's 16-row query blocks, 64-key blocks and
16-key score tiles; a sequence alone equal to itself inside a batch, bit for bit; and the tiles, not the fp32-math
tiers, running it: with V one-hot, each output is the probability P V read, and the kernel rounds P to bf16.

DeBERTa-v2's position scores (disentangled_amx.cpp) against the fp64 reference and the SDM model, bit for bit, at
lengths 1, 17, 129, head dims 32 and 64 and position rows past 48-column panels; a sequence alone equal to itself
inside a 330-token batch, with and without windows.
"""

from __future__ import annotations

import math

import pytest
import torch

from bertfast import disentangled, reference
from bertfast.backends import AttentionBias, DisentangledBias
from bertfast.backends.cpu import isa as isa_module
from helpers.cpu_ops import check, qkv_views

_C = pytest.importorskip("bertfast._C")


def _daz(t: torch.Tensor) -> torch.Tensor:
    """bf16 denormals read as zero (TDPBF16PS's DAZ), the rest unchanged; in fp32."""
    f = t.float()
    return torch.where(f.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(f), f)


def tdpbf16ps_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) bf16 times w (N, K) bf16 transposed, K a multiple of 32, as AMX tiles accumulate it: fp32 (M, N).
    A product of two bf16 is exact in fp32, so each `chain + a * b` is the SDM's FMA, rounded once."""
    a, b = _daz(x), _daz(w)
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k0 in range(0, x.shape[1], 32):
        even, odd = torch.zeros_like(acc), torch.zeros_like(acc)
        for p in range(16):
            ke, ko = k0 + 2 * p, k0 + 2 * p + 1
            even = even + a[:, ke, None] * b[None, :, ke]
            odd = odd + a[:, ko, None] * b[None, :, ko]
        acc = acc + (even + odd)
    return acc


def sequential_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same products summed into the accumulator one by one along K (the Intrinsics Guide's older text)."""
    a, b = _daz(x), _daz(w)
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        acc = acc + a[:, k, None] * b[None, :, k]
    return acc


def cancelling(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (m, k), w (n, k) in bf16 whose second half of K cancels the first to ~1%: the fp32 roundings of the
    order of summation show through the bf16 output, so a test on them tells orders apart."""
    g = torch.Generator().manual_seed(seed)
    h = k // 2
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    x[:, h:] = x[:, :h]
    w[:, h:] = -w[:, :h] * (1 + 0.01 * torch.randn(n, h, generator=g))
    return x.to(torch.bfloat16), w.to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 15, 16, 17, 47], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("n,k", [(16, 32), (47, 64), (48, 160), (49, 96), (100, 32)],
                         ids=lambda v: str(v))
def test_bf16_gemm_is_the_sdm_tdpbf16ps(tiles, m, n, k):
    x, w = cancelling(m, n, k, seed=m * 1000 + n * 10 + k)
    x[0, :3] = torch.tensor([1e-39, -3e-40, 5e-39]).to(torch.bfloat16)  # denormals: read as zero
    ours = _C.linear(x, _C.pack_linear(w), n, None, "none", None)
    assert torch.equal(ours, tdpbf16ps_model(x, w).to(torch.bfloat16))


def test_the_order_shows():
    """On the cancelling inputs the SDM's two chains and a sequential sum give different bf16 outputs: the test
    above tells them apart."""
    x, w = cancelling(47, 49, 96, seed=47 * 1000 + 49 * 10 + 96)
    assert not torch.equal(tdpbf16ps_model(x, w).to(torch.bfloat16), sequential_model(x, w).to(torch.bfloat16))


def test_bf16_gemm_epilogue_on_the_tile_sums(tiles):
    """bias, GELU and residual applied to the fp32 tile sums, rounded once: the other tiers' epilogue."""
    g = torch.Generator().manual_seed(3)
    m, n, k = 33, 50, 64
    x, w = torch.randn(m, k, generator=g).to(torch.bfloat16), torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias, res = torch.randn(n, generator=g).to(torch.bfloat16), torch.randn(m, n, generator=g).to(torch.bfloat16)
    ours = _C.linear(x, _C.pack_linear(w), n, bias, "none", res)
    assert torch.equal(ours, (tdpbf16ps_model(x, w) + bias.float() + res.float()).to(torch.bfloat16))


def test_k_not_a_multiple_of_32_leaves_the_tiles(tiles):
    """K % 32 != 0 runs the AVX-512 BF16 kernel, as on amx (the tiles step K by 32): the avx512_vnni tier's bits."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(20, 40, generator=g).to(torch.bfloat16), torch.randn(30, 40, generator=g).to(torch.bfloat16)
    before = _C.isa()
    ours = _C.linear(x, _C.pack_linear(w), 30, None, "none", None)
    assert _C.set_isa("avx512_vnni")
    try:
        assert torch.equal(ours, _C.linear(x, _C.pack_linear(w), 30, None, "none", None))
    finally:
        _C.set_isa(before)


def test_tiles_are_not_the_avx512_kernel(tiles):
    """The tier runs the tile kernel, not a fallback: where K allows tiles its sums are the SDM's, not the
    AVX-512 BF16 kernel's (one running sum over pairs)."""
    x, w = cancelling(40, 64, 256, seed=5)
    tiles = _C.linear(x, _C.pack_linear(w), 64, None, "none", None)
    before = _C.isa()
    assert _C.set_isa("avx512_vnni")
    try:
        streamed = _C.linear(x, _C.pack_linear(w), 64, None, "none", None)
    finally:
        _C.set_isa(before)
    assert torch.equal(tiles, tdpbf16ps_model(x, w).to(torch.bfloat16)) and not torch.equal(tiles, streamed)


def test_sparse_pool_runs_on_the_tiles(tiles):
    """SPLADE's pooled vocabulary GEMM (sparse_pool_amx.cpp) sums on the tiles, not the widened fp32 kernels: on the
    cancelling inputs its max-pooled values are the SDM model's logits' (max per sequence, log1p(relu)) to the last
    bits of log1p, and the avx512_vnni tier's are not (measured: 1.1e-7 against 5.0e-5 relative)."""
    x, w = cancelling(40, 100, 256, seed=6)
    cu_seqlens = torch.tensor([0, 17, 40], dtype=torch.int32)
    packed = _C.pack_linear(w)
    ours = _C.sparse_pool(x, packed, 100, None, cu_seqlens)
    before = _C.isa()
    assert _C.set_isa("avx512_vnni")
    try:
        widened = _C.sparse_pool(x, packed, 100, None, cu_seqlens)
    finally:
        _C.set_isa(before)
    logits = tdpbf16ps_model(x, w)
    model = torch.stack([logits[:17].amax(0), logits[17:].amax(0)]).relu().log1p()
    assert torch.allclose(ours, model, rtol=1e-6, atol=0)
    assert not torch.allclose(widened, model, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------
# Attention: query blocks of 16 rows, key blocks of 64 keys in four 16-key score tiles (attention_amx.cpp)

ATTENTION_CASES = [  # (lengths, heads, head_dim, window)
    pytest.param([1], 1, 32, 1, id="L1-D32-W1"),
    pytest.param([1, 17, 15, 33], 2, 64, 5, id="L1.17.15.33-D64-W5"),  # window inside one 16-key tile
    pytest.param([130, 1, 65], 2, 32, 20, id="L130.1.65-D32-W20"),
    pytest.param([200, 64], 1, 64, 70, id="L200.64-D64-W70"),  # window past a 64-key block
    pytest.param([129, 3], 2, 26, 100, id="L129.3-D26-W100"),  # the short row's window reaches every key
    pytest.param([300], 1, 48, 16, id="L300-D48-W16"),
]
PRODUCTS = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32-bf16-products")]


def _mpnet_bias(lengths, heads, gen):
    """MPNet's table (heads, 2 * width - 1) and positions starting anywhere in [0, 3] per sequence."""
    width = max(lengths) + 3
    positions = torch.cat([torch.arange(n) + i % 4 for i, n in enumerate(lengths)]).to(torch.int32)
    return AttentionBias(torch.randn(heads, 2 * width - 1, generator=gen) * 2, positions)


@pytest.mark.parametrize("dtype", PRODUCTS)
@pytest.mark.parametrize("terms", ["window", "bias", "window+bias"])
@pytest.mark.parametrize("lengths,heads,d,window", ATTENTION_CASES)
def test_attention_window_and_bias(tiles, dtype, terms, lengths, heads, d, window):
    """Ragged q, k, v (strided views of one fused buffer) vs reference.attention_loop in fp64; bf16 products on
    bf16 inputs or on fp32 ones (the int8 path), within bf16 attention's error."""
    gen = torch.Generator().manual_seed(sum(lengths) + d + window)
    (q, k, v), low, cu = qkv_views(lengths, heads, d, torch.bfloat16, gen)
    window = window if "window" in terms else 0
    bias = _mpnet_bias(lengths, heads, gen) if "bias" in terms else None
    scale = 1.0 / math.sqrt(d)
    args = dict(window=window, bf16_products=dtype == torch.float32)
    if bias is not None:
        args.update(bias_table=bias.table, bias_positions=bias.positions)
    ours = _C.attention(*(t.to(dtype) for t in low), cu, max(lengths), scale, **args)
    assert ours.dtype == dtype and ours.shape == (sum(lengths), heads * d)
    bias_hi = None if bias is None else AttentionBias(bias.table.double(), bias.positions)
    ref_hi = reference.attention_loop(q, k, v, cu, scale, bias_hi, window)
    ref_low = reference.attention(*low, cu, max(lengths), scale, bias, window)
    check(ours, ref_low, ref_hi, torch.bfloat16)


@pytest.mark.parametrize("dtype", PRODUCTS)
@pytest.mark.parametrize("terms", ["window", "mpnet", "window+mpnet", "deberta"])
def test_attention_row_alone_is_the_row_in_a_batch(tiles, dtype, terms):
    """Each sequence alone gives the bits it gives inside a batch of 1, 30, 177 (past two 64-key blocks), 5 and 64
    tokens: the kernel's blocking, window and bias depend on the sequence alone."""
    lengths, heads, d, window = [1, 30, 177, 5, 64], 2, 64, 24 if "window" in terms else 0
    gen = torch.Generator().manual_seed(12)
    _, (q, k, v), cu = qkv_views(lengths, heads, d, dtype, gen)
    T, bounds = sum(lengths), cu.tolist()
    positions = torch.cat([torch.arange(n) + i % 4 for i, n in enumerate(lengths)]).to(torch.int32)
    args = dict(window=window, bf16_products=dtype == torch.float32)
    if "mpnet" in terms:
        args.update(bias_table=torch.randn(heads, 2 * max(lengths) + 7, generator=gen), bias_positions=positions)
    if "deberta" in terms:
        cols = 2 * max(lengths) + 7
        args.update(c2p=torch.randn(T, heads, cols, generator=gen), p2c=torch.randn(T, heads, cols, generator=gen),
                    rel_index=torch.arange(cols, dtype=torch.int32), bias_positions=positions)
    batch = _C.attention(q, k, v, cu, max(lengths), 0.2, **args)
    for a, b in zip(bounds[:-1], bounds[1:]):
        part = {name: t[a:b] if name in ("bias_positions", "c2p", "p2c") else t for name, t in args.items()}
        alone = _C.attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a], dtype=torch.int32), b - a, 0.2, **part)
        assert torch.equal(batch[a:b], alone), f"the {b - a}-token row differs alone"


def _one_hot_probe(terms, seed=0):
    """One 60-token sequence (one key block), head_dim 64, V the identity: output (i, j) is P[i, j] / l[i] with P
    as the kernel multiplies it by V (fp32 inputs, bf16 products, so the fp32 output shows P's rounding). Returns
    the shares of row i's nonzero outputs whose ratio to the row's largest (P = 1) is a sum of two bf16 values (the
    tiles' P: hi + lo, each bf16; an fp32 P is one with probability ~0.24 at this tolerance) and is one bf16 value
    (P rounded to bf16 once, as torch's bf16 flash attention does), and whether every key outside a window got
    exactly 0."""
    L, d, window = 60, 64, 7 if "window" in terms else 0
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, L, 1, d, generator=gen).unbind(0)
    v = torch.eye(L, d).view(L, 1, d)
    positions = torch.arange(L, dtype=torch.int32)
    args = dict(window=window, bf16_products=True)
    if "mpnet" in terms:
        args.update(bias_table=torch.randn(1, 2 * L - 1, generator=gen), bias_positions=positions)
    if "deberta" in terms:
        args.update(c2p=torch.randn(L, 1, 2 * L - 1, generator=gen), p2c=torch.randn(L, 1, 2 * L - 1, generator=gen),
                    rel_index=torch.arange(2 * L - 1, dtype=torch.int32), bias_positions=positions)
    out = _C.attention(q, k, v, torch.tensor([0, L], dtype=torch.int32), L, 0.125, **args)[:, :L]
    ratio = out / out.max(dim=1, keepdim=True).values
    inside = ratio != 0
    hi = ratio.bfloat16().float()
    on_grid = (ratio - hi - (ratio - hi).bfloat16().float()).abs() <= 2.0**-22 * ratio
    on_bf16 = (ratio - hi).abs() <= 2.0**-22 * ratio
    distance = (torch.arange(L)[:, None] - torch.arange(L)[None, :]).abs()
    far = distance > window if window else torch.zeros(L, L, dtype=torch.bool)
    share = lambda grid: grid[inside].float().mean().item()  # noqa: E731
    return share(on_grid), share(on_bf16), bool((out[far] == 0).all())


@pytest.mark.parametrize("terms", ["window", "mpnet", "window+mpnet", "deberta"])
def test_attention_runs_on_the_tiles(tiles, terms):
    """With a window or a position bias the tiles run the call, not the fp32-math tiers: every probability P V
    read is the sum of two bf16 values (the kernel splits P in two bf16 parts for two tile products), the fp32-math
    tiers' are fp32. Not one bf16 value: P rounded to bf16 once moved BERT-base's bf16 error (max) from 4.6-4.9e-3
    to 5.1-5.3e-3 (docs/cpu-gemm.md#bf16-accuracy)."""
    on_grid, on_bf16, masked = _one_hot_probe(terms)
    assert on_grid == 1.0 and masked
    assert on_bf16 < 0.5, f"{on_bf16:.0%} of P is a bf16 value: P is rounded to bf16 before P V"
    before = _C.isa()
    assert _C.set_isa("avx512_vnni")
    try:
        fp32_on_grid, _, fp32_masked = _one_hot_probe(terms)
    finally:
        _C.set_isa(before)
    assert fp32_on_grid < 0.5 and fp32_masked, "the probe does not tell the tiles from the fp32-math tiers"


def test_attention_window_skips_far_keys(tiles):
    """The tiles skip what lies outside every row's window, not only mask it: with window 8, a NaN value at token
    500 reaches the query blocks of 16 rows that multiply its 32-key half of its 64-key block (464..527) and no
    others; a kernel skipping only whole key blocks would spread 0 * NaN to rows 432..463 too, one masking
    afterwards to every row."""
    T, window = 1000, 8
    gen = torch.Generator().manual_seed(2)
    q, k, v = (t.to(torch.bfloat16) for t in torch.randn(3, T, 1, 64, generator=gen).unbind(0))
    v[500] = float("nan")
    ours = _C.attention(q, k, v, torch.tensor([0, T], dtype=torch.int32), T, 0.25, window=window)
    far = torch.cat([torch.arange(0, 464), torch.arange(528, T)])
    assert torch.isfinite(ours[far]).all() and not torch.isfinite(ours[464:528]).all()
    clean = v.clone()
    clean[500] = 0.0
    cu = torch.tensor([0, T], dtype=torch.int32)
    ref_hi = reference.attention_loop(q.double(), k.double(), clean.double(), cu, 0.25, window=window)
    ref_low = reference.attention(q, k, clean, cu, T, 0.25, window=window)
    check(ours[far], ref_low[far], ref_hi[far], torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# DeBERTa-v2's position scores: per head x times the position rows, 48-column panels (disentangled_amx.cpp)

POSITION_CASES = [  # (lengths, heads, head_dim, position rows)
    pytest.param([1], 1, 32, 1, id="L1-D32-R1"),
    pytest.param([17], 2, 64, 47, id="L17-D64-R47"),
    pytest.param([129], 2, 32, 49, id="L129-D32-R49"),
    pytest.param([1, 17, 129], 3, 64, 257, id="L1.17.129-D64-R257"),
]


@pytest.mark.parametrize("lengths,heads,d,rows", POSITION_CASES)
def test_position_scores(tiles, lengths, heads, d, rows):
    """q (a strided view of the fused QKV) and pos in bf16 vs disentangled.tables in fp64, within twice the bf16
    reference's own error; and the tiles, not the widened fp32 kernels, ran it: the same bits as the SDM model of
    TDPBF16PS per head, times the scale."""
    gen = torch.Generator().manual_seed(sum(lengths) + d + rows)
    (q, _, _), (q_low, _, _), _ = qkv_views(lengths, heads, d, torch.bfloat16, gen)
    pos = torch.randn(rows, heads * d, generator=gen).to(torch.bfloat16)
    ours = _C.position_scores(q_low, pos, 0.125)
    ref_hi, _ = disentangled.tables(q, q, pos.double(), None, 0.125)
    ref_low = torch.einsum("thd,rhd->thr", q_low, pos.view(rows, heads, d)) * 0.125  # bf16 products and output
    check(ours, ref_low, ref_hi, torch.bfloat16)
    model = torch.stack([tdpbf16ps_model(q_low[:, h], pos.view(rows, heads, d)[:, h]) for h in range(heads)], 1)
    assert torch.equal(ours, model * 0.125)


def test_position_scores_run_on_the_tiles(tiles):
    """On cancelling inputs the tiles' scores are the SDM model's bit for bit and the avx512_vnni tier's are not."""
    x, w = cancelling(40, 100, 64, seed=7)
    ours = _C.position_scores(x.view(40, 1, 64), w, 1.0)[:, 0]
    before = _C.isa()
    assert _C.set_isa("avx512_vnni")
    try:
        widened = _C.position_scores(x.view(40, 1, 64), w, 1.0)[:, 0]
    finally:
        _C.set_isa(before)
    model = tdpbf16ps_model(x, w)
    assert torch.equal(ours, model) and not torch.equal(widened, model)


def _windows(lengths, rows):
    """Each token's columns [lo, hi) of a span of `rows` rows as `disentangled.token_windows` gives them: query t of a
    sequence of length n at position i reads distances i - (n - 1) .. i, shifted by half the span and clamped."""
    out = []
    for n in lengths:
        for i in range(n):
            lo, hi = max(0, rows // 2 + i - (n - 1)), min(rows, rows // 2 + i + 1)
            out.append((lo, max(lo, hi)))
    return torch.tensor(out, dtype=torch.int32).view(-1, 2)


def test_position_scores_row_alone_is_the_row_in_a_batch(tiles):
    """Each sequence alone gives the bits it gives inside a batch of 330 tokens (past five 64-token blocks and 48-
    column panels), with and without windows: an entry depends on its token and column only. Within its windows a
    token's entries equal the full table's."""
    lengths, heads, d, rows = [1, 30, 177, 5, 117], 2, 64, 250
    gen = torch.Generator().manual_seed(11)
    (_, k_low, _), _ = qkv_views(lengths, heads, d, torch.bfloat16, gen)[1:]
    pos = torch.randn(rows, heads * d, generator=gen).to(torch.bfloat16)
    win = _windows(lengths, rows)
    full = _C.position_scores(k_low, pos, 0.125)
    windowed = _C.position_scores(k_low, pos, 0.125, win)
    inside = torch.arange(rows)[None, :]
    inside = (inside >= win[:, :1]) & (inside < win[:, 1:])  # (T, rows)
    assert torch.equal(windowed.transpose(1, 2)[inside], full.transpose(1, 2)[inside])
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        assert torch.equal(_C.position_scores(k_low[part], pos, 0.125), full[part])
        alone = _C.position_scores(k_low[part], pos, 0.125, win[part]).transpose(1, 2)[inside[part]]
        assert torch.equal(alone, full[part].transpose(1, 2)[inside[part]])
        start += n


def _sdm_bf16(x: torch.Tensor) -> list[int]:
    """VCVTNEPS2BF16 per the SDM's convert_fp32_to_bfloat16, one float at a time in Python integers."""
    out = []
    for u in (x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist():
        exponent, top = u & 0x7F800000, u >> 16
        if exponent == 0:
            out.append(top & 0x8000)  # zero or denormal: a zero of its sign
        elif exponent == 0x7F800000:
            out.append(top | 0x40 if u & 0x7FFFFF else top)  # NaN made quiet; infinity as it is
        else:
            out.append(((u + 0x7FFF + (top & 1)) >> 16) & 0xFFFF)
    return out


def test_bf16_conversion_is_the_sdms():
    """The amx_emulated tier rounds fp32 to bf16 itself (a CPU without AVX-512 BF16 runs it): as the SDM says, and as
    VCVTNEPS2BF16 does where the CPU has it, on special values, ties, denormals, NaNs and random bits."""
    special = torch.tensor([0.0, -0.0, 1.0, 1.00390625, 1.01171875, -1.01171875, 3.3895e38, 3.4e38, math.inf,
                            -math.inf, math.nan, -math.nan, 1e-40, -1e-40, 1.1754944e-38, 1.1754942e-38, 6e-39],
                           dtype=torch.float32)
    bits = torch.randint(-2**31, 2**31, (4099,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    x = torch.cat([special, bits.to(torch.int32).view(torch.float32)])
    emulated, instruction = _C.testing.bf16_conversions(x)
    assert (emulated.to(torch.int64) & 0xFFFF).tolist() == _sdm_bf16(x)
    normal = x.isfinite() & (x.abs() >= torch.finfo(torch.float32).tiny)
    assert torch.equal(emulated[normal], x[normal].to(torch.bfloat16).view(torch.int16))  # torch's RNE there
    if instruction is not None:
        # The emulation models Intel's instruction (the amx tier's CPUs); on another vendor's AVX-512 BF16 only the
        # values every implementation rounds alike (normal numbers, zeros, infinities) are compared.
        intel = "Intel" in isa_module.proc_cpuinfo()[0]  # the model name: "Intel(R) Xeon(R) ...", "AMD EPYC ..."
        same = torch.ones_like(normal) if intel else normal | (x == 0) | x.isinf()
        assert torch.equal(emulated[same], instruction[same])
