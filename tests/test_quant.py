"""Int8 dynamic quantization (bertfast/backends/cpu/quant.py and its native kernels, csrc/cpu/int8/quantize_rows.cpp,
int8_*.cpp).

Quantize/dequantize round trips; the native per-token quantization bitwise equal to its torch
definition (both ISAs); the int8 GEMM with every epilogue against an fp64 evaluation of the same
quantized math (exact up to summation order and fp32 rounding); the torch-op fallback against the
same oracle; error paths; and dtype="int8" on a whole model (cpu backend) against fp32.
"""

from __future__ import annotations

import pytest
import torch

from bertfast.backends.cpu import quant

ACTS = ("none", "gelu", "gelu_tanh", "relu")
EPS32 = 2.0 ** -24

has_native = pytest.mark.skipif(
    quant._C is None, reason="bertfast._C is not built (quantize_rows, quant_linear)",
)


def _x(M, K, seed, std=1.0, mean=0.0, strided=False):
    g = torch.Generator().manual_seed(seed)
    width = K + 13 if strided else K
    base = torch.randn(M, width, generator=g) * std + mean
    return base[:, :K] if strided else base


# ----------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("N,K", [(1, 1), (48, 64), (129, 80), (7, 3072)], ids=lambda v: str(v))
def test_weight_round_trip(N, K):
    w = _x(N, K, seed=N * 1000 + K, std=0.05)
    w[0, 0] = -w.abs().max() * 3  # the most negative value of its row: code -127, never -128
    q, scale = quant.quantize_weight(w)
    assert q.dtype == torch.int8 and q.is_contiguous() and scale.dtype == torch.float32
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    assert int(q[0, 0]) == -127
    # Every row's largest magnitude maps to 127 exactly, and the error is at most half a step.
    assert bool((q.abs().amax(dim=1) == 127).all())
    err = (quant.dequantize(q, scale).double() - w.double()).abs()
    assert bool((err <= scale.double()[:, None] * (0.5 + 1e-6)).all())


def test_weight_zero_row_and_errors():
    w = torch.randn(4, 16)
    w[2] = 0
    q, scale = quant.quantize_weight(w)
    assert float(scale[2]) == 1.0 and int(q[2].abs().max()) == 0
    with pytest.raises(ValueError, match="NaN or Inf"):
        quant.quantize_weight(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="out_features, in_features"):
        quant.quantize_weight(torch.randn(8))
    with pytest.raises(ValueError, match="float weight"):
        quant.quantize_weight(torch.ones(2, 2, dtype=torch.int32))


@pytest.mark.parametrize("mean,std", [(0.0, 1.0), (0.3, 0.05), (-2.0, 0.5), (5.0, 3.0)],
                         ids=["centred", "positive-narrow", "all-negative", "offset-wide"])
