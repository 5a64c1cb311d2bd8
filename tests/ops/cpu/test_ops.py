"""Op-level tests of the native CPU kernels (`bertfast._C`) against `bertfast.reference`.

Every op runs on each ISA path the CPU has (AVX-512 and the portable fallback) in fp32 and bf16. Three
outputs per check: ours, the reference in the same dtype, the reference in fp64. fp32 must match fp64
to ~1e-5; bf16 must be no worse than twice the bf16 reference's own error plus a small floor. The C++
boundary must turn every bad input into a ValueError, never a crash.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bertfast import reference
from bertfast.backends.weights import EmbeddingWeights
from bertfast.accuracy import TABLE
from helpers.cpu_ops import DTYPES, check, qkv_views, rounded

try:
    from bertfast import _C
except ImportError:
    _C = None

pytestmark = pytest.mark.skipif(
    _C is None, reason="the native extension bertfast._C is not built (run bash install.sh)"
)


# ----------------------------------------------------------------------------------------------
# embed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden,types", [
    pytest.param(1, 32, 2, id="T1-H32"),
    pytest.param(37, 78, 2, id="T37-H78"),
    pytest.param(129, 384, 0, id="T129-H384-notypes"),
    pytest.param(70, 1025, 3, id="T70-H1025"),
])
def test_embed(isa, dtype, tokens, hidden, types):
    g = torch.Generator().manual_seed(tokens * hidden)
    vocab, max_pos = 50, 140
    tables = dict(
        word=torch.randn(vocab, hidden, generator=g, dtype=torch.float64),
        position=torch.randn(max_pos, hidden, generator=g, dtype=torch.float64) * 0.5,
        token_type=torch.randn(types, hidden, generator=g, dtype=torch.float64) if types else None,
        ln_weight=1 + 0.1 * torch.randn(hidden, generator=g, dtype=torch.float64),
        ln_bias=0.1 * torch.randn(hidden, generator=g, dtype=torch.float64),
    )
    tables = {k: rounded(v, dtype) for k, v in tables.items()}
    emb_hi = EmbeddingWeights(**tables)
    emb_low = EmbeddingWeights(**{k: None if v is None else v.to(dtype) for k, v in tables.items()})
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    pos = torch.randint(0, max_pos, (tokens,), generator=g)
    tt = torch.randint(0, types, (tokens,), generator=g) if types else None
    ours = _C.embeddings(ids, pos, tt, emb_low.word, emb_low.position, emb_low.token_type,
                    emb_low.ln_weight, emb_low.ln_bias, 1e-12)
    assert ours.dtype == dtype
    check(ours, reference.embeddings(ids, pos, tt, emb_low, 1e-12), reference.embeddings(ids, pos, tt, emb_hi, 1e-12), dtype)


@pytest.mark.parametrize("tokens,hidden,types,positioned", [
    pytest.param(1, 32, 2, True, id="T1-H32"),
    pytest.param(129, 384, 0, True, id="T129-H384-notypes"),
    pytest.param(70, 1025, 3, False, id="T70-H1025-nopositions"),
])
def test_embed_bf16_word_fp32_rest(isa, tokens, hidden, types, positioned):
    """A bf16 word table beside fp32 position / token type tables and LayerNorm (a bf16 forward's fp32 stream starts
    there: `STREAM_TENSORS`): fp32 out, as accurate as fp32 on those values."""
    g = torch.Generator().manual_seed(tokens + hidden)
    tables = dict(
        word=rounded(torch.randn(50, hidden, generator=g, dtype=torch.float64) + 2.0, torch.bfloat16),  # offset
        position=torch.randn(140, hidden, generator=g, dtype=torch.float64) * 0.5 if positioned else None,
        token_type=torch.randn(types, hidden, generator=g, dtype=torch.float64) if types else None,
        ln_weight=1 + 0.1 * torch.randn(hidden, generator=g, dtype=torch.float64),
        ln_bias=0.1 * torch.randn(hidden, generator=g, dtype=torch.float64),
    )
    emb_hi = EmbeddingWeights(**{k: rounded(t, torch.float32) for k, t in tables.items()})
    emb_32 = EmbeddingWeights(**{k: None if t is None else t.float() for k, t in vars(emb_hi).items()})
    ids = torch.randint(0, 50, (tokens,), generator=g)
    pos = torch.randint(0, 140, (tokens,), generator=g) if positioned else torch.arange(tokens)
    tt = torch.randint(0, types, (tokens,), generator=g) if types else None
    ours = _C.embeddings(ids, pos if positioned else None, tt, emb_32.word.bfloat16(), emb_32.position,
                         emb_32.token_type, emb_32.ln_weight, emb_32.ln_bias, 1e-12)
    assert ours.dtype == torch.float32
    check(ours, reference.embeddings(ids, pos, tt, emb_32, 1e-12), reference.embeddings(ids, pos, tt, emb_hi, 1e-12),
          torch.float32)


# ----------------------------------------------------------------------------------------------
# layernorm (+ residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [
    pytest.param(1, 1, id="T1-H1"),
    pytest.param(3, 31, id="T3-H31"),
    pytest.param(129, 384, id="T129-H384"),
    pytest.param(64, 1025, id="T64-H1025"),
    pytest.param(5, 100, id="T5-H100"),  # AVX-512: sums 4 vectors a step, then 3 more, the last partial
])
@pytest.mark.parametrize("fused", ["plain", "residual"])
def test_layernorm(isa, dtype, tokens, hidden, fused):
    g = torch.Generator().manual_seed(tokens + hidden)
    # Offset from zero: a one-pass E[x^2] - E[x]^2 would cancel here.
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64) + 300.0
    w = 1 + 0.1 * torch.randn(hidden, generator=g, dtype=torch.float64)
    b = 0.1 * torch.randn(hidden, generator=g, dtype=torch.float64)
    res = torch.randn(tokens, hidden, generator=g, dtype=torch.float64) if fused != "plain" else None
    x, w, b, res = (rounded(t, dtype) for t in (x, w, b, res))

    def ref(t):
        return reference.layernorm(x.to(t), w.to(t), b.to(t), 1e-12, None if res is None else res.to(t))

    low = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    ours = _C.layernorm(low(x), low(w), low(b), 1e-12, low(res))
    check(ours, ref(dtype), ref(torch.float64), dtype)


# ----------------------------------------------------------------------------------------------
# the GEMM epilogue's activations: x (tokens, 1) times a weight of ones is act(x + bias) column by column


def _act_linear(x, bias, act):
    """act(x[:, :1] * 1 + bias) through `_C.linear`: the epilogue's activation on exact inputs."""
    n = bias.shape[0] if bias is not None else 1
    return _C.linear(x, _C.pack_linear(torch.ones(n, 1, dtype=x.dtype)), n, bias, act)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "tanh"])
