"""The AMX GEMMs' two kernels (csrc/cpu/gemm/amx_gemm.h): the blocked kernel is the streaming kernel bit for bit, bf16
and int8, on the amx_emulated tier (the tile instructions emulated, any CPU with AVX-512 BF16) and on the amx tier.

Shapes cross every edge of the blocked kernel: 16-row tile blocks and 32-row pairs with their tails, work items
(up to 256 rows by default; the blocking test's items of 32, 64 and 128 rows split M = 161 in several), 48-column
units (a bf16 panel; three int8 panels of 16, the last unit short), K in one and several blocks of 8 tile steps
(bf16: 256 elements, int8: 512 codes), with bias, activation and residual epilogues. Then batch invariance across the
kernels' threshold: a row alone (the streaming kernel) is the same row inside a batch past the threshold (the blocked
one), in the default (auto) mode.
Shapes stay small: the emulated tiles are slow.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from bertfast.backends.cpu import quant

_C = pytest.importorskip("bertfast._C")

# The largest routing threshold of the AMX GEMMs (kAmxBlockedRowsBf16, amx_gemm.h; int8 runs blocked from one row):
# batches in the invariance tests exceed twice this.
THRESHOLD = 128


def both_kernels(run):
    """run() under the streaming kernel, then under the blocked one."""
    outs = []
    for mode in ("stream", "blocked"):
        _C.testing.set_amx_gemm(mode)
        outs.append(run())
    return outs


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    bias, res = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    return x.to(dtype), w.to(dtype), bias.to(dtype), res.to(dtype)


EPILOGUES = [("none", False, False), ("gelu", True, False), ("none", True, True), ("gelu_tanh", False, True)]
EPILOGUE_IDS = ["plain", "bias-gelu", "bias-residual", "gelu_tanh-residual"]

# (m, n, k): rows at and around the tile, pair and item edges; columns around the 16-column groups and 48-column
# units; K in one block, just past it, and three and a bit blocks.
BF16_SHAPES = [(1, 16, 32), (15, 47, 256), (17, 48, 288), (33, 49, 64), (47, 100, 544), (64, 144, 96),
               (129, 97, 288), (161, 150, 32)]


@pytest.mark.parametrize("act,has_bias,has_res", EPILOGUES, ids=EPILOGUE_IDS)
@pytest.mark.parametrize("m,n,k", BF16_SHAPES, ids=lambda v: str(v))
def test_bf16_blocked_is_the_stream_kernel(tiles, m, n, k, act, has_bias, has_res):
    x, w, bias, res = _inputs(m, n, k, torch.bfloat16, seed=m * 7 + n * 3 + k)
    packed = _C.pack_linear(w)
    stream, blocked = both_kernels(
        lambda: _C.linear(x, packed, n, bias if has_bias else None, act, res if has_res else None))
    assert torch.equal(stream, blocked)
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float() if has_bias else None)
    ref = {"none": ref, "gelu": torch.nn.functional.gelu(ref),
           "gelu_tanh": torch.nn.functional.gelu(ref, approximate="tanh")}[act]
    ref = ref + res.float() if has_res else ref
    torch.testing.assert_close(blocked.float(), ref, rtol=2e-2, atol=2e-2)  # and right, not merely the same


def test_bf16_strided_rows(tiles):
    """x rows further apart than K (a view into a wider tensor): both kernels read the A tiles at x's stride."""
    x, w, bias, _ = _inputs(70, 60, 320, torch.bfloat16, seed=11)
    wide = torch.cat([x, x[:, :64]], dim=1)[:, :320]
    packed = _C.pack_linear(w)
    stream, blocked = both_kernels(lambda: _C.linear(wide, packed, 60, bias, "none", None))
    assert torch.equal(stream, blocked) and torch.equal(blocked, _C.linear(x, packed, 60, bias, "none", None))


# (m, n, k): as for bf16; n = 16 * 7 + 5 leaves the last unit one short panel of 5 columns; K: one block of 512
# codes, just past it, three and a bit.
INT8_SHAPES = [(1, 16, 64), (17, 47, 512), (33, 117, 576), (64, 48, 128), (129, 100, 1600), (161, 33, 64)]