def test_rows_round_trip(mean, std):
    x = _x(37, 129, seed=7, std=std, mean=mean)
    if mean == 0.3:
        x = x.clamp(min=-0.17)  # a GELU output's range: skewed, nearly all codes on one side
    q, scale, zp = quant.quantize_rows_reference(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and zp.dtype == torch.int32
    assert int(zp.min()) >= -128 and int(zp.max()) <= 127
    back = quant.dequantize_rows(q, scale, zp).double()
    # Half a step of rounding plus the fp32 rounding of x * (1 / scale).
    assert bool(((back - x.double()).abs() <= scale.double()[:, None] * (0.5 + 1e-5)).all())
    # The range [min(x, 0), max(x, 0)] uses the full grid: its low end (or 0) is code -128.
    lo_codes = torch.where(x.amin(1) < 0, q.amin(1).int(), zp)
    assert bool((lo_codes == -128).all())
    hi_codes = torch.maximum(q.amax(1).int(), zp)  # the code of max(x, 0)
    assert bool((hi_codes >= 126).all())


def test_rows_zero_is_exact_and_nonfinite_rows():
    x = torch.randn(5, 33)
    x[1] = 0.0  # all-zero row: scale 1, every code the zero point
    x[2, 4] = 0.0
    x[3, 3] = float("nan")
    x[4, 7] = float("inf")
    q, scale, zp = quant.quantize_rows_reference(x)
    back = quant.dequantize_rows(q, scale, zp)
    assert float(scale[1]) == 1.0 and bool((back[1] == 0).all())
    assert float(back[2, 4]) == 0.0
    assert torch.isnan(scale[3]) and torch.isinf(scale[4])
    assert int(q[3].abs().max()) == 0 and int(zp[3]) == 0 and int(q[4].abs().max()) == 0


# ----------------------------------------------------------------------------------------------
# Native per-token quantization: bitwise the torch definition


@has_native
@pytest.mark.parametrize("M,K,strided", [(1, 1, False), (3, 17, False), (129, 768, False), (65, 3072, False),
                                         (7, 80, True), (4, 48, False), (5, 100, False), (3, 1536, False)],
                         ids=["M1-K1", "M3-K17", "M129-K768", "M65-K3072", "M7-K80-strided", "M4-K48", "M5-K100",
                              "M3-K1536"])  # AVX-512: min/max 32 and codes 64 a step, then 16-wide tails
def test_native_quantize_rows_bitwise(isa, M, K, strided):
    x = _x(M, K, seed=M + K, std=2.0, mean=0.4, strided=strided)
    ours = quant.quantize_rows(x)
    ref = quant.quantize_rows_reference(x)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


@has_native
@pytest.mark.parametrize("M,K", [(1, 1), (3, 17), (129, 768), (6, 40)], ids=["M1-K1", "M3-K17", "M129-K768", "M6-K40"])
def test_native_quantize_rows_flipped(isa, M, K):
    """flip=True writes each code as the unsigned byte q ^ 0x80 (what int8_linear's vpdpbusd kernels multiply), a row
    with NaN (all codes 0) as 0x80: the same scales and zero points."""
    x = _x(M, K, seed=M * K, std=2.0, mean=-0.3, strided=False)
    x[0, 0] = float("nan")
    q, scale, zp = quant._C.quantize_rows(x)
    qu, scale_u, zp_u = quant._C.quantize_rows(x, flip=True)
    assert torch.equal(qu.view(torch.uint8), q.view(torch.uint8) ^ 0x80) and (qu[0].view(torch.uint8) == 0x80).all()
    assert torch.equal(scale.nan_to_num(7.0), scale_u.nan_to_num(7.0)) and torch.equal(zp, zp_u)


@has_native
def test_native_quantize_rows_special_rows(isa):
    x = torch.randn(7, 40)
    x[0] = 0.0
    x[1] = x[1].abs() + 0.5  # no negative value: lo = 0
    x[2] = -x[2].abs() - 0.5  # no positive value: hi = 0
    x[3, 5] = float("nan")
    x[4, 9] = float("-inf")
    x[5, :] = 1e-30  # tiny but normal values
    x[6, 20] = float("nan")  # in the second vector of a 32-wide step
    ours = quant.quantize_rows(x)
    ref = quant.quantize_rows_reference(x)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[2], ref[2])
    assert torch.equal(ours[1].nan_to_num(7.0), ref[1].nan_to_num(7.0))


# ----------------------------------------------------------------------------------------------
# The int8 GEMM and its epilogues vs fp64 of the same quantized math


def _magnitude(x, weight, bias, residual):
    """|terms| of the epilogue sum in fp64: the scale that fp32 rounding errors are relative to."""
    qx, xs, zp = quant.quantize_rows_reference(x)
    acc_abs = qx.double().abs() @ weight.q.double().abs().t()
    mag = xs.double()[:, None] * (acc_abs * weight.scale.double() + zp.double().abs()[:, None]
                                  * weight.colsum.double().abs())
    if bias is not None:
        mag = mag + bias.double().abs()
    if residual is not None:
        mag = mag + residual.double().abs()
    return mag


CASES = [  # (M, K, N)
    pytest.param(1, 64, 48, id="M1-K64-N48"),
    pytest.param(7, 80, 200, id="M7-K80-N200"),
    pytest.param(129, 768, 96, id="M129-K768-N96"),
    pytest.param(33, 3072, 40, id="M33-K3072-N40"),
]


def _linear_case(M, K, N, act, with_residual, seed=0):
    g = torch.Generator().manual_seed(seed + M * 7 + K * 3 + N)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    weight = quant.QuantLinear.from_float(w)
    x = (torch.randn(M, K, generator=g) * 1.5 + 0.2)
    if act != "none":
        x = x.clamp(min=-0.17)  # FFN-out style input for variety: skewed rows, large zero points
    bias = torch.randn(N, generator=g) * 0.1
    residual = torch.randn(M, N, generator=g) if with_residual else None
    return x, weight, bias, residual


def _check(ours, x, weight, bias, act, residual):
    oracle = quant.linear_reference(x, weight, bias, act, residual)
    assert ours.dtype == torch.float32 and ours.shape == oracle.shape and ours.is_contiguous()
    bound = 16 * EPS32 * _magnitude(x, weight, bias, residual) + 1e-30
    err = (ours.double() - oracle).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"error {float(err.max()):.3e} is {worst:.2f}x the fp32 rounding bound"


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("M,K,N", CASES)
def test_linear_epilogues_vs_fp64(M, K, N, act):
    for with_residual in (False, True):
        x, weight, bias, residual = _linear_case(M, K, N, act, with_residual)
        _check(quant.linear(x, weight, bias, act, residual), x, weight, bias, act, residual)


