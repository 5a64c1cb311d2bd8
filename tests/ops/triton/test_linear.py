"""GEMM + bias + activation / residual epilogues and the gated (GLU) epilogue (bertfast.kernels.triton.linear)
vs the reference."""

from __future__ import annotations

import pytest
import torch

from bertfast import reference as ref
from bertfast.kernels.activation import GATED_IDS
from bertfast.kernels.triton import _common
from bertfast.kernels.triton import linear as linear_mod
from bertfast.kernels.triton.linear import linear, linear_gated, linear_gelu, linear_residual

from .conftest import DTYPES, NoLaunch, assert_matches_reference, f64, rand

# (M, N, K): token counts 1, 7, 65, 129 (tails of every block), K not a multiple of BLOCK_K.
SHAPES = [
    pytest.param(1, 96, 80, id="M1-N96-K80"),
    pytest.param(7, 48, 26, id="M7-N48-K26"),
    pytest.param(65, 96, 80, id="M65-N96-K80"),
    pytest.param(129, 72, 130, id="M129-N72-K130"),
]


def operands(M, N, K, dtype, noncontig=False, seed=0):
    x = rand(M, K, dtype=dtype, seed=seed, noncontig=noncontig)
    w = rand(N, K, dtype=dtype, seed=seed + 1, scale=K ** -0.5)
    b = rand(N, dtype=dtype, seed=seed + 2, scale=0.5)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_linear_gelu(M, N, K, act, dtype):
    x, w, b = operands(M, N, K, dtype)
    assert_matches_reference(linear_gelu(x, w, b, act), ref.linear_gelu(x, w, b, act),
                             ref.linear_gelu(*f64(x, w, b), act), dtype, f"linear_gelu[{act}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_linear_residual(M, N, K, dtype):
    x, w, b = operands(M, N, K, dtype)
    r = rand(M, N, dtype=dtype, seed=7, offset=3.0)
    assert_matches_reference(linear_residual(x, w, b, r), ref.linear_residual(x, w, b, r),
                             ref.linear_residual(*f64(x, w, b, r)), dtype, "linear_residual")


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_and_no_bias(dtype):
    # The pooler's activation, and the plain GEMM without bias.
    x, w, b = operands(9, 40, 33, dtype)
    assert_matches_reference(linear(x, w, b, activation="tanh"), ref.pooler(x, w, b), ref.pooler(*f64(x, w, b)),
                             dtype, "tanh")
    assert_matches_reference(linear(x, w), x @ w.T, f64(x) @ f64(w).T, dtype, "no bias")


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_saturates_without_nan(dtype):
    x = torch.tensor([[60.0], [-60.0], [0.0]], dtype=dtype)
    w = torch.ones(2, 1, dtype=dtype)
    out = linear(x, w, None, activation="tanh")
    assert torch.equal(out, torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]], dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous_inputs(dtype):
    M, N, K = 65, 48, 40
    x, w, b = operands(M, N, K, dtype, noncontig=True)
    wt = rand(K, N, dtype=dtype, seed=3, scale=K ** -0.5).T  # (N, K) view, column-major
    r = rand(M, N, dtype=dtype, seed=4, noncontig=True)
    assert_matches_reference(linear(x, wt, b, activation="gelu", residual=r),
                             ref.linear_gelu(x, wt, b) + r, ref.linear_gelu(*f64(x, wt, b)) + f64(r), dtype,
                             "noncontiguous")


def test_empty_tokens():
    x, w, b = operands(0, 16, 8, torch.float32)
    out = linear_gelu(x, w, b)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("case", ["dtype-fp64", "mixed-dtype", "K-mismatch", "bias-shape", "residual-shape",
                                  "activation", "device-meta", "int-input"])
