"""GEMM + bias + activation / residual epilogues (bertfast.kernels.triton.linear) vs the reference."""

from __future__ import annotations

import pytest
import torch

from bertfast import reference as ref
from bertfast.kernels.triton import _common
from bertfast.kernels.triton import linear as linear_mod
from bertfast.kernels.triton.linear import linear, linear_gelu, linear_residual

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
