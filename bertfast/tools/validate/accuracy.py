"""The one accuracy rule: every check (validate, bench, tests, benchmarks) compares an output with an fp64
oracle and allows twice the error of the reference computed in the same dtype, plus a small floor, within a
per-dtype table. `judge` applies it to tensors and returns a `Row` of validate's table."""

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
    """max |out - oracle| and that over max |oracle| (both fp64 on CPU, same shape)."""
    if oracle.numel() == 0:
        return Errors(0.0, 0.0)
    diff = (out.double().cpu() - oracle).abs().max().item()
    scale = oracle.abs().max().item()
    return Errors(diff, diff / scale if scale > 0 else diff)


def tolerance(ref_rel: float, dtype: torch.dtype) -> float:
    """2x the same-dtype reference's error plus the floor, capped by the dtype's table entry.

    The cap is dropped where the reference itself misses the table (an ill-conditioned case in a
    low precision, e.g. a peaked softmax in bf16, or many layers deep): there the only fair demand
    is to be no worse than the reference.
    """
    if not math.isfinite(ref_rel):  # the reference overflowed: it calibrates nothing
        return TABLE[dtype]
    tol = 2.0 * ref_rel + FLOOR[dtype]
    return tol if ref_rel > TABLE[dtype] else min(tol, TABLE[dtype])


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


def reference_bound(ref_err: float, floor: float) -> float:
    """The rule's core without the table: 2x the same-dtype reference's error plus `floor`, both in the
    caller's units. For checks whose oracle is not fp64, e.g. bench's max abs error on last_hidden_state
    against the fp32 Hugging Face model (bertfast.tools.bench.runner.tolerance)."""
    return 2.0 * ref_err + floor
