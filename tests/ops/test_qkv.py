"""Fused QKV projection (bertfast.kernels.triton.qkv) vs the reference: values, layout, folded scale."""

from __future__ import annotations

import pytest
import torch

from bertfast import reference as ref
from bertfast.kernels.triton import qkv as qkv_mod
from bertfast.kernels.triton.qkv import qkv

from .conftest import DTYPES, NoLaunch, assert_matches_reference, f64, rand

# (T, hidden, heads): head dims 32, 26 (odd), 80, 64; T = 1, 7, 65.
SHAPES = [
    pytest.param(1, 64, 2, id="T1-H64-h2-d32"),
    pytest.param(7, 52, 2, id="T7-H52-h2-d26"),
    pytest.param(65, 80, 1, id="T65-H80-h1-d80"),
    pytest.param(33, 128, 2, id="T33-H128-h2-d64"),
]


def operands(T, H, dtype, noncontig=False):
    x = rand(T, H, dtype=dtype, noncontig=noncontig)
    w = rand(3 * H, H, dtype=dtype, seed=1, scale=H ** -0.5)
    b = rand(3 * H, dtype=dtype, seed=2, scale=0.5)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,heads", SHAPES)
def test_qkv_matches_reference(T, H, heads, dtype):
    x, w, b = operands(T, H, dtype)
    ours = qkv(x, w, b, heads)
    low, hi = ref.qkv(x, w, b, heads), ref.qkv(*f64(x, w, b), heads)
    for name, o, lo, h in zip("qkv", ours, low, hi):
        assert o.shape == (T, heads, H // heads) and o.is_contiguous(), name
        assert_matches_reference(o, lo, h, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_folded_into_q_only(dtype):
    T, H, heads, scale = 17, 52, 2, 26 ** -0.5
    x, w, b = operands(T, H, dtype, noncontig=True)
    q, k, v = qkv(x, w, b, heads, q_scale=scale)
    qr, kr, vr = ref.qkv(x, w, b, heads)
    qh, kh, vh = ref.qkv(*f64(x, w, b), heads)
    assert_matches_reference(q, qr * scale, qh * scale, dtype, "scaled q")
    assert_matches_reference(k, kr, kh, dtype, "k")
    assert_matches_reference(v, vr, vh, dtype, "v")


def test_no_bias_and_empty():
    x, w, _ = operands(5, 32, torch.float32)
    q, k, v = qkv(x, w, None, 4)
    qh, kh, vh = ref.qkv(*f64(x, w), None, 4)
    for o, h in ((q, qh), (k, kh), (v, vh)):
        assert_matches_reference(o, h.float(), h, torch.float32, "no bias")
    q, k, v = qkv(x[:0], w, None, 4)
    assert q.shape == k.shape == v.shape == (0, 4, 8)


@pytest.mark.parametrize("case", ["dtype-fp64", "weight-shape", "bias-shape", "heads-not-dividing",
                                  "mixed-dtype", "device-meta"])
def test_bad_input_raises_before_launch(case, monkeypatch):
    monkeypatch.setattr(qkv_mod, "_qkv_kernel", NoLaunch())
    x, w, b = operands(4, 32, torch.float32)
    args = [x, w, b, 4]
    if case == "dtype-fp64":
        args = [x.double(), w.double(), b.double(), 4]
    elif case == "weight-shape":
        args[1] = rand(3 * 32, 31)
    elif case == "bias-shape":
        args[2] = rand(95)
    elif case == "heads-not-dividing":
        args[3] = 5
    elif case == "mixed-dtype":
        args[2] = b.half()
    elif case == "device-meta":
        args = [x.to("meta"), w.to("meta"), b.to("meta"), 4]
    with pytest.raises(ValueError, match="qkv: "):
        qkv(*args)
