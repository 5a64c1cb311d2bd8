"""The int8 path's attention on AVX-512 VNNI without AVX-512 BF16 (csrc/cpu/attention/attention_avx512int16.cpp):
both products on int16 codes. Runs where that kernel does: the avx512_vnni tier on a CPU without AVX-512 BF16, and the
avx512_vnni-nobf16 cap on one with it (so on every AVX-512 VNNI machine); the other tiers' `bf16_products` are
tests/ops/cpu/test_ops.py's.

The lengths cross the kernel's thresholds: 16-key rows of K codes, the score tiles of 16 / 8 / 4 keys, one to four
16-query vectors a block and more than one 64-query block, more than one 64-key tile (the online softmax), odd key
counts (a key paired with zero); head_dim past 32 (12-bit codes, not 13) and odd (a dim paired with zero).
"""

from __future__ import annotations

import math

import pytest
import torch

from bertfast import reference
from bertfast.backends.cpu import isa as isa_module
from helpers.caps import on_cap
from helpers.cpu_ops import cu_seqlens as _cu, qkv_views

try:
    from bertfast import _C
except ImportError:
    _C = None

pytestmark = pytest.mark.skipif(
    _C is None, reason="the native extension bertfast._C is not built (run bash install.sh)"
)


@pytest.fixture
def int16_tier():
    """The one cap the kernel runs under here: avx512_vnni-nobf16 where the CPU has AVX-512 BF16 to hide, else
    avx512_vnni (skipped, with isa.unsupported's reason, on a CPU without AVX-512 VNNI)."""
    cap = "avx512_vnni-nobf16" if isa_module.unsupported("avx512_vnni-nobf16") is None else "avx512_vnni"
    reason = isa_module.unsupported(cap)
    if reason is not None:
        pytest.skip(reason)
    with on_cap(cap):
        assert _C.isa() == "avx512_vnni" and not _C.has_avx512_bf16()
        yield cap


LENGTHS = [
    pytest.param([1, 2, 15, 16, 17], 4, 32, id="L1..17-H4-D32"),
    pytest.param([24, 33, 40, 49, 64], 3, 32, id="L24..64-H3-D32"),
    pytest.param([65, 130, 3], 2, 32, id="L65.130.3-H2-D32"),
    pytest.param([8, 9, 63, 66], 3, 40, id="L8..66-H3-D40"),
    pytest.param([200, 3], 1, 13, id="L200.3-H1-D13"),
    pytest.param([31, 33, 129], 2, 64, id="L31.33.129-H2-D64"),
]


@pytest.mark.parametrize("lengths,heads,d", LENGTHS)
def test_closer_than_bf16_products(int16_tier, lengths, heads, d):
    """Within a quarter of the error of attention on bf16-rounded q, k, v (its codes keep 12-13 bits to bf16's 8),
    and different from the fp32 kernel's output (the int16 products ran)."""
    gen = torch.Generator().manual_seed(sum(lengths) + d)
    (q, k, v), (q32, k32, v32), cu = qkv_views(lengths, heads, d, torch.float32, gen)
    scale = 1.0 / math.sqrt(d)
    ours = _C.attention(q32, k32, v32, cu, max(lengths), scale, bf16_products=True)
    ref = reference.attention_loop(q, k, v, cu, scale)
    low = reference.attention_loop(*(t.to(torch.bfloat16).double() for t in (q32, k32, v32)), cu, scale)
    err, bf16_err = (ours.double() - ref).abs().max().item(), (low - ref).abs().max().item()
    assert err <= bf16_err / 4, f"int16 products' error {err:.3g} vs bf16 inputs' {bf16_err:.3g}"
    assert not torch.equal(ours, _C.attention(q32, k32, v32, cu, max(lengths), scale))


def test_rows_on_their_own_scales(int16_tier):
    """Each query and key row is quantized on its own scale: rows 1e6 and 1e-6 times the others keep the error of
    the rest (relative to each query's output), and the output of a sequence does not change when another sequence
    in the call holds them."""
    gen = torch.Generator().manual_seed(3)
    (q, k, v), _, cu = qkv_views([40, 40], 2, 32, torch.float64, gen)
    q, k = q.clone(), k.clone()
    q[3], q[5], k[7] = q[3] * 1e6, q[5] * 1e-6, k[7] * 1e-6
    ours = _C.attention(q.float(), k.float(), v.float(), cu, 40, 0.2, bf16_products=True).double()
    ref = reference.attention_loop(q, k, v, cu, 0.2)
    err = (ours - ref).abs().view(80, 2, 32).amax(-1) / ref.abs().view(80, 2, 32).amax(-1)
    assert err.max().item() < 2e-3
    alone = _C.attention(q[40:].float(), k[40:].float(), v[40:].float(), _cu([40]), 40, 0.2, bf16_products=True)
    assert torch.equal(ours[40:].float(), alone)


def test_non_finite_inputs(int16_tier):
    """A NaN in a query gives NaN for that query's output, in a key for every output of its (sequence, head), in a
    value for that column; the other outputs stay finite and equal to those of the same call without it."""
    gen = torch.Generator().manual_seed(5)
    _, (q, k, v), cu = qkv_views([20, 30, 10], 2, 32, torch.float32, gen)
    clean = _C.attention(q, k, v, cu, 30, 0.2, bf16_products=True)
    q, k, v = q.clone(), k.clone(), v.clone()
    q[4, 0, 3] = float("nan")  # sequence 0, head 0, query 4
    k[25, 1, 0] = float("nan")  # sequence 1, head 1
    v[52, 0, 7] = float("inf")  # sequence 2, head 0, column 7
    ours = _C.attention(q, k, v, cu, 30, 0.2, bf16_products=True).view(60, 2, 32)
    bad = torch.zeros(60, 2, 32, dtype=torch.bool)
    bad[4, 0] = True
    bad[20:50, 1] = True
    bad[50:60, 0, 7] = True
    assert torch.equal(~torch.isfinite(ours), bad)
    assert torch.equal(ours[~bad], clean.view(60, 2, 32)[~bad])
