"""Per-op benchmark rows: each backend's op on one layer of a BERT shape, GFLOP/s and GB/s beside time.

Every row is first checked like the op tests check it: ours vs the fp64 reference must be no worse
than twice the same-dtype reference's own error plus a small floor; a wrong op fails its row
instead of producing a number. FLOPs and bytes come from `bertfast.tools.workloads.op_cost` (the
compulsory traffic of a fused kernel), the same model the roofline notes in benchmarks/README.md use.
"""

from __future__ import annotations

import os

import pytest
import torch

from bertfast.backends.torch import TorchBackend
from bertfast.tools import workloads
from bertfast.backends import REGISTRY, available_backends, get_backend
from bertfast.tools.bench.providers import DTYPES
from bertfast.accuracy import tolerance

ORACLE = TorchBackend()  # the reference ops behind the backend contract
SHAPES = ("b8xs128", "b32xs512", "b8xs128-uniform")
ELEM_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _backend_or_skip(name):
    if name == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: the Triton interpreter is a correctness tool, not timed here")
    reason = available_backends("cpu").get(name)
    if reason is not None:
        pytest.skip(f"backend {name!r} unavailable on cpu: {reason}")
    return get_backend(name, "cpu")


def _weights(cache, config_name, dtype, backend=None):
    key = ("weights", config_name, dtype, backend.name if backend else None)
    if key not in cache:
        if backend is None:
            cache[key] = workloads.random_weights(config_name, seed=0, dtype=dtype)
        else:
            cache[key] = backend.prepare(_weights(cache, config_name, dtype))
    return cache[key]


def _flat(out):
    if isinstance(out, (tuple, list)):
        return torch.cat([t.reshape(-1) for t in out])
    return out.reshape(-1)


def _to64(args):
    return tuple(a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", workloads.OPS)
@pytest.mark.parametrize("backend_name", tuple(REGISTRY))
def test_op(benchmark, session_cache, op_config_name, backend_name, op, shape, dtype_name):
    if shape.endswith("-uniform") and op != "attention":
        pytest.skip("ragged lengths change only attention's cost per token; other ops see T tokens")
    dtype = DTYPES[dtype_name]
    backend = _backend_or_skip(backend_name)
    try:
        backend.check_dtype(dtype)
    except ValueError as e:
        pytest.skip(str(e))
    wl = workloads.Workload.parse(shape)
    lengths = workloads.sample_lengths(wl.batch, wl.seqlen, wl.lengths, seed=0)
    config = workloads.model_config(op_config_name)
    fn_name = workloads.OP_FUNCTION[op]

    # Validate: ours vs fp64 reference, bounded by the same-dtype reference's own error.
    raw_args = workloads.layer_inputs(op, _weights(session_cache, op_config_name, dtype), lengths)
    ref64 = _flat(getattr(ORACLE, fn_name)(*_to64(raw_args))).double()
    ref_lowp = _flat(getattr(ORACLE, fn_name)(*raw_args)).double()
    args = workloads.layer_inputs(op, _weights(session_cache, op_config_name, dtype, backend), lengths)
    fn = getattr(backend, fn_name)
    ours = _flat(fn(*args)).double()
    assert ours.shape == ref64.shape, f"{backend_name}.{fn_name}: shape {tuple(ours.shape)} != {tuple(ref64.shape)}"
    err, own = float((ours - ref64).abs().max()), float((ref_lowp - ref64).abs().max())
    bound = tolerance(own, dtype, scale=max(1.0, float(ref64.abs().max())), cap=False)
    assert err <= bound, f"{backend_name}.{fn_name} {shape} {dtype_name}: max err {err:.3g} > {bound:.3g}"

    flops, nbytes = workloads.op_cost(op, config, lengths, ELEM_BYTES[dtype])
    benchmark.group = f"op {op} {op_config_name} {shape} {dtype_name}"
    benchmark.extra_info.update({"op": op, "backend": backend_name, "shape": shape, "dtype": dtype_name,
                                 "tokens": sum(lengths), "flops": flops, "bytes": nbytes,
                                 "max_abs_err": err})
    benchmark(fn, *args)
    median = benchmark.stats.stats.median
    benchmark.extra_info["GFLOP/s"] = round(flops / median / 1e9, 2)
    benchmark.extra_info["GB/s"] = round(nbytes / median / 1e9, 2)
