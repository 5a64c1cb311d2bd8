"""Shared builders for the Triton kernel tests, which run on CPU under the Triton interpreter.

Triton picks interpreted or compiled kernels when a `@triton.jit` function is defined, so
TRITON_INTERPRET=1 is set here, at import, before any test module imports `bertfast.kernels.triton` (pytest
loads this conftest before collecting the modules beside it). Tests elsewhere are unaffected:
nothing here imports triton, and the variable only matters to code that does.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from bertfast.accuracy import TABLE, errors, tolerance  # noqa: E402

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0, offset=0.0, noncontig=False):
    """Random normal tensor rounded to `dtype`; noncontig gives a strided view of the same values."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype)
    if noncontig:
        # Every other column of a twice-as-wide buffer: same values, last-dim stride 2.
        wide = torch.zeros(*shape[:-1], 2 * shape[-1], dtype=dtype)
        wide[..., ::2] = t
        t = wide[..., ::2]
        assert not t.is_contiguous()
    return t


def f64(*tensors):
    out = tuple(None if t is None else t.double() for t in tensors)
    return out if len(out) > 1 else out[0]


def assert_matches_reference(ours, ref_low, ref_hi, dtype, what="", table=True):
    """The house check (bertfast.accuracy): ours vs the fp64 reference is no worse than
    twice the same-dtype reference's own error plus the floor (absolute errors, the floor scaled by
    the output's magnitude), and within the per-dtype table as allclose (atol = rtol = TABLE).
    table=False only for inputs whose conditioning alone exceeds the table (the reference misses it
    too); the first check still holds there."""
    assert ours.shape == ref_hi.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref_hi.shape)}"
    assert ours.dtype == dtype, f"{what}: dtype {ours.dtype} != {dtype}"
    assert torch.isfinite(ours).all(), f"{what}: non-finite output"
    err, ref_err = errors(ours, ref_hi).abs_err, errors(ref_low, ref_hi).abs_err
    scale = max(1.0, ref_hi.abs().max().item()) if ref_hi.numel() else 1.0
    bound = tolerance(ref_err, dtype, scale=scale, cap=False)
    assert err <= bound, f"{what}: max err {err:.3g} > 2 x reference's own {ref_err:.3g} + floor = {bound:.3g}"
    if not table:
        return
    torch.testing.assert_close(ours.double(), ref_hi, atol=TABLE[dtype] * scale, rtol=TABLE[dtype],
                               msg=lambda m: f"{what}: {m}")


class NoLaunch:
    """Stands in for a kernel to prove a launcher raised before launching anything."""

    def __getitem__(self, grid):
        raise AssertionError("the kernel was launched: the bad input was not caught before launch")
