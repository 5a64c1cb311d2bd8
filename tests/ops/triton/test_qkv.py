"""Fused QKV projection (bertfast.kernels.triton.qkv) vs the reference: values, layout, folded scale, rotary
position embeddings in the epilogue."""

from __future__ import annotations

import pytest
import torch

from bertfast import reference as ref
from bertfast.backends import Rotary
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


# ---- rotary position embeddings in the epilogue ----


def rope_tables(positions, d, theta=10000.0):
    """Rotary (cos, sin), (T, d/2) float32, from per-token positions as a model builds them."""
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return Rotary(angles.cos().float(), angles.sin().float())


def packed_positions(lengths, start=0):
    """Each sequence's positions restart at `start`: the packed layout's per-token positions."""
    return [start + i for n in lengths for i in range(n)]


def rotate64(x, rotary):
    # The fp64 oracle of the rotation: reference.rotate computes in fp32 by contract (x.float()), which
    # would round an fp64 input.
    half = x.shape[-1] // 2
    cos, sin = rotary.cos.double()[:, None, :], rotary.sin.double()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_references(x, w, b, heads, rotary):
    low = ref.qkv(x, w, b, heads, rotary)
    q, k, v = ref.qkv(*f64(x, w, b), heads)
    return low, (rotate64(q, rotary), rotate64(k, rotary), v)


# (lengths, hidden, heads): head dims 32, 26 (d/2 odd), 80, 64; a 1-token row, lengths 127 and 129
# (positions to 128), a 1-token batch.
ROTARY_SHAPES = [
    pytest.param([1], 64, 2, id="L1-H64-h2-d32"),
    pytest.param([1, 6, 2], 52, 2, id="L1-6-2-H52-h2-d26"),
    pytest.param([5, 60], 160, 2, id="L5-60-H160-h2-d80"),
    pytest.param([127, 1, 1], 64, 1, id="L127-1-1-H64-h1-d64"),
    pytest.param([129], 64, 1, id="L129-H64-h1-d64"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths,H,heads", ROTARY_SHAPES)
def test_rotary_matches_reference(lengths, H, heads, dtype):
    T = sum(lengths)
    x, w, b = operands(T, H, dtype)
    rotary = rope_tables(packed_positions(lengths), H // heads)
    ours = qkv(x, w, b, heads, rotary=rotary)
    low, hi = rotary_references(x, w, b, heads, rotary)
    for name, o, lo, h in zip("qkv", ours, low, hi):
        assert o.shape == (T, heads, H // heads) and o.is_contiguous(), name
        assert_matches_reference(o, lo, h, dtype, f"rotary {name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_large_positions_no_bias_noncontiguous(dtype):
    # ModernBERT's long context (positions ~8k, theta 160k), no QKV bias, a strided x and a transposed
    # (column-major) weight; v must equal the unrotated projection.
    T, H, heads = 9, 64, 2
    x, _, _ = operands(T, H, dtype, noncontig=True)
    w = rand(H, 3 * H, dtype=dtype, seed=4, scale=H ** -0.5).T
    rotary = rope_tables(list(range(8000, 8000 + T)), H // heads, theta=160000.0)
    ours = qkv(x, w, None, heads, rotary=rotary)
    low, hi = rotary_references(x, w, None, heads, rotary)
    for name, o, lo, h in zip("qkv", ours, low, hi):
        assert_matches_reference(o, lo, h, dtype, f"rotary {name}")
    assert torch.equal(ours[2], qkv(x, w, None, heads)[2])


def test_rotary_identity_tables_change_nothing():
    # cos = 1, sin = 0: the rotary kernel's pairing of columns gives the plain projection bit for bit.
    x, w, b = operands(17, 52, torch.float32)
    ones = torch.ones(17, 13)
    rotated = qkv(x, w, b, 2, rotary=Rotary(ones, torch.zeros(17, 13)))
    for o, p in zip(rotated, qkv(x, w, b, 2)):
        torch.testing.assert_close(o, p, atol=1e-6, rtol=1e-6)


def test_rotary_with_folded_scale():
    T, H, heads, scale = 11, 64, 2, 0.125
    x, w, b = operands(T, H, torch.float32)
    rotary = rope_tables(packed_positions([4, 7]), H // heads)
    q, k, v = qkv(x, w, b, heads, q_scale=scale, rotary=rotary)
    (ql, kl, _), (qh, kh, _) = rotary_references(x, w, b, heads, rotary)
    assert_matches_reference(q, ql * scale, qh * scale, torch.float32, "scaled rotary q")
    assert_matches_reference(k, kl, kh, torch.float32, "rotary k")


def test_rotary_empty():
    x, w, b = operands(0, 32, torch.float32)
    q, k, v = qkv(x, w, b, 2, rotary=rope_tables([], 16))
    assert q.shape == k.shape == v.shape == (0, 2, 16)


@pytest.mark.parametrize("case", ["odd-head-dim", "table-fp16", "table-shape", "table-rows", "not-a-pair",
                                  "table-device"])
def test_rotary_bad_input_raises_before_launch(case, monkeypatch):
    monkeypatch.setattr(qkv_mod, "_qkv_rotary_kernel", NoLaunch())
    x, w, b = operands(4, 32, torch.float32)
    heads, rotary = 2, rope_tables(range(4), 16)
    if case == "odd-head-dim":
        x, w, b = operands(4, 30, torch.float32)
        heads, rotary = 2, Rotary(torch.ones(4, 7), torch.zeros(4, 7))
    elif case == "table-fp16":
        rotary = Rotary(rotary.cos.half(), rotary.sin.half())
    elif case == "table-shape":
        rotary = Rotary(rotary.cos[:, :4], rotary.sin[:, :4])
    elif case == "table-rows":
        rotary = Rotary(rotary.cos[:3], rotary.sin[:3])
    elif case == "not-a-pair":
        rotary = rotary.cos
    elif case == "table-device":
        rotary = Rotary(rotary.cos.to("meta"), rotary.sin.to("meta"))
    with pytest.raises(ValueError, match="qkv: "):
        qkv(x, w, b, heads, rotary=rotary)
