"""End to end benchmark rows: every `bertfast bench` provider on the quick workloads.

The same `setup(provider, source, dtype)` factory and validation as the CLI: the output must match
the fp32 Hugging Face model on real positions (`runner.check_output`: within `runner.tolerance`, int8 rows by their cosine) before the row is timed.
Set-up (export, compile, first call) happens before timing and is recorded in extra_info.
"""

from __future__ import annotations

import pytest

from bertfast.tools.bench import providers
from bertfast.tools.bench.measure import time_call
from bertfast.tools.bench.runner import check_output, tolerance
from bertfast.tools.bench.source import reference_output
from bertfast.tools import workloads


def _providers():
    names, _ = providers.default_providers("cpu")
    return names


@pytest.mark.parametrize("workload", workloads.QUICK_WORKLOADS)
@pytest.mark.parametrize("provider", _providers())
def test_end_to_end(benchmark, session_cache, e2e_source, provider, workload, dtype_name):
    dtype = providers.DTYPES[dtype_name]
    key = ("provider", provider, dtype_name)
    if key not in session_cache:
        try:
            session_cache[key] = providers.setup(provider, e2e_source, dtype)
        except providers.ProviderSkipped as e:
            session_cache[key] = str(e)
    prov = session_cache[key]
    if isinstance(prov, str):
        pytest.skip(f"{provider} {dtype_name}: {prov}")

    wl = workloads.Workload.parse(workload)
    batch = wl.make_batch(e2e_source.config, seed=0)
    ref_key = ("ref", workload)
    if ref_key not in session_cache:
        session_cache[ref_key] = reference_output(e2e_source, batch)
    ref = session_cache[ref_key]
    lowp = session_cache.setdefault(("lowp-models",), {})
    tol = tolerance(e2e_source, batch, ref, dtype, lowp)

    warmup_s = time_call(prov.fn, batch)[0]  # warm-up: compile / first touch, excluded from the timing
    err, cos, wrong = check_output(prov.fn(batch), ref, batch.attention_mask, tol, bool(prov.info.get("quantized")))
    assert not wrong, f"{provider} {workload} {dtype_name}: {wrong}"

    benchmark.group = f"e2e {workload} {dtype_name}"
    benchmark.extra_info.update({"provider": provider, "workload": workload, "dtype": dtype_name,
                                 "real_tokens": batch.real_tokens, "max_abs_err": err, "min_token_cosine": cos,
                                 "build_s": prov.build_s, "warmup_s": warmup_s})
    benchmark.pedantic(prov.fn, args=(batch,), rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info["tokens/s"] = round(batch.real_tokens / benchmark.stats.stats.median, 1)
