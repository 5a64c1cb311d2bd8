"""Checks for the op-level tests of the native CPU kernels: the dtypes they run in, inputs rounded once and
shared by ours and both references, and the one comparison of ours with the references.

The rule (house style): fp32 within ~1e-5 of the fp64 reference; bf16 no worse than twice the bf16 reference's
own error plus a small floor, and within the bf16 allclose table.
"""

from __future__ import annotations

import pytest
import torch

from bertfast.accuracy import TABLE, tolerance

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
]


def rounded(t, dtype):
    """t rounded to `dtype`, held in fp64 (None stays None): inputs both references and ours share."""
    return None if t is None else t.to(dtype).double()


def check(ours, ref_low, ref_hi, dtype, floor=1e-6):
    """ours vs the fp64 reference: allclose per dtype, and (bf16) no worse than 2x the bf16 reference."""
    ours, ref_low, ref_hi = ours.double(), ref_low.double(), ref_hi.double()
    assert ours.shape == ref_hi.shape
    assert torch.isfinite(ours).all()
    scale = max(ref_hi.abs().max().item(), 1.0)
    err = (ours - ref_hi).abs().max().item()
    if dtype == torch.float32:
        assert err <= TABLE[dtype] * scale, f"fp32 max error {err:.3g} (scale {scale:.3g})"
    else:
        ref_err = (ref_low - ref_hi).abs().max().item()
        # floor: 1e-6 unless a test says otherwise, stricter than accuracy.FLOOR's bf16 ulp.
        bound = tolerance(ref_err, dtype, floor=floor, scale=scale, cap=False)
        assert err <= bound, f"bf16 error {err:.3g} vs reference's own {ref_err:.3g}"
        torch.testing.assert_close(ours, ref_hi, atol=TABLE[dtype] * scale, rtol=TABLE[dtype])


def cu_seqlens(lengths):
    """The int32 cu_seqlens of sequences of these lengths."""
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def qkv_views(lengths, heads, d, dtype, gen):
    """q, k, v as views of one packed (T, 3H) projection, like the backend's qkv op returns."""
    T = sum(lengths)
    qkv = rounded(torch.randn(T, 3 * heads * d, generator=gen, dtype=torch.float64), dtype)
    cu = cu_seqlens(lengths)
    split = lambda t: t.view(T, 3, heads, d).unbind(1)  # noqa: E731
    return split(qkv), split(qkv.to(dtype)), cu
