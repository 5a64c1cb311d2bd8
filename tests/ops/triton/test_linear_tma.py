"""The Hopper TMA GEMM (bertfast.kernels.triton.linear_tma) under the Triton interpreter, which runs its host-side TMA
descriptors (zero fill past the tensor's edges included) and its persistent loop; the wgmma and warp-specialised
builds themselves are checked by `bertfast kernels` (tests/test_aot_report.py). Each epilogue and the QKV split
against the reference, each tile, token counts 1, 17, 129 and 257 (tails of both tiles' BLOCK_M), N and K past a
block (144 = 128 + 16, 80 = 64 + 16); a row alone equals, bit for bit, the same row in a batch of more than twice the
largest tile; the schedule (how many programs share the tiles) changes no bit; inputs TMA cannot take are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bertfast import reference as ref
from bertfast.kernels import activation
from bertfast.kernels.activation import IDS as ACTIVATIONS
from bertfast.kernels.triton import linear_tma as tma_mod
from bertfast.kernels.triton import qkv as qkv_mod
from bertfast.kernels.triton.linear_tma import TILES, linear_tma, qkv_tma

from .conftest import DTYPES, NoLaunch, assert_matches_reference, f64, rand

TILE_NAMES = [pytest.param(t, id=t) for t in TILES]
SHAPES = [
    pytest.param(1, 144, 80, id="M1-N144-K80"),
    pytest.param(17, 48, 32, id="M17-N48-K32"),
    pytest.param(129, 144, 80, id="M129-N144-K80"),
    pytest.param(257, 32, 144, id="M257-N32-K144"),
]
LARGEST_BLOCK_M = max(c.kwargs["BLOCK_M"] for c in TILES.values())


def operands(M, N, K, dtype, seed=0):
    x = rand(M, K, dtype=dtype, seed=seed)
    w = rand(N, K, dtype=dtype, seed=seed + 1, scale=K ** -0.5)
    b = rand(N, dtype=dtype, seed=seed + 2, scale=0.5)
    return x, w, b


def reference(x, w, b, act="none", residual=None):
    out = activation.apply(F.linear(x, w, b), act)
    return out if residual is None else out + residual


@pytest.mark.parametrize("tile", TILE_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_bias_gelu_and_residual(M, N, K, dtype, tile):
    x, w, b = operands(M, N, K, dtype)
    r = rand(M, N, dtype=dtype, seed=7, offset=3.0)
    assert_matches_reference(linear_tma(x, w, b, "gelu", tile=tile), ref.linear_gelu(x, w, b),
                             ref.linear_gelu(*f64(x, w, b)), dtype, "gelu")
    assert_matches_reference(linear_tma(x, w, b, residual=r, tile=tile), ref.linear_residual(x, w, b, r),
                             ref.linear_residual(*f64(x, w, b, r)), dtype, "residual")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_every_activation_with_and_without_bias(act, dtype):
    x, w, b = operands(33, 48, 80, dtype, seed=3)
    r = rand(33, 96, dtype=dtype, seed=4)[:, ::2]  # a residual of column stride 2: any strides
    assert_matches_reference(linear_tma(x, w, b, act, r), reference(x, w, b, act, r),
                             reference(*f64(x, w, b), act, f64(r)), dtype, f"{act}+residual")
    assert_matches_reference(linear_tma(x, w, None, act), reference(x, w, None, act),
                             reference(*f64(x, w), None, act), dtype, f"{act}, no bias")


@pytest.mark.parametrize("tile", TILE_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [None, 0.125], ids=["no-scale", "q-scale"])
def test_qkv_split(scale, dtype, tile):
    T, H, heads = 129, 64, 4  # 3H = 192: a column tile straddles the q | k and k | v planes
    x, w, b = operands(T, 3 * H, H, dtype, seed=5)
    ours = qkv_tma(x, w, b, heads, q_scale=scale, tile=tile)
    low, hi = ref.qkv(x, w, b, heads), ref.qkv(*f64(x, w, b), heads)
    for name, o, lo, h in zip("qkv", ours, low, hi):
        s = scale if (scale is not None and name == "q") else 1.0
        assert o.shape == (T, heads, H // heads) and o.is_contiguous()
        assert_matches_reference(o, lo * s, h * s, dtype, f"{name}")
    # The layout of qkv.qkv: the same planes, views of one (3, T, heads, d) buffer.
    theirs = qkv_mod.qkv(x, w, b, heads, q_scale=scale)
    assert [o.stride() for o in ours] == [t.stride() for t in theirs]
    assert ours[1].data_ptr() - ours[0].data_ptr() == T * H * x.element_size()


@pytest.mark.parametrize("tile", TILE_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_alone_equals_the_row_in_a_batch(dtype, tile):
    M = 2 * LARGEST_BLOCK_M + 45  # 301 tokens: three row tiles of 128, five of 64
    N, K = 144, 80
    x, w, b = operands(M, N, K, dtype, seed=11)
    r = rand(M, N, dtype=dtype, seed=12)
    batch = linear_tma(x, w, b, "gelu", r, tile=tile)
    xq, wq = x[:, :64].contiguous(), rand(192, 64, dtype=dtype, seed=13)
    q, k, v = qkv_tma(xq, wq, None, 2, 0.125, tile=tile)
    for row in (0, 63, 64, 127, 128, 200, M - 1):
        alone = linear_tma(x[row:row + 1], w, b, "gelu", r[row:row + 1], tile=tile)
        assert torch.equal(alone, batch[row:row + 1]), f"row {row}"
        planes = qkv_tma(xq[row:row + 1], wq, None, 2, 0.125, tile=tile)
        for name, p, whole in zip("qkv", planes, (q, k, v)):
            assert torch.equal(p, whole[row:row + 1]), f"{name} row {row}"


@pytest.mark.parametrize("programs", [1, 2, 7])
def test_the_schedule_changes_no_bit(programs, monkeypatch):
    # The persistent loop's programs take tiles tile_id = pid, pid + programs, ...: every tile once, in any number of
    # programs, each tile's K loop the same.
    x, w, b = operands(150, 144, 80, torch.float16, seed=21)
    expected = linear_tma(x, w, b, "relu")
    monkeypatch.setattr(tma_mod, "INTERPRETER_PROGRAMS", programs)
    assert torch.equal(linear_tma(x, w, b, "relu"), expected)


def test_the_tile_never_depends_on_the_call():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for tile in TILES:
            config = tma_mod.config_for(dtype, tile)
            assert config.kwargs["BLOCK_M"] >= 64 and config.num_warps >= 4  # wgmma's minimum on fp16/bf16
    assert tma_mod.config_for(torch.float16) is TILES[tma_mod.DEFAULT_TILE]
    with pytest.raises(ValueError, match="unknown TMA tile 'huge'"):
        tma_mod.config_for(torch.float16, "huge")


def test_empty_tokens():
    x, w, b = operands(0, 48, 32, torch.float32)
    assert linear_tma(x, w, b).shape == (0, 48)
    assert [p.shape for p in qkv_tma(torch.empty(0, 32), torch.empty(96, 32), None, 2)] == [(0, 2, 16)] * 3


@pytest.mark.parametrize("case", ["N-not-16", "K-not-16", "K-zero", "x-column-stride", "x-misaligned",
                                  "weight-column-major", "tile", "activation", "mixed-dtype", "residual-shape",
                                  "qkv-heads", "qkv-weight-shape"])
def test_what_tma_cannot_take_raises_before_launch(case, monkeypatch):
    monkeypatch.setattr(tma_mod, "_linear_tma_kernel", NoLaunch())
    x, w, b = operands(8, 48, 32, torch.float32)
    args = dict(x=x, weight=w, bias=b, activation="none", residual=None)
    match = "linear_tma: "
    if case == "N-not-16":
        args.update(weight=rand(40, 32), bias=rand(40))
        match += "the TMA kernel needs N and K multiples of 16, got N = 40"
    elif case == "K-not-16":
        args.update(x=rand(8, 24), weight=rand(48, 24))
        match += "the TMA kernel needs N and K multiples of 16, got N = 48, K = 24"
    elif case == "K-zero":
        args.update(x=rand(8, 0), weight=rand(48, 0))
        match += "K = 0"
    elif case == "x-column-stride":
        args.update(x=rand(8, 64)[:, ::2])
        match += "x must have unit stride along K"
    elif case == "x-misaligned":
        args.update(x=rand(8, 33)[:, 1:])  # rows of 33 floats: not 16-byte aligned
        match += "x must have unit stride along K and 16-byte aligned rows"
    elif case == "weight-column-major":
        args.update(weight=rand(32, 48).T)
        match += "weight must have unit stride along K"
    elif case == "tile":
        args.update(tile="huge")
        match = "unknown TMA tile"
    elif case == "activation":
        args.update(activation="swish")
        match += "unknown activation"
    elif case == "mixed-dtype":
        args.update(weight=w.half())
        match += "weight has dtype"
    elif case == "residual-shape":
        args.update(residual=rand(8, 47))
        match += "residual has shape"
    if case.startswith("qkv"):
        heads, wq = (3, rand(96, 32)) if case == "qkv-heads" else (2, rand(48, 32))
        with pytest.raises(ValueError, match=r"qkv_tma: " + ("num_heads" if case == "qkv-heads" else
                                                              r".*weight must be \(96, K\)")):
            qkv_tma(x, wq, None, heads)
        return
    with pytest.raises(ValueError, match=match):
        linear_tma(**args)