@pytest.mark.parametrize("tokens,features", [
    pytest.param(1, 7, id="T1-N7"),
    pytest.param(33, 3072, id="T33-N3072"),
    pytest.param(130, 129, id="T130-N129"),
])
def test_linear_activation(isa, dtype, act, tokens, features):
    g = torch.Generator().manual_seed(features)
    x = torch.randn(tokens, 1, generator=g, dtype=torch.float64) * 4  # tails up to ~|16| with the bias
    bias = torch.randn(features, generator=g, dtype=torch.float64)
    x, bias = rounded(x, dtype), rounded(bias, dtype)
    fn = torch.tanh if act == "tanh" else (lambda t: reference.activation(t, act))
    ours = _act_linear(x.to(dtype), bias.to(dtype), act)
    check(ours, fn(x.to(dtype) + bias.to(dtype)), fn(x + bias), dtype)


def test_gelu_same_bits_on_avx2_and_avx512():
    """The avx2 tier's GEMM epilogues run the AVX-512 erf-GELU's piecewise fit on 8 lanes (gelu_erf256, vec_math.h):
    the same operations, so the same bits, on a grid through every interval of the fit, past its end, at 0 and at
    NaN / +-inf, in the streaming and the many-row paths (docs/cpu-gemm.md#the-avx-512-erf-gelu)."""
    from bertfast.backends.cpu import isa as isa_module

    if isa_module.unsupported("avx512_vnni") is not None:
        pytest.skip("the CPU has no AVX-512 tier to compare with")
    x = torch.cat([torch.linspace(-12, 12, 20_001), torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0,
                                                                 -0.0, 5.657, -5.657, 1e-30])])[:, None]
    before = _C.isa()
    outs = {}
    try:
        for tier in ("avx512_vnni", "avx2"):
            assert _C.set_isa(tier)
            outs[tier] = [_act_linear(x, torch.zeros(16), "gelu"), _act_linear(x[:5].contiguous(), torch.zeros(16),
                                                                               "gelu")]
    finally:
        _C.set_isa(before)
    for wide, narrow in zip(outs["avx512_vnni"], outs["avx2"]):
        assert torch.equal(wide.nan_to_num(7.0), narrow.nan_to_num(7.0))
        assert torch.equal(wide.isnan(), narrow.isnan())
    assert torch.equal(outs["avx2"][1], outs["avx2"][0][:5])


