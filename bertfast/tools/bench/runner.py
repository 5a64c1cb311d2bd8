"""The `bertfast bench` run loop: every (workload, dtype, provider) becomes one `Row`.

Per workload and dtype, each provider is set up once per dtype (in a worker process or here,
`process`), called once (set-up), warmed up, validated against the fp32 reference on real positions
before any timing (a wrong row is an error, never a number), then timed in interleaved rounds by
`measure.interleaved`, each timed call after a settle pause and one untimed call. Why each step:
docs/bench-method.md (#validation, #warm-up, #interleaving, #settle-pause, #slow-row-bound).
"""

from __future__ import annotations

import gc
import math
import sys
from dataclasses import dataclass, field
from functools import partial

import torch

from bertfast.tools.bench.measure import interleaved, quantile
from bertfast.tools.bench.process import Local, Worker
from bertfast.tools.bench.providers import DTYPES, ProviderSkipped, baseline_of, check_runnable, setup
from bertfast.tools.bench.source import Source, reference_output
from bertfast import accuracy
from bertfast.tools.workloads import Batch

# Floor of the allowed max abs error vs the fp32 HF model, per dtype (docs/bench-method.md#validation):
# an absolute error against an fp32 reference, so not accuracy.FLOOR (relative, against fp64).
ATOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# Int8 rows: the smallest cosine of a real token's output with the fp32 reference's.
INT8_MIN_COSINE = 0.98
# Idle seconds, then one untimed call, before each timed call (docs/bench-method.md#settle-pause).
SETTLE_S = 0.1
# A call slower than this gets no extra warm-up and no untimed call (docs/bench-method.md#slow-row-bound).
SLOW_CALL_S = 1.0
# Where providers run: each in a worker process of its own, or all in this one (#isolation).
ISOLATIONS = ("process", "none")


# ----------------------------------------------------------------------------------------------
# Validation