def test_linear_without_the_extension(monkeypatch):
    """The same math where the native kernels are missing: torch's int8 GEMM and epilogue."""
    monkeypatch.setattr(quant, "_C", None)
    for act in ("none", "gelu"):
        x, _, bias, residual = _linear_case(17, 80, 48, act, act == "none")
        weight = quant.QuantLinear.from_float(torch.randn(48, 80, generator=torch.Generator().manual_seed(2)) * 0.1)
        assert weight.packed is None and "_int_mm" in repr(weight)
        _check(quant.linear(x, weight, bias, act, residual), x, weight, bias, act, residual)


def test_int8_gemm_without_an_exact_int_mm(monkeypatch):
    """Where torch._int_mm is not exact (oneDNN capped at AVX2 on some CPUs), the float64 products give the same
    int32 sums; the probe says which this process has."""
    g = torch.Generator().manual_seed(4)
    qx = torch.randint(-128, 128, (33, 200), dtype=torch.int8, generator=g)
    weight = quant.QuantLinear.from_float(torch.randn(24, 200, generator=g))
    exact = (qx.long() @ weight.q.t().long()).to(torch.float32) * weight.scale
    assert isinstance(quant.int_mm_is_exact(), bool)
    monkeypatch.setattr(quant, "_int_mm_exact", False)
    assert torch.equal(quant.int8_gemm(qx, weight), exact)


def test_linear_strided_input_and_empty():
    x, weight, bias, _ = _linear_case(9, 64, 32, "none", False)
    wide = torch.zeros(9, 80)
    wide[:, :64] = x
    _check(quant.linear(wide[:, :64], weight, bias), x, weight, bias, "none", None)
    assert quant.linear(torch.zeros(0, 64), weight, bias).shape == (0, 32)


def test_linear_approximates_float():
    # Not an exactness check: the quantized product stays close to the float one (what the
    # accuracy report measures at model scale). Per-token asymmetric, per-channel weights.
    x, weight, bias, _ = _linear_case(64, 768, 256, "none", False)
    w = weight.dequantize()
    exact = torch.nn.functional.linear(x, w, bias)
    ours = quant.linear(x, weight, bias)
    rel = float((ours - exact).norm() / exact.norm())
    assert rel < 0.01