def test_bad_input_raises_before_launch(case, monkeypatch):
    monkeypatch.setattr(linear_mod, "_linear_kernel", NoLaunch())
    x, w, b = operands(4, 8, 6, torch.float32)
    args = dict(x=x, weight=w, bias=b, activation="none", residual=None)
    if case == "dtype-fp64":
        args.update(x=x.double(), weight=w.double(), bias=b.double())
    elif case == "mixed-dtype":
        args.update(weight=w.half())
    elif case == "K-mismatch":
        args.update(weight=rand(8, 5))
    elif case == "bias-shape":
        args.update(bias=rand(9))
    elif case == "residual-shape":
        args.update(residual=rand(4, 9))
    elif case == "activation":
        args.update(activation="swish")
    elif case == "device-meta":
        args.update(x=x.to("meta"), weight=w.to("meta"), bias=b.to("meta"))
    elif case == "int-input":
        args.update(x=torch.ones(4, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="linear: "):
        linear(**args)


def test_config_filter_fits_the_problem():
    # The compiled-mode autotune list (a single config under the interpreter) and its filter.
    f16, f32 = torch.empty(0, dtype=torch.float16), torch.empty(0, dtype=torch.float32)
    prune, every = _common._prune_configs, _common._CONFIGS
    small = prune(every, {"M": 16, "x_ptr": f16})
    assert small and all(c.kwargs["BLOCK_M"] <= 64 for c in small)
    # Tensor-core tiles for fp16, FMA tiles (short K steps) for exact fp32, never mixed.
    assert prune(every, {"M": 4096, "x_ptr": f16}) == _common.MMA_CONFIGS
    fp32 = prune(every, {"M": 4096, "x_ptr": f32})
    assert fp32 == _common.FMA_CONFIGS and all(c.kwargs["BLOCK_K"] <= 32 for c in fp32)
    assert len(_common.CONFIGS) == 1  # this suite runs under TRITON_INTERPRET=1


# ---- the gated projection (GeGLU, SwiGLU): two accumulators, the gate in the epilogue ----


def gated_operands(M, N, K, dtype, noncontig=False, seed=0):
    x = rand(M, K, dtype=dtype, seed=seed, noncontig=noncontig)
    w = rand(2 * N, K, dtype=dtype, seed=seed + 1, scale=K ** -0.5)
    b = rand(2 * N, dtype=dtype, seed=seed + 2, scale=0.5)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", GATED_IDS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_linear_gated(M, N, K, act, dtype):
    x, w, b = gated_operands(M, N, K, dtype)
    assert_matches_reference(linear_gated(x, w, b, act), ref.linear_glu(x, w, b, act),
                             ref.linear_glu(*f64(x, w, b), act), dtype, f"linear_gated[{act}]")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_linear_gated_no_bias_noncontiguous(act, dtype):
    # ModernBERT and NomicBERT have no FFN biases; a strided x and a column-major weight.
    M, N, K = 33, 40, 48
    x, _, _ = gated_operands(M, N, K, dtype, noncontig=True)
    w = rand(K, 2 * N, dtype=dtype, seed=5, scale=K ** -0.5).T
    assert_matches_reference(linear_gated(x, w, None, act), ref.linear_glu(x, w, None, act),
                             ref.linear_glu(*f64(x, w), None, act), dtype, f"gated no bias[{act}]")


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_epilogue_saturates_without_nan(dtype):
    # silu(+-100) and silu(+-1000): 100, 1000 and (sub)normal values near -0, no inf or NaN inside (the test runs
    # with numpy's overflow warnings as errors); the plain kernel takes silu too.
    x = torch.tensor([[100.0], [-100.0], [1000.0], [-1000.0], [0.0]], dtype=torch.float32)
    expected = torch.nn.functional.silu(x.double())
    out = linear(x.to(dtype), torch.ones(1, 1, dtype=dtype), None, activation="silu")
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), atol=1e-40, rtol=1e-6)
    gated = linear_gated(x[:3].to(dtype), torch.tensor([[1.0], [0.01]], dtype=dtype), None, "silu")
    torch.testing.assert_close(gated.double(), (expected[:3] * x[:3].double() * 0.01).to(dtype).double(),
                               atol=1e-40, rtol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_linear_silu(dtype):
    x, w, b = operands(9, 40, 33, dtype)
    assert_matches_reference(linear(x, w, b, activation="silu"), ref.activation(ref.linear(x, w, b), "silu"),
                             ref.activation(ref.linear(*f64(x, w, b)), "silu"), dtype, "silu")


def test_linear_gated_empty():
    x, w, b = gated_operands(0, 16, 8, torch.float32)
    assert linear_gated(x, w, b, "gelu").shape == (0, 16)


@pytest.mark.parametrize("case", ["odd-rows", "bias-half", "activation-tanh", "activation-none", "mixed-dtype",
                                  "K-mismatch", "device-meta"])
def test_gated_bad_input_raises_before_launch(case, monkeypatch):
    monkeypatch.setattr(linear_mod, "_linear_gated_kernel", NoLaunch())
    x, w, b = gated_operands(4, 8, 6, torch.float32)
    args = dict(x=x, weight=w, bias=b, activation="gelu")
    if case == "odd-rows":
        args.update(weight=rand(15, 6), bias=None)
    elif case == "bias-half":
        args.update(bias=rand(8))
    elif case == "activation-tanh":
        args.update(activation="tanh")
    elif case == "activation-none":
        args.update(activation="none")
    elif case == "mixed-dtype":
        args.update(bias=b.half())
    elif case == "K-mismatch":
        args.update(weight=rand(16, 5))
    elif case == "device-meta":
        args.update(x=x.to("meta"), weight=w.to("meta"), bias=b.to("meta"))
    with pytest.raises(ValueError, match="linear_gated: "):
        linear_gated(**args)


def test_pair_config_filter_fits_the_problem():
    # The two-accumulator kernels (gated linear, rotary QKV) take their own, narrower tiles.
    f16, f32 = torch.empty(0, dtype=torch.float16), torch.empty(0, dtype=torch.float32)
    prune, every = _common._prune_pair_configs, _common._PAIR_CONFIGS
    assert prune(every, {"M": 4096, "x_ptr": f16}) == _common.PAIR_MMA_CONFIGS
    assert prune(every, {"M": 4096, "x_ptr": f32}) == _common.PAIR_FMA_CONFIGS
    small = prune(every, {"M": 16, "x_ptr": f16})
    assert small and all(c.kwargs["BLOCK_M"] <= 64 for c in small)
    assert len(_common.PAIR_CONFIGS) == 1  # this suite runs under TRITON_INTERPRET=1
