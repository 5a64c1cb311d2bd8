"""The op sweep of `bertfast validate`: each case of `cases.op_cases` runs in each dtype through the
backend, through the reference in the same dtype, and through the reference in fp64 on CPU (the
oracle), on the same rounded inputs and weights, and `accuracy.judge` makes its table row. The
backend sees only the `Backend` contract: weights go through `prepare` first, as in the engine. Any
exception is a failed row, not a crashed sweep; a dtype the backend refuses is one SKIP row.
"""

from __future__ import annotations

import torch

from bertfast.accuracy import DTYPE_IDS, Row, judge
from bertfast.tools.validate.cases import OpCase, op_cases, random_weights, tiny_config


def error_note(e: BaseException) -> str:
    """An exception as a short table note: its type and the first line of its message."""
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {msg}"[:160]


def check_op_case(backend, case: OpCase, dtype: torch.dtype, device, master=None) -> Row:
    """Run one case in one dtype through `backend`, the reference in `dtype`, and fp64.

    master: the case's fp64 weights when the caller already drew them (they depend on the case only).
    """
    from bertfast.backends.torch import TorchBackend

    reference = TorchBackend()  # the oracle's ops behind the backend contract
    name = DTYPE_IDS[dtype]
    if master is None:
        master = random_weights(case.config, torch.Generator().manual_seed(case.seed))
    w_lowp = master.to(dtype=dtype, device=device)
    w_fp64 = w_lowp.to(dtype=torch.float64, device="cpu")

    def inputs(cast):
        return case.make(torch.Generator().manual_seed(case.seed + 1), cast)

    to_run = lambda t: t.to(dtype=dtype, device=device)  # noqa: E731
    to_oracle = lambda t: t.to(dtype=dtype).to(dtype=torch.float64, device="cpu")  # noqa: E731
    with torch.no_grad():
        oracle = case.call(reference, w_fp64, inputs(to_oracle))
        ref_lowp = case.call(reference, w_lowp, inputs(to_run))
        # Any exception is a failed check, reported in its row, not a crashed sweep.
        try:
            prepared = backend.prepare(w_lowp)
        except Exception as e:
            return Row(case.op, case.label, name, "FAIL", note=f"prepare: {error_note(e)}")
        try:
            ours = case.call(backend, prepared, inputs(to_run))
        except ValueError as e:
            if case.noncontig:
                # A clear rejection of a strided input is allowed; a wrong answer is not.
                return Row(case.op, case.label, name, "SKIP", note=f"rejected: {error_note(e)}")
            return Row(case.op, case.label, name, "FAIL", note=error_note(e))
        except Exception as e:
            return Row(case.op, case.label, name, "FAIL", note=error_note(e))
    return judge(case.op, case.label, dtype, ours, ref_lowp, oracle)


def dtype_skip_reason(backend, dtype, device="cpu") -> str | None:
    """Why `backend` does not run `dtype` on `device` at all, or None.

    Asks `check_dtype`, then `prepare` on an ordinary tiny model (hidden 64, 2 heads of 32): a
    backend may refuse a dtype only on some devices (the Triton interpreter has no bf16), and says
    so in prepare. A refusal there is a statement about the dtype; a refusal of a particular
    case's shapes later is a failure of that case.
    """
    try:
        backend.check_dtype(dtype)
        probe = random_weights(tiny_config(64, 2), torch.Generator().manual_seed(0))
        backend.prepare(probe.to(dtype=dtype, device=device))
    except ValueError as e:
        return str(e)
    return None


def run_op_sweep(backend, dtypes, device="cpu", quick=False, ops=None, progress=None) -> list[Row]:
    """All op cases for every dtype, ordered by dtype then op; a dtype the backend does not support
    gives one SKIP row. progress(row), if given, is called as each check finishes."""
    cases = [c for c in op_cases(quick) if ops is None or c.op in ops]
    runnable = []
    rows = []
    for dtype in dtypes:
        reason = dtype_skip_reason(backend, dtype, device)
        if reason is None:
            runnable.append(dtype)
        else:
            rows.append(Row("*", "*", DTYPE_IDS[dtype], "SKIP", note=reason))
    # Case-major, so that each case's weights are drawn once for all dtypes.
    for case in cases:
        master = random_weights(case.config, torch.Generator().manual_seed(case.seed))
        for dtype in runnable:
            row = check_op_case(backend, case, dtype, device, master)
            rows.append(row)
            if progress is not None:
                progress(row)
    order = {DTYPE_IDS[d]: i for i, d in enumerate(dtypes)}
    return sorted(rows, key=lambda r: order[r.dtype])  # stable: cases keep their order per dtype