def max_error(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    """Max abs difference on real positions (mask (B, S) 1 = real); inf for a non-finite output."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    real = mask.bool().cpu()
    err = accuracy.errors(out.detach().cpu()[real], ref.detach().cpu()[real].double()).abs_err
    return err if math.isfinite(err) else float("inf")


def min_token_cosine(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    """Smallest cosine similarity between out and ref (B, S, H) over real positions (mask 1); -1 for
    a shape mismatch or a non-finite output."""
    if tuple(out.shape) != tuple(ref.shape) or not bool(torch.isfinite(out).all()):
        return -1.0
    real = mask.bool().to(out.device)
    cos = torch.nn.functional.cosine_similarity(out[real].double(), ref.to(out.device)[real].double(), dim=-1)
    return float(cos.min()) if cos.numel() else 1.0


def tolerance(source: Source, batch: Batch, ref: torch.Tensor, dtype: torch.dtype,
              lowp_models: dict | None = None) -> float:
    """Max abs error a provider in `dtype` may show on `batch`: the one accuracy rule's 2x the
    same-dtype reference's error (the HF eager model run in `dtype`; 0 in fp32, where it is the
    reference) plus ATOL[dtype]. The low-precision models are cached in `lowp_models` by dtype."""
    own = 0.0
    if dtype != torch.float32:
        lowp_models = {} if lowp_models is None else lowp_models
        if dtype not in lowp_models:
            lowp_models[dtype] = source.hf_copy("eager", dtype)
        with torch.inference_mode():
            own = max_error(lowp_models[dtype](**batch.inputs()).last_hidden_state, ref, batch.attention_mask)
    return accuracy.tolerance(own, dtype, floor=ATOL[dtype], cap=False)


# ----------------------------------------------------------------------------------------------
# The loop


@dataclass
class Row:
    workload: str
    batch: int
    seqlen: int
    lengths: str
    real_tokens: int
    provider: str
    dtype: str
    status: str  # "ok" | "skipped" | "error"
    reason: str = ""
    ms_median: float | None = None
    ms_p90: float | None = None
    ms_min: float | None = None
    repeats: int = 0
    times_ms: list = field(default_factory=list)
    tokens_per_s: float | None = None
    speedup_vs_hf_sdpa: float | None = None
    max_abs_err: float | None = None
    tolerance: float | None = None
    peak_mem_mb: float | None = None
    build_s: float | None = None
    warmup_s: float | None = None
    info: dict = field(default_factory=dict)


def _log(msg: str, progress) -> None:
    if progress is not None:
        print(msg, file=progress, flush=True)


def check_output(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, tol: float,
                 quantized: bool = False) -> tuple[float, float | None, str]:
    """Bench's verdict on one output: (max abs error on real positions, the smallest real token's cosine
    for an int8 row else None, "" or why the output is wrong). Int8 rows are held to INT8_MIN_COSINE
    instead of `tol` (docs/bench-method.md#validation)."""
    err = max_error(out, ref, mask)
    if quantized:
        cos = min_token_cosine(out, ref, mask)
        if not cos >= INT8_MIN_COSINE:
            return err, cos, (f"wrong output: a real token's cosine with the fp32 reference is "
                              f"{cos:.4f} < {INT8_MIN_COSINE}; not timed")
        return err, cos, ""
    if not err <= tol:
        return err, None, (f"wrong output: max abs error {err:.3g} on real positions exceeds "
                           f"{tol:.3g} (vs the fp32 reference); not timed")
    return err, None, ""


def _validate(prov, row: Row, batch: Batch, ref: torch.Tensor, tol: float, warmup: int) -> float | None:
    """First call, warm-up, then the validation call (peak memory measured on it) checked against `ref`.
    Returns the validation call's seconds, or None with `row.reason` set (the row stays an error)."""
    quantized = bool(prov.info.get("quantized"))
    try:
        prov.load(batch)
        t_first = prov.call()[0]
        for _ in range(warmup if t_first <= SLOW_CALL_S else 0):
            prov.call()
        row.warmup_s = t_first
        t_call, out, row.peak_mem_mb = prov.call(measure_memory=True)
        row.max_abs_err, cos, row.reason = check_output(out, ref, batch.attention_mask, tol, quantized)
    except Exception as e:
        row.reason = f"failed while running: {type(e).__name__}: {e}"
        return None
    if quantized:
        row.info["min_token_cosine"] = cos
        row.tolerance = None
    return None if row.reason else t_call


def _time_rounds(active, batch: Batch, *, repeats: int, min_repeats: int, budget_s: float, settle_s: float,
                 tag: str, progress) -> None:
    """Interleaved rounds over `active` [(provider, row, validation seconds)]; fills each row's times."""
    # Round length from each provider's validation call, so the budget bounds the slowest workloads.
    round_s = sum(t * (2 if settle_s > 0 and t <= SLOW_CALL_S else 1) + settle_s for _, _, t in active)
    reps = max(min_repeats, min(repeats, int(budget_s / max(round_s, 1e-9))))
    _log(f"{tag}: timing {reps} interleaved rounds x {len(active)} providers (~{reps * round_s:.0f} s)", progress)
    rows = {row.provider: row for _, row, _ in active}

    def failed(name, e):
        rows[name].reason = f"failed while timing: {type(e).__name__}: {e}"

    contenders = {row.provider: partial(prov.timed, settle_s, untimed_call=t_call <= SLOW_CALL_S)
                  for prov, row, t_call in active}
    for name, times in interleaved(contenders, reps, on_error=failed).items():
        row = rows[name]
        row.times_ms = [dt * 1e3 for dt in times]
        if row.reason:
            continue
        row.status = "ok"
        row.repeats = len(row.times_ms)
        row.ms_median = quantile(row.times_ms, 0.5)
        row.ms_p90 = quantile(row.times_ms, 0.9)
        row.ms_min = min(row.times_ms)
        row.tokens_per_s = batch.real_tokens / (row.ms_median / 1e3)


def run_bench(source: Source, workloads, dtypes, providers, *, repeats: int = 10, min_repeats: int = 3,
              budget_s: float = 60.0, warmup: int = 1, seed: int = 0, progress=sys.stderr,
              preskipped: dict | None = None, settle_s: float = SETTLE_S,
              isolation: str = "process") -> list[Row]:
    """Run every (workload, dtype, provider); returns one Row each, ordered workload, dtype, provider.

    `repeats` rounds at most, fewer (at least `min_repeats`) when they would overrun `budget_s`;
    `settle_s` idle and one untimed call before each timed call (0: neither); isolation "process"
    builds and runs each provider in a worker process of its own (needs `source.spec`), "none" here.
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    if isolation == "process" and source.spec is None:
        raise ValueError("isolation='process' needs a source made by load_source (source.spec)")
    device = source.device
    preskipped = dict(preskipped or {})
    rows: dict[tuple, Row] = {}
    refs: dict[str, tuple[Batch, torch.Tensor]] = {}
    n_steps = len(workloads) * len(dtypes)
    step = 0
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        built: dict[str, Local | Worker | str] = {}
        lowp_models: dict = {}
        for wl in workloads:
            step += 1
            tag = f"[bench {step}/{n_steps}] {wl.name} {dtype_name}"
            if wl.name not in refs:
                batch = wl.make_batch(source.config, seed).to(device)
                _log(f"{tag}: fp32 reference (hf eager)", progress)
                refs[wl.name] = (batch, reference_output(source, batch))
            batch, ref = refs[wl.name]
            tol = tolerance(source, batch, ref, dtype, lowp_models)

            def new_row(name, status, reason="", **kw):
                row = Row(wl.name, wl.batch, wl.seqlen, wl.lengths, batch.real_tokens, name, dtype_name,
                          status, reason, tolerance=tol, **kw)
                rows[(wl.name, dtype_name, name)] = row
                return row

            active = []  # (provider, row, its validation call's seconds)
            for name in providers:
                if name in preskipped:
                    new_row(name, "skipped", preskipped[name])
                    continue
                build_s = None
                if name not in built:
                    where = " in a worker process" if isolation == "process" else ""
                    _log(f"{tag}: set up {name}{where}", progress)
                    try:
                        if isolation == "process":
                            check_runnable(name, source, dtype)
                            built[name] = Worker(source.spec, name, dtype_name, device)
                        else:
                            built[name] = Local(setup(name, source, dtype), device)
                        build_s = built[name].build_s
                    except ProviderSkipped as e:
                        built[name] = str(e)
                if isinstance(built[name], str):
                    new_row(name, "skipped", built[name])
                    _log(f"{tag}: {name} skipped: {built[name]}", progress)
                    continue
                prov = built[name]
                row = new_row(name, "error", build_s=build_s, info=dict(prov.info))
                _log(f"{tag}: warm up and validate {name}", progress)
                t_call = _validate(prov, row, batch, ref, tol, warmup)
                if t_call is None:
                    _log(f"{tag}: {name} ERROR: {row.reason}", progress)
                    continue
                active.append((prov, row, t_call))
            if active:
                _time_rounds(active, batch, repeats=repeats, min_repeats=min_repeats, budget_s=budget_s,
                             settle_s=settle_s, tag=tag, progress=progress)
        for handle in built.values():
            if not isinstance(handle, str):
                handle.close()
        del built, lowp_models
        gc.collect()
    return _in_order(rows, workloads, dtypes, providers, baseline_of(source))


def _in_order(rows: dict, workloads, dtypes, providers, baseline: str) -> list[Row]:
    """The rows ordered workload, dtype, provider, each timed one with its speedup vs `baseline`."""
    out = []
    for wl in workloads:
        for dtype_name in dtypes:
            base = rows.get((wl.name, dtype_name, baseline))
            for name in providers:
                row = rows.get((wl.name, dtype_name, name))
                if row is None:
                    continue
                if row.status == "ok" and base is not None and base.status == "ok":
                    row.speedup_vs_hf_sdpa = base.ms_median / row.ms_median
                out.append(row)
    return out