def test_gelu_extremes(isa):
    x = torch.tensor([-1e4, -100.0, -20.0, -5.0, -1e-3, 0.0, 1e-30, 1e-3, 5.0, 20.0, 100.0, 1e4])[:, None]
    torch.testing.assert_close(_act_linear(x, None, "gelu"), F.gelu(x), atol=1e-6, rtol=1e-6)
    nan = _act_linear(torch.tensor([[float("nan")], [1.0]]), None, "gelu")
    assert math.isnan(nan[0, 0].item()) and not math.isnan(nan[1, 0].item())


# ----------------------------------------------------------------------------------------------
# GEMM on packed weights (`_C.linear`): up to 32 rows the streaming regime, more rows the blocked one
# (fp32 AVX-512; rows in blocks of up to 128 (kBlockRows), K in blocks of 192); on the portable tier fp32
# past 16 rows its own blocked regime (K in blocks of 128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [
    pytest.param(1, 5, 7, id="M1-N5-K7"),
    pytest.param(3, 48, 48, id="M3-N48-K48"),
    pytest.param(8, 97, 33, id="M8-N97-K33"),
    pytest.param(9, 130, 129, id="M9-N130-K129"),
    pytest.param(16, 384, 1536, id="M16-N384-K1536"),
    pytest.param(33, 200, 64, id="M33-N200-K64"),
    pytest.param(40, 100, 96, id="M40-N100-K96"),
    pytest.param(5, 50, 2049, id="M5-N50-K2049"),
    pytest.param(200, 100, 403, id="M200-N100-K403"),
    pytest.param(385, 49, 200, id="M385-N49-K200"),
])
@pytest.mark.parametrize("epilogue", ["bias", "gelu", "residual", "none"])
def test_linear(isa, dtype, m, n, k, epilogue):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / math.sqrt(k)
    bias = None if epilogue == "none" else torch.randn(n, generator=g, dtype=torch.float64)
    res = torch.randn(m, n, generator=g, dtype=torch.float64) if epilogue == "residual" else None
    act = "gelu" if epilogue == "gelu" else "none"
    x, w, bias, res = (rounded(t, dtype) for t in (x, w, bias, res))

    def ref(t):
        cast = lambda a: None if a is None else a.to(t)  # noqa: E731
        y = reference.linear(cast(x), cast(w), cast(bias))
        y = reference.activation(y, act) if act != "none" else y
        return y + cast(res) if res is not None else y

    low = lambda a: None if a is None else a.to(dtype)  # noqa: E731
    ours = _C.linear(low(x), _C.pack_linear(low(w)), n, low(bias), act, low(res))
    check(ours, ref(dtype), ref(torch.float64), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [6, 45])
