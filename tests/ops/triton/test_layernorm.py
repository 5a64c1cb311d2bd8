"""Residual + LayerNorm (bertfast.kernels.triton.layernorm) vs the reference, including rows far from zero."""

from __future__ import annotations

import pytest
import torch

from bertfast import reference as ref
from bertfast.kernels.triton import layernorm as layernorm_mod
from bertfast.kernels.triton.layernorm import layernorm

from .conftest import DTYPES, NoLaunch, assert_matches_reference, f64, rand

SHAPES = [
    pytest.param(1, 96, id="M1-N96"),
    pytest.param(7, 26, id="M7-N26"),
    pytest.param(65, 768, id="M65-N768"),
    pytest.param(3, 1000, id="M3-N1000"),
]


def operands(M, N, dtype, offset=0.0, noncontig=False):
    x = rand(M, N, dtype=dtype, offset=offset, noncontig=noncontig)
    w = rand(N, dtype=dtype, seed=1, scale=0.3, offset=1.0)
    b = rand(N, dtype=dtype, seed=2, scale=0.3)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("M,N", SHAPES)
def test_layernorm_matches_reference(M, N, residual, dtype):
    x, w, b = operands(M, N, dtype)
    r = rand(M, N, dtype=dtype, seed=5, scale=2.0) if residual else None
    assert_matches_reference(layernorm(x, w, b, 1e-12, residual=r), ref.layernorm(x, w, b, 1e-12, r),
                             ref.layernorm(*f64(x, w, b), 1e-12, f64(r) if residual else None), dtype, "layernorm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_offset_rows_do_not_cancel(dtype):
    # Rows with mean ~100 and unit spread: E[x^2] - E[x]^2 would lose every digit in fp32.
    x, w, b = operands(9, 384, dtype, offset=100.0)
    r = rand(9, 384, dtype=dtype, seed=4, scale=0.5, offset=-20.0)
    assert_matches_reference(layernorm(x, w, b, 1e-5, residual=r), ref.layernorm(x, w, b, 1e-5, r),
                             ref.layernorm(*f64(x, w, b), 1e-5, f64(r)), dtype, "offset rows")


def test_eps_is_a_runtime_argument_and_used():
    # With a spread of 0.1 (variance 0.01) eps = 1e-2 changes the output by ~30%: two eps values
    # must give two results from the same compiled kernel.
    x = torch.full((2, 64), 3.0) + rand(2, 64, scale=0.1)
    w, b = torch.ones(64), torch.zeros(64)
    a, c = layernorm(x, w, b, 1e-12), layernorm(x, w, b, 1e-2)
    for out, eps in ((a, 1e-12), (c, 1e-2)):
        assert_matches_reference(out, ref.layernorm(x, w, b, eps), ref.layernorm(*f64(x, w, b), eps),
                                 torch.float32, f"eps={eps}")
    assert (a - c).abs().max() > 0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_noncontiguous(dtype):
    x, w, b = operands(17, 48, dtype, noncontig=True)
    r = rand(17, 48, dtype=dtype, seed=3, noncontig=True)
    assert_matches_reference(layernorm(x, w, b, 1e-12, residual=r), ref.layernorm(x, w, b, 1e-12, r),
                             ref.layernorm(*f64(x, w, b), 1e-12, f64(r)), dtype, "noncontiguous")


@pytest.mark.parametrize("case", ["dtype-fp64", "weight-shape", "residual-shape", "eps", "mixed-dtype",
                                  "device-meta", "3d-input"])
def test_bad_input_raises_before_launch(case, monkeypatch):
    monkeypatch.setattr(layernorm_mod, "_layernorm_kernel", NoLaunch())
    x, w, b = operands(4, 16, torch.float32)
    args = dict(x=x, weight=w, bias=b, eps=1e-12, residual=None)
    if case == "dtype-fp64":
        args.update(x=x.double(), weight=w.double(), bias=b.double())
    elif case == "weight-shape":
        args.update(weight=rand(15))
    elif case == "residual-shape":
        args.update(residual=rand(4, 15))
    elif case == "eps":
        args.update(eps=0.0)
    elif case == "mixed-dtype":
        args.update(residual=rand(4, 16).half())
    elif case == "device-meta":
        args.update(x=x.to("meta"), weight=w.to("meta"), bias=b.to("meta"))
    elif case == "3d-input":
        args.update(x=x[None])
    with pytest.raises(ValueError, match="layernorm: "):
        layernorm(**args)