def test_linear_errors():
    weight = quant.QuantLinear.from_float(torch.randn(8, 16))
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="QuantLinear"):
        quant.linear(x, torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"x must be \(M, 16\)"):
        quant.linear(torch.randn(3, 15), weight)
    with pytest.raises(ValueError, match="float32 activations"):
        quant.linear(x.double(), weight)
    with pytest.raises(ValueError, match="unknown activation"):
        quant.linear(x, weight, None, "swish")
    with pytest.raises(ValueError, match="bias must be"):
        quant.linear(x, weight, torch.randn(7))
    with pytest.raises(ValueError, match="residual must be"):
        quant.linear(x, weight, None, "none", torch.randn(3, 7))
    with pytest.raises(ValueError, match="int8 weight"):
        quant.QuantLinear(torch.randn(8, 16), torch.ones(8))
    with pytest.raises(ValueError, match="float32 scales"):
        quant.QuantLinear(torch.zeros(8, 16, dtype=torch.int8), torch.ones(7))
    with pytest.raises(ValueError, match="float32 activations"):
        quant.quantize_rows(torch.randn(2, 3, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# dtype="int8" through the backends


def test_int8_on_backend_without_it_is_a_clear_error():
    from bertfast import Encoder, get_backend
    from bertfast.tools.workloads import random_hf_model

    with pytest.raises(ValueError, match="backend 'torch' does not support 'int8' quantization"):
        get_backend("torch", "cpu", quantize="int8")
    with pytest.raises(ValueError, match="does not support 'int8'"):
        Encoder.from_hf(random_hf_model("tiny"), backend="torch", dtype="int8")


@has_native
@pytest.mark.parametrize("M,K,N", [
    pytest.param(1, 64, 48, id="M1-K64-N48"),
    pytest.param(16, 768, 100, id="M16-K768-N100"),
    pytest.param(17, 128, 64, id="M17-K128-N64"),  # a second, one-row tile of rows
    pytest.param(40, 80, 200, id="M40-K80-N200"),  # K % 64 != 0: never on AMX tiles
    pytest.param(3, 7, 5, id="M3-K7-N5"),  # K % 4 != 0: padded last group
    # Past the streaming tile: row blocks of 48, register tiles of 6 rows, panel groups of 4 (avx512_vnni)
    pytest.param(129, 256, 200, id="M129-K256-N200"),  # a short last row block and tile; N % 64 != 0
    pytest.param(50, 70, 33, id="M50-K70-N33"),  # K % 4 != 0 in the blocked paths; one panel of 1 column
    # Row tiles with every remainder (avx2: 6 rows, portable: 4), odd column counts in the last panel
    pytest.param(7, 36, 47, id="M7-K36-N47"),
    pytest.param(49, 132, 23, id="M49-K132-N23"),  # one row past a row block; a half panel plus 7 columns
    pytest.param(1000, 66, 40, id="M1000-K66-N40"),
])
def test_int8_kernel_paths(isa, M, K, N):
    """The native int8 GEMM and its fused epilogue on every tier the CPU has, each path its rows select."""
    for act in ACTS:
        x, weight, bias, residual = _linear_case(M, K, N, act, act == "none", seed=11)
        _check(quant.linear(x, weight, bias, act, residual), x, weight, bias, act, residual)
    x, weight, _, _ = _linear_case(M, K, N, "none", False, seed=12)
    _check(quant.linear(x, weight), x, weight, None, "none", None)


@has_native
@pytest.mark.parametrize("M,K,N", [(16, 64, 16), (17, 128, 64), (129, 256, 200), (1000, 384, 40), (50, 70, 33)],
                         ids=["M16-stream", "M17", "M129-K256", "M1000-K384", "M50-K70"])
def test_int8_unsigned_codes_same_bits(isa, M, K, N):
    """Where the GEMM's kernel multiplies unsigned bytes (vpdpbusd, past the streaming tile's 16 rows, K % 4 == 0),
    quant_linear quantizes straight to them instead of letting the GEMM flip signed codes in a pass of its own:
    the same bits either way, on every tier (where the kernel takes signed codes both calls are the same call)."""
    _C = quant._C
    for act in ACTS:
        x, weight, bias, residual = _linear_case(M, K, N, act, act == "none", seed=7)
        args = (x, weight.packed, weight.scale, weight.colsum, bias, act, residual)
        assert torch.equal(_C.quant_linear(*args), _C.quant_linear(*args, unsigned_codes=False)), act


@has_native
@pytest.mark.parametrize("M,K,N", [(1, 64, 16), (7, 36, 47), (49, 132, 23), (129, 768, 200), (300, 3072, 40)],
                         ids=["M1", "M7-K36-N47", "M49-K132", "M129-K768", "M300-K3072"])
def test_avx2_int8_same_bits_with_and_without_avx_vnni(M, K, N):
    """The avx2 tier's int8 GEMM with AVX-VNNI (vpdpbusd on ymm) makes the vpmaddwd path's int32 sums and runs
    its epilogue: the same bits, so an int8 output does not depend on whether the CPU has AVX-VNNI."""
    _C = quant._C
    if not _C.has_avx_vnni():
        pytest.skip("the CPU has no AVX-VNNI (avx_vnni in /proc/cpuinfo)")
    before = _C.isa()
    assert _C.set_isa("avx2")
    try:
        for act in ACTS:
            x, weight, bias, residual = _linear_case(M, K, N, act, act == "none", seed=5)
            with_vnni = quant.linear(x, weight, bias, act, residual)
            assert _C.testing.set_avx_vnni(False) and not _C.has_avx_vnni()
            try:
                without = quant.linear(x, weight, bias, act, residual)
            finally:
                assert _C.testing.set_avx_vnni(True)
            assert torch.equal(with_vnni, without), act
            _check(with_vnni, x, weight, bias, act, residual)
    finally:
        _C.set_isa(before)


# ----------------------------------------------------------------------------------------------
# A whole model with dtype="int8" on the cpu backend


@pytest.fixture(scope="module")
def tiny_hf():
    from bertfast.tools.workloads import random_hf_model

    return random_hf_model("tiny", seed=3)


def _cpu_backend_reason():
    from bertfast import available_backends

    return available_backends("cpu").get("cpu")


def test_int8_model_close_to_fp32_and_batch_independent(tiny_hf):
    from bertfast import Encoder
    from bertfast.tools.workloads import make_batch

    if _cpu_backend_reason() is not None:
        pytest.skip(f"cpu backend unavailable: {_cpu_backend_reason()}")
    enc = Encoder.from_hf(tiny_hf, backend="cpu", dtype="int8")
    assert enc.quantize == "int8" and enc.dtype == torch.float32
    layer = enc.engine.weights.layers[0]
    assert isinstance(layer.qkv_weight, quant.QuantLinear) and isinstance(layer.ffn_out_weight, quant.QuantLinear)
    cfg = enc.config
    b = make_batch(4, 33, [33, 1, 17, 9], vocab_size=cfg.vocab_size, type_vocab_size=cfg.type_vocab_size, seed=5)
    out = enc(b.input_ids, b.attention_mask, b.token_type_ids)
    with torch.inference_mode():
        ref = tiny_hf(**b.inputs())
    real = b.attention_mask.bool()
    cos = torch.nn.functional.cosine_similarity(out.last_hidden_state[real], ref.last_hidden_state[real], dim=-1)
    assert float(cos.min()) > 0.99
    assert bool((out.last_hidden_state[~real] == 0).all())  # padded positions are exactly 0
    assert float(torch.nn.functional.cosine_similarity(out.pooler_output, ref.pooler_output, dim=-1).min()) > 0.99
    # Per-token scales: a sequence's result does not depend on the rest of its batch.
    alone = enc(b.input_ids[2:3, :17], b.attention_mask[2:3, :17], b.token_type_ids[2:3, :17])
    torch.testing.assert_close(alone.last_hidden_state[0], out.last_hidden_state[2, :17], rtol=0, atol=1e-5)


def test_int8_cpu_backend_errors(tiny_hf):
    from bertfast import Encoder
    from bertfast.backends import get_backend
    from bertfast.loading import load_hf_model

    if _cpu_backend_reason() is not None:
        pytest.skip(f"cpu backend unavailable: {_cpu_backend_reason()}")
    backend = get_backend("cpu", "cpu", quantize="int8")
    with pytest.raises(ValueError, match="int8 quantization starts from float32 weights"):
        backend.prepare(load_hf_model(tiny_hf, torch.bfloat16))
    with pytest.raises(ValueError, match="does not support 'int4'"):
        get_backend("cpu", "cpu", quantize="int4")
    # auto picks a backend that offers int8 (the cpu backend here)
    assert Encoder.from_hf(tiny_hf, backend="auto", dtype="int8").backend == "cpu"


# ----------------------------------------------------------------------------------------------
# The accuracy report: bertfast validate --model DIR --dtype int8


def test_validate_int8_report(tiny_hf, tmp_path, capsys):
    from bertfast.tools.cli import main

    if _cpu_backend_reason() is not None:
        pytest.skip(f"cpu backend unavailable: {_cpu_backend_reason()}")
    tiny_hf.save_pretrained(tmp_path)  # no tokenizer: layer rows only, sentence part reported skipped
    assert main(["validate", "--model", str(tmp_path), "--dtype", "int8"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("embeddings", "layer", "pooler"))]
    assert [r[0] for r in rows] == ["embeddings", "layer1", "layer2", "pooler"]
    assert all(r[2] == "int8" and "PASS" in r for r in rows)
    assert "sentence embeddings: skipped" in out
    assert main(["validate", "--dtype", "int8"]) == 2
    assert "needs --model" in capsys.readouterr().err
    assert main(["validate", "--model", str(tmp_path), "--dtype", "int8", "--backend", "torch"]) == 2
    assert "does not support 'int8'" in capsys.readouterr().err
    assert main(["validate", "--model", str(tmp_path), "--dtype", "int8,fp32"]) == 2


def test_bench_int8_rows():
    from bertfast.tools.bench import runner
    from bertfast.tools.bench.source import load_source
    from bertfast.tools.workloads import Workload

    source = load_source(config_name="tiny")
    rows = runner.run_bench(source, [Workload.parse("b2xs16-uniform")], ["fp32", "bf16"],
                           ["bertfast-int8", "onnxruntime-int8", "ctranslate2-int8"], repeats=1, min_repeats=1,
                           progress=None, isolation="none")
    by = {(r.provider, r.dtype): r for r in rows}
    for name in ("bertfast-int8", "onnxruntime-int8", "ctranslate2-int8"):
        row = by[(name, "fp32")]
        if row.status == "skipped":  # not installed, or no cpu backend: the reason says so
            assert "not installed" in row.reason or "backend" in row.reason, row.reason
            continue
        assert row.status == "ok", row.reason
        assert row.info["min_token_cosine"] >= runner.INT8_MIN_COSINE and row.tolerance is None
        assert by[(name, "bf16")].status == "skipped" and "fp32 pass" in by[(name, "bf16")].reason