def test_linear_strided_rows(isa, dtype, rows):
    """x may be a row-strided view (e.g. the CLS rows of a batch); K odd exercises the bf16 pair tail."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(rows, 2, 51, generator=g).to(dtype)
    x = big[:, 0, :]  # (rows, 51), row stride 102
    w = torch.randn(20, 51, generator=g).to(dtype)
    ours = _C.linear(x, _C.pack_linear(w), 20)
    expected = x.double() @ w.double().T
    torch.testing.assert_close(ours.double(), expected, atol=TABLE[dtype] * 4, rtol=TABLE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", list(range(1, 11)))
def test_linear_every_row_tile(isa, dtype, rows):
    """1..10 rows reach every register-tile shape of a pass and every leftover pass (AVX2: 1-2 fp32 rows,
    1-5 bf16 rows per pass); K = 259 odd and past one k block (128 steps or pairs), N = 100 ending in a
    partial panel, x a row-strided view, and the whole epilogue (bias, GELU, residual)."""
    g = torch.Generator().manual_seed(rows)
    n, k = 100, 259
    big = rounded(torch.randn(rows, 2 * k, generator=g, dtype=torch.float64), dtype)
    x, x_low = big[:, :k], big.to(dtype)[:, :k]  # x_low: row stride 2k
    w = rounded(torch.randn(n, k, generator=g, dtype=torch.float64) / math.sqrt(k), dtype)
    bias = rounded(torch.randn(n, generator=g, dtype=torch.float64), dtype)
    res = rounded(torch.randn(rows, n, generator=g, dtype=torch.float64), dtype)

    def ref(t):
        return F.gelu(reference.linear(x.to(t), w.to(t), bias.to(t))) + res.to(t)

    ours = _C.linear(x_low, _C.pack_linear(w.to(dtype)), n, bias.to(dtype), "gelu", res.to(dtype))
    check(ours, ref(dtype), ref(torch.float64), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("m", [12, 200])
def test_linear_threads_share_panels(isa, dtype, threads, m):
    """Streaming (12 rows): threads pair up on runs of panels and walk them from both ends (a lone last
    thread walks its run alone); blocked (200 rows): threads claim items of rows x panels. Either way
    every panel is computed exactly once, and bit-identically to a single thread's result."""
    g = torch.Generator().manual_seed(threads)
    n, k = 48 * 6 + 5, 640  # 7 panels, the last one partial
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    packed = _C.pack_linear(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _C.linear(x, packed, n, bias, "gelu")
        torch.set_num_threads(threads)
        shared = _C.linear(x, packed, n, bias, "gelu")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(shared, alone)
    expected = F.gelu(reference.linear(x.double(), w.double(), bias.double()))
    torch.testing.assert_close(shared.double(), expected, atol=TABLE[dtype] * 4, rtol=TABLE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("epilogue", ["gelu", "residual"])
def test_linear_row_independent_of_row_count(isa, epilogue, dtype):
    """A row's result does not depend on how many rows share the call, bit for bit: 1 and 7 rows stream,
    20 take the portable tier's fp32 blocked regime (past 16 rows), 40 and 300 the blocked regime of every
    tier that has one (fp32: AVX-512, portable; bf16: AVX-512 without AVX-512 BF16, operands widened); bf16
    elsewhere streams at every M. K = 403 spans several k blocks of every regime and has an odd pair; N = 100
    ends in a partial panel."""
    g = torch.Generator().manual_seed(11)
    n, k = 100, 403
    x = torch.randn(300, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    res = torch.randn(300, n, generator=g).to(dtype) if epilogue == "residual" else None
    act = "gelu" if epilogue == "gelu" else "none"
    packed = _C.pack_linear(w)
    full = _C.linear(x, packed, n, bias, act, res)
    for rows in (1, 7, 20, 40):
        part = _C.linear(x[:rows], packed, n, bias, act, None if res is None else res[:rows])
        assert torch.equal(part, full[:rows]), f"{rows} rows differ from the same rows among 300"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [7, 40, 300])
def test_linear_strided_view_same_bits(isa, dtype, rows):
    """The GEMM reads x's rows where they are (the blocked regime's tiles broadcast from them, no packed copy): a view
    whose rows are 2K + 7 apart and start 5 elements in gives the bits of its contiguous copy, in every regime (7 rows
    stream, 40 and 300 take the blocked regimes, 300 several 128-row items) and across k blocks (K = 403)."""
    g = torch.Generator().manual_seed(12)
    n, k = 100, 403
    big = torch.randn(rows, 2 * k + 7, generator=g).to(dtype)
    x = big[:, 5:5 + k]
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    res = torch.randn(rows, n, generator=g).to(dtype)
    packed = _C.pack_linear(w)
    strided = _C.linear(x, packed, n, bias, "gelu", res)
    assert torch.equal(strided, _C.linear(x.contiguous(), packed, n, bias, "gelu", res))


# ----------------------------------------------------------------------------------------------
# varlen attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths,heads,d", [
    pytest.param([1], 2, 32, id="L1-H2-D32"),
    pytest.param([127, 129, 1, 64], 2, 64, id="L127.129.1.64-H2-D64"),
    pytest.param([17, 0, 40], 3, 26, id="L17.0.40-H3-D26"),
    pytest.param([65, 33], 1, 80, id="L65.33-H1-D80"),
    pytest.param([200], 2, 128, id="L200-H2-D128"),
    pytest.param([513], 1, 13, id="L513-H1-D13"),
    # every remainder of 8- and 16-key chunks and of 4-row query tiles; head_dim a multiple of 8, not 16
    pytest.param([8, 9, 15, 16, 17, 23, 24, 25, 63, 66], 3, 40, id="L8..66-H3-D40"),
    pytest.param([3, 70], 2, 24, id="L3.70-H2-D24"),
])
def test_attention(isa, dtype, lengths, heads, d):
    gen = torch.Generator().manual_seed(sum(lengths) + d)
    (q, k, v), (ql, kl, vl), cu = qkv_views(lengths, heads, d, dtype, gen)
    scale = 1.0 / math.sqrt(d)
    ours = _C.attention(ql, kl, vl, cu, max(lengths), scale)
    assert ours.shape == (sum(lengths), heads * d) and ours.is_contiguous()
    ref_hi = reference.attention_loop(q, k, v, cu, scale)
    ref_low = reference.attention(ql, kl, vl, cu, max(lengths), scale)
    check(ours, ref_low, ref_hi, dtype)


