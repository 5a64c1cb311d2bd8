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

# Per-dtype tables: (atol, rtol) for allclose against the fp64 reference, and the absolute floor
# added to "twice the low-precision reference's own error".
ALLCLOSE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2)}
FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3}
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


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_matches_reference(ours, ref_low, ref_hi, dtype, what="", table=True):
    """The house check: ours vs the fp64 reference is no worse than twice the same-dtype reference's
    own error plus a small floor, and within the per-dtype allclose table. table=False only for
    inputs whose conditioning alone exceeds the table (the reference misses it too); the first
    check still holds there."""
    assert ours.shape == ref_hi.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref_hi.shape)}"
    assert ours.dtype == dtype, f"{what}: dtype {ours.dtype} != {dtype}"
    assert torch.isfinite(ours).all(), f"{what}: non-finite output"
    err, ref_err = max_err(ours, ref_hi), max_err(ref_low, ref_hi)
    scale = max(1.0, ref_hi.abs().max().item()) if ref_hi.numel() else 1.0
    bound = 2 * ref_err + FLOOR[dtype] * scale
    assert err <= bound, f"{what}: max err {err:.3g} > 2 x reference's own {ref_err:.3g} + floor = {bound:.3g}"
    if not table:
        return
    atol, rtol = ALLCLOSE[dtype]
    torch.testing.assert_close(ours.double(), ref_hi, atol=atol * scale, rtol=rtol, msg=lambda m: f"{what}: {m}")


class NoLaunch:
    """Stands in for a kernel to prove a launcher raised before launching anything."""

    def __getitem__(self, grid):
        raise AssertionError("the kernel was launched: the bad input was not caught before launch")
