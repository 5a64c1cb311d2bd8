"""Op-level tests of the native CPU kernels the modern encoders need (ModernBERT, NomicBERT, GTE), against
`bertfast.reference`: RoPE on the fused QKV output (`_C.rotary_`, `CpuBackend.qkv(rotary=)`), sliding-window
varlen attention (`_C.attention(window=)`), the GLU gate (`_C.glu`, `CpuBackend.linear(gated=True)` on every
GEMM path, int8 included), embeddings without a position table, and bias-free linears.

Every native op runs on each ISA tier the CPU has. RoPE is the same fp32 operations as the reference, so it
must match bit for bit (bf16: the same fp32 values rounded once). The others follow the rule of
tests/helpers/cpu_ops.py: fp32 within 1e-5 of the fp64 reference; bf16 no worse than twice the bf16 reference's
own error plus a floor.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from bertfast import reference
from bertfast.backends import AttentionBias, Rotary
from bertfast.backends.weights import EmbeddingWeights
from bertfast.kernels import activation
from bertfast.accuracy import TABLE
from helpers.cpu_ops import DTYPES, check, cu_seqlens as _cu, qkv_views, rounded

try:
    from bertfast import _C
except ImportError:
    _C = None

pytestmark = pytest.mark.skipif(
    _C is None, reason="the native extension bertfast._C is not built (run bash install.sh)"
)

from bertfast.backends.cpu import quant  # noqa: E402
from bertfast.backends.cpu.backend import CpuBackend  # noqa: E402

def _rotary(tokens, d, gen, theta=10000.0):
    """RoPE tables as the models build them: positions (with repeats, as in a batch) times inverse frequencies."""
    positions = torch.randint(0, 4096, (tokens,), generator=gen).double()
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None] * inv_freq[None, :]
    return Rotary(angles.cos().float(), angles.sin().float())


# ----------------------------------------------------------------------------------------------
# RoPE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,d", [
    pytest.param(1, 1, 2, id="T1-H1-D2"),
    pytest.param(127, 2, 32, id="T127-H2-D32"),
    pytest.param(129, 3, 64, id="T129-H3-D64"),
    pytest.param(40, 2, 80, id="T40-H2-D80"),
    pytest.param(33, 4, 26, id="T33-H4-D26"),  # half of 13: every vector tail
])
def test_rotary_on_fused_qkv_is_exact(isa, dtype, tokens, heads, d):
    """q and k rotated in place inside the (T, 3H) GEMM output: equal to reference.rotate bit for bit, v untouched."""
    g = torch.Generator().manual_seed(tokens * d + heads)
    out = (torch.randn(tokens, 3 * heads * d, generator=g) * 3).to(dtype)
    rot = _rotary(tokens, d, g)
    q, k, v = out.view(tokens, 3, heads, d).unbind(1)
    expected = reference.rotate(q, rot), reference.rotate(k, rot), v.clone()
    rotated = _C.rotary_(out[:, : 2 * heads * d].view(tokens, 2 * heads, d), rot.cos, rot.sin)
    assert rotated.data_ptr() == out.data_ptr()
    for ours, ref in zip(out.view(tokens, 3, heads, d).unbind(1), expected):
        assert torch.equal(ours, ref)


def test_rotary_head_major_view(isa):
    """Rows and heads any stride apart: a (heads, T, d) buffer viewed as (T, heads, d)."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(3, 17, 32, generator=g)
    rot = _rotary(17, 32, g)
    x = base.transpose(0, 1)
    expected = reference.rotate(x, rot)
    _C.rotary_(x, rot.cos, rot.sin)
    assert torch.equal(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_backend_qkv_rotary(isa, dtype, bias):
    """CpuBackend.qkv(rotary=): the GEMM, then q and k rotated; against reference.qkv in fp64."""
    g = torch.Generator().manual_seed(9)
    T, heads, d = 70, 2, 32
    H = heads * d
    x = rounded(torch.randn(T, H, generator=g, dtype=torch.float64), dtype)
    w = rounded(torch.randn(3 * H, H, generator=g, dtype=torch.float64) / math.sqrt(H), dtype)
    b = rounded(torch.randn(3 * H, generator=g, dtype=torch.float64), dtype) if bias else None
    rot = _rotary(T, d, g)
    ours = CpuBackend().qkv(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), heads, rot)
    low = reference.qkv(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), heads, rot)
    hi = reference.qkv(x, w, b, heads, Rotary(rot.cos.double(), rot.sin.double()))
    for o, r_low, r_hi in zip(ours, low, hi):
        assert o.shape == (T, heads, d) and o.dtype == dtype
        check(o, r_low, r_hi, dtype)