@pytest.mark.parametrize("lengths,heads,d", [
    pytest.param([1], 2, 32, id="L1-H2-D32"),
    pytest.param([127, 129, 1, 64], 2, 64, id="L127.129.1.64-H2-D64"),
    pytest.param([17, 0, 40], 3, 26, id="L17.0.40-H3-D26"),
    pytest.param([65, 33], 1, 80, id="L65.33-H1-D80"),
    # the bf16 kernels' remainders: odd key counts (a key paired with zero), 16- and 8-key score tiles, one and
    # two 16-query vectors, several 64-key tiles; odd head_dim (a dim paired with zero), head_dim past 32
    pytest.param([8, 9, 15, 16, 17, 23, 24, 25, 63, 66], 3, 40, id="L8..66-H3-D40"),
    pytest.param([200, 3], 1, 13, id="L200.3-H1-D13"),
    pytest.param([31, 33, 130], 2, 64, id="L31.33.130-H2-D64"),
])
def test_attention_bf16_products_on_fp32_inputs(isa, lengths, heads, d):
    """fp32 q/k/v with bf16_products (the int8 path): fp32 output, within bf16 attention's error; exact fp32
    where the products stay fp32 (head_dim > 64, or a tier below avx512_vnni). avx512_vnni without AVX-512 BF16 runs
    them on int16 codes (test_attention_int16.py)."""
    gen = torch.Generator().manual_seed(sum(lengths) + d + 1)
    (q, k, v), (q32, k32, v32), cu = qkv_views(lengths, heads, d, torch.float32, gen)
    scale = 1.0 / math.sqrt(d)
    ours = _C.attention(q32, k32, v32, cu, max(lengths), scale, bf16_products=True)
    assert ours.dtype == torch.float32 and ours.shape == (sum(lengths), heads * d)
    ref_hi = reference.attention_loop(q, k, v, cu, scale)
    low = [t.to(torch.bfloat16) for t in (q32, k32, v32)]
    ref_low = reference.attention(*low, cu, max(lengths), scale)
    check(ours, ref_low, ref_hi, torch.bfloat16)
    exact = _C.attention(q32, k32, v32, cu, max(lengths), scale)
    if not (d <= 64 and (isa in ("amx", "amx_emulated") or _C.isa() == "avx512_vnni")):
        assert torch.equal(ours, exact)
    else:
        assert not torch.equal(ours, exact)  # the bf16 (or int16) products ran


@pytest.mark.parametrize("dtype,products", [
    pytest.param(torch.float32, False, id="fp32"),
    pytest.param(torch.bfloat16, False, id="bf16"),
    pytest.param(torch.float32, True, id="fp32-bf16-products"),
])
def test_attention_batch_invariant(isa, dtype, products):
    """A sequence alone gives bit-identical output to the same sequence inside a batch."""
    gen = torch.Generator().manual_seed(7)
    (_, _, _), (q, k, v), cu = qkv_views([30, 77, 5], 4, 32, dtype, gen)
    batch = _C.attention(q, k, v, cu, 77, 0.2, bf16_products=products)
    alone = _C.attention(q[30:107], k[30:107], v[30:107], torch.tensor([0, 77], dtype=torch.int32), 77, 0.2,
                         bf16_products=products)
    assert torch.equal(batch[30:107], alone)


