"""The one accuracy rule: every check (validate, bench, tests, benchmarks) compares an output with an fp64
oracle and allows twice the error of the reference computed in the same dtype, plus a small floor, within a
per-dtype table. `tolerance` is that bound and `within` the test of an error against it; `errors` and
`rel_error` measure (max |out - oracle|, and that over max |oracle|); `judge` applies the rule to tensors
and returns a `Row` of validate's table."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Per-dtype limits on the normalised error `rel`.
# TABLE: the hard ceiling (house tolerance table). FLOOR: the slack added to 2x the same-dtype
# reference's error, so an op whose reference happens to be (nearly) exact is not held to zero.
# In fp16/bf16 the floor is one ulp of the largest output; in fp32 it is ~8 ulp, because there
# output rounding no longer dominates and a different (equally valid) summation order shows.
TABLE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
DTYPE_IDS = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass
class Row:
    """One line of the table. Errors are None when the check did not produce a comparable output."""

    op: str
    shape: str
    dtype: str
    status: str  # "PASS" | "FAIL" | "SKIP"
    abs_err: float | None = None
    rel_err: float | None = None
    ref_err: float | None = None
    tol: float | None = None
    note: str = ""


@dataclass
class Errors:
    abs_err: float
    rel_err: float


def errors(out: torch.Tensor, oracle: torch.Tensor) -> Errors:
    """max |out - oracle| and that over max |oracle| (oracle fp64 on CPU, same shape); against an
    all-zero oracle any difference is an infinite relative error."""
    if oracle.numel() == 0:
        return Errors(0.0, 0.0)
    diff = (out.double().cpu() - oracle).abs().max().item()
    scale = oracle.abs().max().item()
    return Errors(diff, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))


def tolerance(ref_err: float, dtype: torch.dtype, *, floor: float | None = None, scale: float = 1.0,
              cap: bool = True) -> float:
    """2x the same-dtype reference's error plus the floor, capped by the dtype's table entry.

    The cap is dropped where the reference itself misses the table (an ill-conditioned case in a
    low precision, e.g. a peaked softmax in bf16, or many layers deep): there the only fair demand
    is to be no worse than the reference. floor: FLOOR[dtype] unless given (a check that holds itself
    to a stricter floor passes it). scale: 1 for relative errors; for absolute errors the output's
    magnitude, which scales the floor and the table alike. cap=False: 2x the reference plus the floor
    alone (for checks that hold the table separately, e.g. with allclose).
    """
    table = TABLE[dtype] * scale
    if cap and not math.isfinite(ref_err):  # the reference overflowed: it calibrates nothing
        return table
    tol = 2.0 * ref_err + (FLOOR[dtype] if floor is None else floor) * scale
    return tol if not cap or ref_err > table else min(tol, table)


def judge(op, shape, dtype, ours, ref_lowp, oracle) -> Row:
    """Compare tensors (or equal-length tuples of tensors) against the fp64 oracle."""
    name = DTYPE_IDS[dtype]
    ours_t, ref_t, orc_t = (tuple(x) if isinstance(x, (tuple, list)) else (x,)
                            for x in (ours, ref_lowp, oracle))
    if len(ours_t) != len(orc_t):
        return Row(op, shape, name, "FAIL", note=f"returned {len(ours_t)} tensors, expected {len(orc_t)}")
    for i, (o, r) in enumerate(zip(ours_t, orc_t)):
        where = f" (output {i})" if len(orc_t) > 1 else ""
        if not torch.is_tensor(o):
            return Row(op, shape, name, "FAIL", note=f"returned {type(o).__name__}{where}, expected a tensor")
        if tuple(o.shape) != tuple(r.shape):
            return Row(op, shape, name, "FAIL",
                       note=f"output shape {tuple(o.shape)}{where}, expected {tuple(r.shape)}")
        if o.dtype != dtype:
            return Row(op, shape, name, "FAIL", note=f"output dtype {o.dtype}{where}, expected {dtype}")
    flat = lambda ts: torch.cat([t.detach().double().cpu().reshape(-1) for t in ts])  # noqa: E731
    oracle_flat = flat(orc_t)
    e = errors(flat(ours_t), oracle_flat)
    ref_rel = errors(flat(ref_t), oracle_flat).rel_err
    tol = tolerance(ref_rel, dtype)
    ok = e.rel_err <= tol  # False for NaN
    note = "non-finite output" if not math.isfinite(e.rel_err) else ""
    if not math.isfinite(ref_rel):
        note = (note + "; " if note else "") + "same-dtype reference non-finite: table only"
    elif ref_rel > TABLE[dtype]:
        note = (note + "; " if note else "") + "reference itself above the table: 2x-reference rule only"
    return Row(op, shape, name, "PASS" if ok else "FAIL", e.abs_err, e.rel_err, ref_rel, tol, note)


def rel_error(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """max |out - ref| / max |ref| in fp64 (the `rel_err` of `errors`), over the real positions only
    when a mask is given ((B, S), 1 = real, for (B, S, ...) outputs)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if mask is not None:
        real = mask.bool().cpu()
        out, ref = out[real], ref[real]
    return errors(out, ref).rel_err


def within(err: float, ref_err: float, dtype: torch.dtype, **kwargs) -> bool:
    """Whether an error vs the fp64 oracle meets the rule: err <= tolerance(ref_err, dtype, **kwargs),
    ref_err being the same-dtype reference's error measured the same way. False for NaN."""
    return err <= tolerance(ref_err, dtype, **kwargs)