@pytest.mark.parametrize("act,has_bias,has_res", EPILOGUES, ids=EPILOGUE_IDS)
@pytest.mark.parametrize("m,n,k", INT8_SHAPES, ids=lambda v: str(v))
def test_int8_blocked_is_the_stream_kernel(tiles, m, n, k, act, has_bias, has_res):
    x, w, bias, res = _inputs(m, n, k, torch.float32, seed=m * 5 + n + k)
    weight = quant.QuantLinear.from_float(w)
    assert weight.packed is not None
    stream, blocked = both_kernels(
        lambda: quant.linear(x, weight, bias if has_bias else None, act, res if has_res else None))
    assert torch.equal(stream, blocked)
    ref = quant.linear_reference(x, weight, bias if has_bias else None, act, res if has_res else None)
    torch.testing.assert_close(blocked.double(), ref, rtol=1e-5, atol=1e-5)  # fp64 oracle of the int8 math


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "int8"])
def test_a_row_alone_is_the_row_in_a_large_batch(tiles, dtype):
    """auto mode: one row takes the streaming kernel (bf16; int8 is blocked at every M, in items of other sizes),
    2 * THRESHOLD + 37 rows the blocked one; same bits."""
    _C.testing.set_amx_gemm("auto")
    m, n, k = 2 * THRESHOLD + 37, 100, 576
    x, w, bias, res = _inputs(m, n, k, dtype, seed=21)
    if dtype == torch.bfloat16:
        packed = _C.pack_linear(w)
        run = lambda rows, r: _C.linear(rows, packed, n, bias, "gelu", r)  # noqa: E731
    else:
        weight = quant.QuantLinear.from_float(w)
        run = lambda rows, r: quant.linear(rows, weight, bias, "gelu", r)  # noqa: E731
    batch = run(x, res)
    for i in (0, 31, 32, 127, 128, m - 1):
        assert torch.equal(run(x[i:i + 1], res[i:i + 1]), batch[i:i + 1]), f"row {i}"
    # and a batch just under the threshold (bf16: streaming) against the same rows of the large one
    small = THRESHOLD - 1
    assert torch.equal(run(x[:small], res[:small]), batch[:small])


@pytest.mark.parametrize("steps,rows,stage", [(1, 32, False), (3, 64, True), (64, 256, False), (8, 128, True),
                                              (8, 128, False), (64, 256, True)], ids=lambda v: str(v))
def test_any_blocking_gives_the_same_bits(tiles, steps, rows, stage):
    """The blocked kernel's geometry (set_amx_blocking, for measurement) moves no bit: K blocks of 1, 3 and 64 tile
    steps, work items of 32, 64, 128 and 256 rows, A from its rows or staged in tile order, against the default's
    output (161 rows: a short last pair; K = 640: 20 bf16 and 10 int8 steps, K blocks cut short)."""
    m, n, k = 161, 100, 640
    x, w, bias, res = _inputs(m, n, k, torch.bfloat16, seed=5)
    xq, wq, bq, rq = _inputs(m, n, k, torch.float32, seed=6)
    packed, weight = _C.pack_linear(w), quant.QuantLinear.from_float(wq)
    _C.testing.set_amx_gemm("blocked")
    run = lambda: (_C.linear(x, packed, n, bias, "gelu", res), quant.linear(xq, weight, bq, "gelu", rq))  # noqa: E731
    default = run()
    assert _C.testing.set_amx_blocking(steps, rows, stage) is None
    assert _C.testing.amx_blocking() == (steps, rows, stage)
    ours = run()
    assert torch.equal(ours[0], default[0]) and torch.equal(ours[1], default[1])


def test_set_amx_blocking_refuses_a_bad_geometry():
    before = _C.testing.amx_blocking()
    for steps, rows in [(0, 128), (65, 128), (8, 48), (8, 288)]:
        with pytest.raises(ValueError, match="AMX blocking"):
            _C.testing.set_amx_blocking(steps, rows)
    assert _C.testing.amx_blocking() == before


def test_set_amx_gemm_refuses_an_unknown_kernel():
    before = _C.testing.amx_gemm()
    with pytest.raises(ValueError, match="expected auto, stream or blocked"):
        _C.testing.set_amx_gemm("fast")
    assert _C.testing.amx_gemm() == before


def test_the_environment_variable_chooses_at_load():
    env = dict(os.environ, BERTFAST_AMX_GEMM="blocked")
    out = subprocess.run([sys.executable, "-c", "from bertfast import _C; print(_C.testing.amx_gemm())"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "blocked"
