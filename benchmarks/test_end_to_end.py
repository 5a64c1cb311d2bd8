"""End to end benchmark rows: every `bertfast bench` provider on the quick workloads.

The same `setup(provider, source, dtype)` factory and validation as the CLI: the output must match
the fp32 Hugging Face model on real positions within `bench.tolerance` before the row is timed.
Set-up (export, compile, first call) happens before timing and is recorded in extra_info.
"""

from __future__ import annotations

import time

import pytest

from bertfast.tools.bench import bench
from bertfast.tools import workloads


def _providers():
    names, _ = bench.default_providers("cpu")
    return names


@pytest.mark.parametrize("workload", workloads.QUICK_WORKLOADS)
@pytest.mark.parametrize("provider", _providers())
def test_end_to_end(benchmark, session_cache, e2e_source, provider, workload, dtype_name):
    dtype = bench.DTYPES[dtype_name]
    key = ("provider", provider, dtype_name)
    if key not in session_cache:
        try:
            session_cache[key] = bench.setup(provider, e2e_source, dtype)
        except bench.ProviderSkipped as e:
            session_cache[key] = str(e)
    prov = session_cache[key]
    if isinstance(prov, str):
        pytest.skip(f"{provider} {dtype_name}: {prov}")

    wl = workloads.Workload.parse(workload)
    batch = wl.make_batch(e2e_source.config, seed=0)
    ref_key = ("ref", workload)
    if ref_key not in session_cache:
        session_cache[ref_key] = bench.reference_output(e2e_source, batch)
    ref = session_cache[ref_key]
    lowp = session_cache.setdefault(("lowp-models",), {})
    tol = bench.tolerance(e2e_source, batch, ref, dtype, lowp)

    t0 = time.perf_counter()
    prov.fn(batch)  # warm-up: compile / first touch, excluded from the timing
    warmup_s = time.perf_counter() - t0
    err = bench.max_error(prov.fn(batch), ref, batch.attention_mask)
    assert err <= tol, f"{provider} {workload} {dtype_name}: max abs error {err:.3g} > {tol:.3g}; not timed"

    benchmark.group = f"e2e {workload} {dtype_name}"
    benchmark.extra_info.update({"provider": provider, "workload": workload, "dtype": dtype_name,
                                 "real_tokens": batch.real_tokens, "max_abs_err": err,
                                 "build_s": prov.build_s, "warmup_s": warmup_s})
    benchmark.pedantic(prov.fn, args=(batch,), rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info["tokens/s"] = round(batch.real_tokens / benchmark.stats.stats.median, 1)