@pytest.mark.parametrize("call,message", [
    pytest.param(lambda: _C.rotary_(torch.randn(4, 2, 7), torch.randn(4, 3), torch.randn(4, 3)), "even",
                 id="odd-head-dim"),
    pytest.param(lambda: _C.rotary_(torch.randn(4, 2, 8), torch.randn(4, 3), torch.randn(4, 4)), "cos must",
                 id="cos-shape"),
    pytest.param(lambda: _C.rotary_(torch.randn(4, 2, 8), torch.randn(4, 4), torch.randn(4, 4).double()),
                 "float32", id="sin-dtype"),
    pytest.param(lambda: _C.rotary_(torch.randn(4, 8, 2).transpose(1, 2), torch.randn(4, 4), torch.randn(4, 4)),
                 "stride", id="head-dim-stride"),
    pytest.param(lambda: _C.rotary_(torch.randn(4, 1, 8).expand(4, 2, 8), torch.randn(4, 4), torch.randn(4, 4)),
                 "overlap", id="overlapping-heads"),
    pytest.param(lambda: _C.attention(*[torch.randn(4, 1, 8)] * 3, torch.tensor([0, 4], dtype=torch.int32), 4, 0.3,
                                      window=-1), "window", id="attention-negative-window"),
    pytest.param(lambda: _C.glu(torch.randn(3, 7), "silu"), "2 \\* features", id="glu-odd-width"),
    pytest.param(lambda: _C.glu(torch.randn(3, 8), "swish"), "unknown activation", id="glu-act"),
    pytest.param(lambda: _C.embeddings(torch.tensor([0, 1]), None, None, torch.randn(50, 8), torch.randn(4, 8), None,
                                  torch.ones(8), torch.zeros(8), 1e-12), "position_ids", id="embed-positions-missing"),
])
def test_errors_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ----------------------------------------------------------------------------------------------
# Sliding-window attention (query blocks of 32 rows, key tiles of 64 keys in csrc/cpu/attention/attention_impl.h)


WINDOW_CASES = [
    pytest.param([1], 2, 32, 1, id="L1-W1"),
    pytest.param([127, 129, 1, 64], 2, 64, 16, id="L127.129.1.64-W16"),
    pytest.param([65, 66, 64], 1, 32, 64, id="L65.66.64-W64-at-boundary"),  # len - 1 == window, one past, below
    pytest.param([97, 98], 2, 80, 96, id="L97.98-W96-D80"),
    pytest.param([200, 3, 150], 3, 26, 40, id="L200.3.150-W40-D26"),
    pytest.param([300], 2, 32, 1000, id="L300-W1000-wider"),
    pytest.param([257, 100], 2, 64, 1, id="L257.100-W1"),
    pytest.param([190], 1, 32, 31, id="L190-W31"),
]