@pytest.mark.parametrize("lengths,d", [
    pytest.param([12, 8], 16, id="L12.8-D16"),
    pytest.param([129, 3], 64, id="L129.3-D64"),
    pytest.param([70], 40, id="L70-D40"),
])
def test_attention_non_contiguous_heads(isa, lengths, d):
    """q/k/v with a head stride that is not head_dim (heads interleaved with another tensor)."""
    gen = torch.Generator().manual_seed(11)
    T = sum(lengths)
    base = torch.randn(3, T, 2, 4, d, generator=gen)  # (q|k|v, T, pair, heads, d)
    q, k, v = base[0, :, 1], base[1, :, 0], base[2, :, 1]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    ours = _C.attention(q, k, v, cu, max(lengths), 0.25)
    ref = reference.attention_loop(q.double(), k.double(), v.double(), cu, 0.25)
    torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# the C++ boundary: bad inputs raise ValueError, never crash


def _good_attention_args():
    qkv = torch.randn(10, 3, 2, 8)
    return [qkv[:, 0], qkv[:, 1], qkv[:, 2], torch.tensor([0, 4, 10], dtype=torch.int32), 6, 0.3]


def _replace(args, i, value):
    args = list(args)
    args[i] = value
    return args


ERROR_CASES = [
    pytest.param(lambda: _C.attention(*_replace(_good_attention_args(), 0, torch.randn(10, 2, 8).half())),
                 "float32 or bfloat16", id="attention-fp16"),
    pytest.param(lambda: _C.attention(*_replace(_good_attention_args(), 1, torch.randn(10, 2, 8).double())),
                 "dtype", id="attention-k-dtype-mismatch"),
    pytest.param(lambda: _C.attention(*_replace(_good_attention_args(), 2, torch.randn(9, 2, 8))),
                 "same shape", id="attention-shape"),
    pytest.param(lambda: _C.attention(*_replace(_good_attention_args(), 0, torch.randn(10, 8, 2).transpose(1, 2))),
                 "stride", id="attention-head-dim-stride"),
    pytest.param(lambda: _C.attention(*_replace(_good_attention_args(), 3, torch.tensor([0, 4, 10]))),
                 "int32", id="attention-cu-int64"),
    pytest.param(lambda: _C.attention(*_replace(_good_attention_args(), 3, torch.tensor([0, 4, 9], dtype=torch.int32))),
                 "tokens", id="attention-cu-end"),
    pytest.param(lambda: _C.attention(*_replace(_good_attention_args(), 3, torch.tensor([0, 7, 4, 10], dtype=torch.int32))),
                 "non-decreasing", id="attention-cu-decreasing"),
    pytest.param(lambda: _C.attention(*_replace(_good_attention_args(), 3, torch.tensor([1, 4, 10], dtype=torch.int32))),
                 "must be 0", id="attention-cu-start"),
    pytest.param(lambda: _C.attention(*_replace(_good_attention_args(), 4, 5)), "max_seqlen", id="attention-max-seqlen"),
    pytest.param(lambda: _C.attention(*_replace(_good_attention_args(), 0, torch.randn(10, 2, 8, device="meta"))),
                 "CPU", id="attention-device"),
    pytest.param(lambda: _C.layernorm(torch.randn(4, 8), torch.ones(7), torch.zeros(8), 1e-5), "shape",
                 id="layernorm-weight-shape"),
    pytest.param(lambda: _C.layernorm(torch.randn(8, 4).t(), torch.ones(8), torch.zeros(8), 1e-5), "contiguous",
                 id="layernorm-non-contiguous"),
    pytest.param(lambda: _C.layernorm(torch.randn(4, 8), torch.ones(8), torch.zeros(8), 1e-5, torch.randn(4, 9)),
                 "residual", id="layernorm-residual-shape"),
    pytest.param(lambda: _C.layernorm(torch.randn(4, 8).bfloat16(), torch.ones(8), torch.zeros(8), 1e-5), "dtype",
                 id="layernorm-mixed-dtype"),
    pytest.param(lambda: _C.layernorm(torch.randn(2, 4, 8), torch.ones(8), torch.zeros(8), 1e-5), "tokens, hidden",
                 id="layernorm-3d"),
    pytest.param(lambda: _C.linear(torch.randn(4, 8), _C.pack_linear(torch.randn(5, 8)), 5, None, "swish"),
                 "unknown activation", id="linear-act-unknown"),
    pytest.param(lambda: _C.linear(torch.randn(4, 8), _C.pack_linear(torch.randn(5, 8)), 5, torch.randn(6)),
                 "bias must have shape", id="linear-bias-shape"),
    pytest.param(lambda: _C.linear(torch.randint(0, 3, (4, 8)), _C.pack_linear(torch.randn(5, 8)), 5),
                 "float32 or bfloat16", id="linear-x-int"),
    pytest.param(lambda: _C.linear(torch.randn(3, 8), _C.pack_linear(torch.randn(5, 7)), 5), "packed weight",
                 id="linear-k-mismatch"),
    pytest.param(lambda: _C.linear(torch.randn(8, 3).t(), _C.pack_linear(torch.randn(5, 8)), 5), "contiguous",
                 id="linear-x-stride"),
    pytest.param(lambda: _C.linear(torch.randn(3, 8), _C.pack_linear(torch.randn(5, 8)), 5, None, "none",
                                   torch.randn(3, 6)), "residual", id="linear-residual-shape"),
    pytest.param(lambda: _C.linear(torch.randn(3, 8).bfloat16(), _C.pack_linear(torch.randn(5, 8)), 5), "dtype",
                 id="linear-dtype-mismatch"),
    pytest.param(lambda: _C.pack_linear(torch.randn(5)), "out_features", id="pack-1d"),
    pytest.param(lambda: _C.embeddings(torch.tensor([0, 50]), torch.tensor([0, 1]), None, torch.randn(50, 8),
                                  torch.randn(4, 8), None, torch.ones(8), torch.zeros(8), 1e-12),
                 "out of range", id="embed-id-range"),
    pytest.param(lambda: _C.embeddings(torch.tensor([0, -1]), torch.tensor([0, 1]), None, torch.randn(50, 8),
                                  torch.randn(4, 8), None, torch.ones(8), torch.zeros(8), 1e-12),
                 "out of range", id="embed-id-negative"),
    pytest.param(lambda: _C.embeddings(torch.tensor([0, 1]), torch.tensor([0, 4]), None, torch.randn(50, 8),
                                  torch.randn(4, 8), None, torch.ones(8), torch.zeros(8), 1e-12),
                 "position_ids", id="embed-position-range"),
    pytest.param(lambda: _C.embeddings(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1]), None,
                                  torch.randn(50, 8), torch.randn(4, 8), None, torch.ones(8), torch.zeros(8), 1e-12),
                 "int64", id="embed-ids-int32"),
    pytest.param(lambda: _C.embeddings(torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([0, 0]),
                                  torch.randn(50, 8), torch.randn(4, 8), None, torch.ones(8), torch.zeros(8), 1e-12),
                 "together", id="embed-types-without-table"),
    pytest.param(lambda: _C.embeddings(torch.tensor([0, 1]), torch.tensor([0, 1]), None, torch.randn(50, 8),
                                  torch.randn(4, 9), None, torch.ones(8), torch.zeros(8), 1e-12),
                 "position must be", id="embed-position-width"),
    pytest.param(lambda: _C.embeddings(torch.tensor([0, 1]), torch.tensor([0, 1]), None, torch.randn(50, 8),
                                  torch.randn(4, 8).bfloat16(), None, torch.ones(8).bfloat16(),
                                  torch.zeros(8).bfloat16(), 1e-12),
                 "float32 word table needs float32", id="embed-fp32-word-bf16-rest"),
    pytest.param(lambda: _C.embeddings(torch.tensor([0, 1]), torch.tensor([0, 1]), None, torch.randn(50, 8).bfloat16(),
                                  torch.randn(4, 8).bfloat16(), None, torch.ones(8), torch.zeros(8), 1e-12),
                 "position has dtype", id="embed-bf16-position-fp32-norm"),
    pytest.param(lambda: _C.set_isa("sse9"), "unknown ISA tier", id="isa-unknown"),
]


@pytest.mark.parametrize("call,message", ERROR_CASES)
def test_errors_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