@functools.lru_cache(maxsize=None)
def _window_case(lengths, heads, d, window, dtype):
    """Inputs (q, k, v in `dtype`, views of one fused buffer) and both references, once for every tier."""
    gen = torch.Generator().manual_seed(sum(lengths) + d + window)
    (q, k, v), low, cu = qkv_views(list(lengths), heads, d, dtype, gen)
    scale = 1.0 / math.sqrt(d)
    ref_hi = reference.attention_loop(q, k, v, cu, scale, window=window)
    ref_low = reference.attention(*low, cu, max(lengths), scale, window=window)
    return low, cu, scale, ref_low, ref_hi


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths,heads,d,window", WINDOW_CASES)
def test_attention_window(isa, dtype, lengths, heads, d, window):
    """q, k, v strided views of one fused buffer; ragged lengths vs reference.attention_loop in fp64."""
    (ql, kl, vl), cu, scale, ref_low, ref_hi = _window_case(tuple(lengths), heads, d, window, dtype)
    ours = _C.attention(ql, kl, vl, cu, max(lengths), scale, window=window)
    assert ours.shape == (sum(lengths), heads * d) and ours.is_contiguous()
    check(ours, ref_low, ref_hi, dtype)
    # A window reaching every key is global attention, bit for bit, on every tier: the same kernel (the AMX tiles
    # take windowed calls too) and the same tiles in the same order.
    if window >= max(lengths) - 1:
        assert torch.equal(ours, _C.attention(ql, kl, vl, cu, max(lengths), scale))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_window_with_bias(isa, dtype):
    """The MPNet bias and the window together (the bias table covers every distance; the window cuts)."""
    lengths, heads, d, window = [150, 1, 70], 2, 32, 20
    gen = torch.Generator().manual_seed(21)
    (q, k, v), (ql, kl, vl), cu = qkv_views(lengths, heads, d, dtype, gen)
    width = max(lengths) + 3
    positions = torch.cat([torch.arange(n) + i for i, n in enumerate(lengths)]).to(torch.int32)
    bias = AttentionBias(torch.randn(heads, 2 * width - 1, generator=gen) * 2, positions)
    ours = _C.attention(ql, kl, vl, cu, max(lengths), 0.2, bias_table=bias.table, bias_positions=positions,
                        window=window)
    ref_hi = reference.attention_loop(q, k, v, cu, 0.2, AttentionBias(bias.table.double(), positions), window)
    ref_low = reference.attention(ql, kl, vl, cu, max(lengths), 0.2, bias, window)
    check(ours, ref_low, ref_hi, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_window_long_row(isa, dtype):
    """One 3000-token row, window 64 (ModernBERT's local layers on a long document)."""
    (q, k, v), cu, scale, ref_low, ref_hi = _window_case((3000,), 2, 32, 64, dtype)
    check(_C.attention(q, k, v, cu, 3000, scale, window=64), ref_low, ref_hi, dtype)


def test_attention_window_skips_far_tiles(isa):
    """Key tiles outside every row's window are never read: a NaN value at token 500 reaches only the query blocks
    whose tiles hold it (rows 416..543 at most: blocks of 32, tiles of 64, window 8); a kernel that computed every
    tile and masked afterwards would spread 0 * NaN to every row."""
    T, window = 1000, 8
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, T, 2, 16, generator=gen).unbind(0)
    v[500] = float("nan")
    ours = _C.attention(q, k, v, _cu([T]), T, 0.25, window=window)
    far = torch.cat([torch.arange(0, 416), torch.arange(544, T)])
    assert torch.isfinite(ours[far]).all()
    clean = v.clone()
    clean[500] = 0.0
    expected = reference.attention_loop(q.double(), k.double(), clean.double(), _cu([T]), 0.25, window=window)
    torch.testing.assert_close(ours[far].double(), expected[far], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_window_batch_invariant(isa, dtype):
    """A sequence alone gives bit-identical output to the same sequence inside a batch, with a window."""
    gen = torch.Generator().manual_seed(8)
    _, (q, k, v), cu = qkv_views([30, 177, 5], 2, 32, dtype, gen)
    batch = _C.attention(q, k, v, cu, 177, 0.2, window=24)
    alone = _C.attention(q[30:207], k[30:207], v[30:207], _cu([177]), 177, 0.2, window=24)
    assert torch.equal(batch[30:207], alone)


@pytest.mark.parametrize("dtype", DTYPES + [pytest.param("bf16-products", id="fp32-bf16-products")])
def test_window_reaching_every_key_is_batch_invariant(isa, dtype):
    """A sequence the window covers whole (12 tokens, window 24) alone and beside a longer one (177 tokens): the
    same bits on every tier. On amx the kernel was once chosen after the window was dropped for reaching every key of
    the call, so the short row alone ran on the tiles and in the batch did not (ModernBERT's local layers); now the
    tiles take windowed calls and every sequence drops a window reaching its own keys by itself."""
    products = dtype == "bf16-products"
    gen = torch.Generator().manual_seed(9)
    _, (q, k, v), cu = qkv_views([12, 177], 2, 32, torch.float32 if products else dtype, gen)
    batch = _C.attention(q, k, v, cu, 177, 0.2, bf16_products=products, window=24)
    alone = _C.attention(q[:12], k[:12], v[:12], _cu([12]), 12, 0.2, bf16_products=products, window=24)
    assert torch.equal(batch[:12], alone)


def test_backend_attention_window(isa):
    gen = torch.Generator().manual_seed(4)
    (q, k, v), (ql, kl, vl), cu = qkv_views([90, 40], 2, 32, torch.float32, gen)
    ours = CpuBackend().attention(ql, kl, vl, cu, 90, 0.2, window=10)
    check(ours, ours, reference.attention_loop(q, k, v, cu, 0.2, window=10), torch.float32)


# ----------------------------------------------------------------------------------------------
# The GLU gate and the gated linear


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", activation.GATED_IDS)
@pytest.mark.parametrize("rows,features", [
    pytest.param(1, 7, id="M1-N7"),
    pytest.param(33, 1536, id="M33-N1536"),  # columns past one 256-wide chunk
    pytest.param(130, 129, id="M130-N129"),
])
def test_glu(isa, dtype, act, rows, features):
    g = torch.Generator().manual_seed(rows * features)
    wide = rounded(torch.randn(rows, 2 * features + 5, generator=g, dtype=torch.float64) * 4, dtype)
    h, h_low = wide[:, : 2 * features], wide.to(dtype)[:, : 2 * features]  # rows strided (2N + 5 apart)
    ours = _C.glu(h_low, act)
    assert ours.shape == (rows, features) and ours.dtype == dtype and ours.is_contiguous()
    check(ours, activation.glu(h_low, act), activation.glu(h, act), dtype)


def test_silu_extremes(isa):
    x = torch.tensor([-float("inf"), -1e30, -1e4, -100.0, -88.0, -5.0, -1e-3, 0.0, 1e-30, 1e-3, 5.0, 100.0, 1e4,
                      float("inf"), float("nan")])
    ours = _C.glu(torch.stack([x, torch.ones_like(x)], 1), "silu")[:, 0]
    torch.testing.assert_close(ours, torch.nn.functional.silu(x), atol=1e-6, rtol=1e-6, equal_nan=True)
    # silu through a GEMM epilogue (one activation table: every epilogue takes "silu")
    y = _C.linear(x[1:-2, None], _C.pack_linear(torch.ones(1, 1)), 1, None, "silu")[:, 0]
    torch.testing.assert_close(y, torch.nn.functional.silu(x[1:-2]), atol=1e-6, rtol=1e-6)


def _gated_case(dtype, M, K, N, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = rounded(torch.randn(M, K, generator=g, dtype=torch.float64), dtype)
    w = rounded(torch.randn(2 * N, K, generator=g, dtype=torch.float64) / math.sqrt(K), dtype)
    b = rounded(torch.randn(2 * N, generator=g, dtype=torch.float64), dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu", "silu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("M", [3, 100])
def test_gated_linear(isa, dtype, act, bias, M):
    """CpuBackend.linear(gated=True) on packed weights, through each GEMM path, vs reference.linear_glu."""
    x, w, b = _gated_case(dtype, M, 96, 72, bias, seed=M)
    low = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    ours = CpuBackend().linear(low(x), _pack(low(w)), low(b), act, gated=True)
    assert ours.shape == (M, 72) and ours.dtype == dtype
    check(ours, reference.linear_glu(low(x), low(w), low(b), act), reference.linear_glu(x, w, b, act), dtype)


def _pack(weight):
    from bertfast.backends.cpu.linear import PackedLinear

    return PackedLinear(weight)


@pytest.mark.parametrize("M", [1, 17, 300])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_gated_linear_int8(isa, M, bias):
    """int8 GEMM (quant.linear, the native kernel at every row count), then the gate: within fp32 rounding of the same quantized
    math in fp64, and close to the float product as int8 linears are (test_quant.py's 1% per linear)."""
    g = torch.Generator().manual_seed(M)
    K, N = 128, 80
    x = torch.randn(M, K, generator=g) * 1.5 + 0.2
    w = torch.randn(2 * N, K, generator=g) * K ** -0.5
    b = torch.randn(2 * N, generator=g) * 0.1 if bias else None
    weight = quant.QuantLinear.from_float(w)
    ours = CpuBackend(quantize="int8").linear(x, weight, b, "silu", gated=True)
    oracle = activation.glu(quant.linear_reference(x, weight, b), "silu")
    assert ours.dtype == torch.float32 and ours.shape == (M, N)
    assert (ours.double() - oracle).abs().max().item() <= TABLE[torch.float32] * oracle.abs().max().item()
    # As test_quant: against the float product with the same weight, each int8 linear within 1%; the gate multiplies
    # two of them (relative errors add), so within 2%.
    float_h = torch.nn.functional.linear(x, weight.dequantize(), b)
    assert _rel_norm(quant.linear(x, weight, b), float_h) < 0.01
    assert _rel_norm(ours, activation.glu(float_h, "silu")) < 0.02


def _rel_norm(ours, expected):
    return float((ours - expected).norm() / expected.norm())


def test_gated_linear_errors():
    backend = CpuBackend()
    w = _pack(torch.randn(8, 4))
    with pytest.raises(ValueError, match="residual"):
        backend.linear(torch.randn(2, 4), w, None, "gelu", torch.randn(2, 4), gated=True)
    with pytest.raises(ValueError, match="unknown activation"):
        backend.linear(torch.randn(2, 4), w, None, "tanh", gated=True)
    with pytest.raises(ValueError, match="2N rows"):
        backend.linear(torch.randn(2, 4), _pack(torch.randn(7, 4)), None, "gelu", gated=True)


# ----------------------------------------------------------------------------------------------
# Bias-free linears on every path, embeddings without a position table, prepare with modern layers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [5, 200])
def test_bias_free_linear(isa, dtype, M):
    x, w, _ = _gated_case(dtype, M, 64, 24, False, seed=M + 1)
    r = rounded(torch.randn(M, 48, generator=torch.Generator().manual_seed(2), dtype=torch.float64), dtype)
    ours = CpuBackend().linear(x.to(dtype), _pack(w.to(dtype)), None, "none", r.to(dtype))
    check(ours, reference.linear(x.to(dtype), w.to(dtype), None) + r.to(dtype), reference.linear(x, w, None) + r, dtype)


@pytest.mark.parametrize("M", [3, 300])
def test_bias_free_linear_int8(isa, M):
    g = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 64, generator=g), torch.randn(40, 64, generator=g) * 0.125
    weight = quant.QuantLinear.from_float(w)
    ours = CpuBackend(quantize="int8").linear(x, weight, None, "gelu")
    oracle = quant.linear_reference(x, weight, None, "gelu")
    assert (ours.double() - oracle).abs().max().item() <= TABLE[torch.float32] * oracle.abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden,types", [
    pytest.param(1, 32, 2, id="T1-H32"),
    pytest.param(129, 384, 0, id="T129-H384-notypes"),
    pytest.param(70, 1025, 3, id="T70-H1025"),
])
def test_embed_without_positions(isa, dtype, tokens, hidden, types):
    g = torch.Generator().manual_seed(tokens + hidden)
    tables = dict(
        word=torch.randn(50, hidden, generator=g, dtype=torch.float64) + 2.0,  # offset from zero
        position=None,
        token_type=torch.randn(types, hidden, generator=g, dtype=torch.float64) if types else None,
        ln_weight=1 + 0.1 * torch.randn(hidden, generator=g, dtype=torch.float64),
        ln_bias=0.1 * torch.randn(hidden, generator=g, dtype=torch.float64),
    )
    emb_hi = EmbeddingWeights(**{k: rounded(t, dtype) for k, t in tables.items()})
    emb_low = EmbeddingWeights(**{k: None if t is None else t.to(dtype) for k, t in vars(emb_hi).items()})
    ids = torch.randint(0, 50, (tokens,), generator=g)
    tt = torch.randint(0, types, (tokens,), generator=g) if types else None
    pos = torch.arange(tokens)  # ignored without a table
    ours = CpuBackend().embeddings(ids, pos, tt, emb_low, 1e-5)
    assert torch.equal(ours, _C.embeddings(ids, None, tt, emb_low.word, None, emb_low.token_type, emb_low.ln_weight,
                                      emb_low.ln_bias, 1e-5))
    check(ours, reference.embeddings(ids, pos, tt, emb_low, 1e-5), reference.embeddings(ids, pos, tt, emb_hi, 1e-5), dtype)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_prepare_keeps_modern_layers_op_by_op(quantize):
    """Layers `_C.Layer` cannot run (bias-free linears, a gated FFN of 2I rows) are packed like any other and
    left to the ops: no whole layer for them, while a plain BERT layer keeps its own."""
    from bertfast.tools.validate.cases import random_weights, tiny_config

    cfg = tiny_config(64, 2, 96)
    weights = random_weights(cfg, torch.Generator().manual_seed(0)).to(dtype=torch.float32)
    plain = weights.layers[0]
    bias_free = dataclasses.replace(plain, qkv_bias=None, attn_out_bias=None, ffn_in_bias=None, ffn_out_bias=None)
    gated = dataclasses.replace(plain, ffn_in_weight=torch.randn(2 * 96, 64))
    weights = dataclasses.replace(weights, layers=[plain, bias_free, gated])
    backend = CpuBackend(quantize=quantize)
    prepared = backend.prepare(weights)
    x = torch.randn(4, 64)
    assert backend.whole_layer(x, prepared.layers[0]) is not None
    assert backend.whole_layer(x, prepared.layers[1]) is None and backend.whole_layer(x, prepared.layers[2]) is None
    assert prepared.layers[2].ffn_in_weight.shape == (2 * 96, 64)
    h = backend.linear(x, prepared.layers[2].ffn_in_weight, None, "gelu", gated=True)
    assert h.shape == (4, 96)
    if quantize is None:  # against fp64, as every GEMM path's gated test: torch's fp32 differs by its own error
        w = gated.ffn_in_weight
        check(h, reference.linear_glu(x, w, None, "gelu"), reference.linear_glu(x.double(), w.double(), None, "gelu"),
              torch.float32)
