"""`bertfast bench --device cuda` on a machine without CUDA: the CUDA rows are listed, each skips with the reason
that names its condition, and the command refuses the device cleanly; the GPU workloads parse."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from bertfast.tools import cli, workloads
from bertfast.tools.bench import providers
from bertfast.tools.bench.source import Source


def _source(device):
    return Source("tiny", workloads.model_config("tiny"), None, None, device)


def test_cuda_rows_are_the_gpu_contenders():
    names, skipped = providers.default_providers("cuda")
    assert names == list(providers.CUDA_PROVIDERS) and skipped == {}
    assert {"bertfast-triton", "bertfast-triton-eager", "bertfast-triton-fp8", "hf-sdpa", "hf-fa2", "torch-compile",
            "torch-compile-max", "torch-varlen", "onnxruntime"} <= set(names)
    assert not set(names) & set(providers.INT8_PROVIDERS)
    for name in names:
        providers.factory_of(name)  # every row has a factory
    assert set(names) <= set(providers.known_providers())
    cpu_names, _ = providers.default_providers("cpu")
    assert "hf-fa2" not in cpu_names and "torch-compile-max" not in cpu_names
    assert "bertfast-triton-fp8" not in cpu_names and "bertfast-triton-fp8" in providers.CUDA_ONLY


@pytest.mark.parametrize("capability, dtype, reason", [
    ((9, 0), torch.float32, "fp8 rows run in the fp16 pass"),
    ((8, 0), torch.float16, r"fp8 GEMMs need sm_89 or later \(this GPU is sm_80\)"),
    ((9, 0), torch.float16, None),
])
def test_the_fp8_row_runs_in_the_fp16_pass_from_sm_89(monkeypatch, capability, dtype, reason):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    if reason is None:
        providers.check_runnable("bertfast-triton-fp8", _source("cuda"), dtype)  # the triton backend is there
    else:
        with pytest.raises(providers.ProviderSkipped, match=reason):
            providers.check_runnable("bertfast-triton-fp8", _source("cuda"), dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reasons given without CUDA")
@pytest.mark.parametrize("name", providers.CUDA_PROVIDERS)
def test_each_cuda_row_skips_without_cuda(name):
    with pytest.raises(providers.ProviderSkipped, match=r"CUDA is not available here \(torch.cuda.is_available"):
        providers.check_runnable(name, _source("cuda"), torch.float16)


@pytest.mark.parametrize("name, dtype, reason", [
    ("hf-fa2", torch.float32, "flash_attention_2 runs fp16 and bf16 only"),
    ("onnxruntime", torch.bfloat16, "fp32 and fp16 only on CUDA"),
    ("bertfast-int8", torch.float32, "an int8 row of the CPU"),
    ("ctranslate2-int8", torch.float32, "an int8 row of the CPU"),
    ("openvino", torch.float32, "a CPU row"),
    ("openvino-int8", torch.float32, "an int8 row of the CPU"),
])
def test_cuda_rows_name_their_dtype_and_device_limits(monkeypatch, name, dtype, reason):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(providers.ProviderSkipped, match=reason):
        providers.check_runnable(name, _source("cuda"), dtype)


def test_optional_gpu_libraries_skip_with_the_install_hint(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(providers.ProviderSkipped, match="flash_attn is not installed"):
            providers.check_runnable("hf-fa2", _source("cuda"), torch.float16)
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(providers.ProviderSkipped, match="no CUDAExecutionProvider.*onnxruntime-gpu"):
            providers.check_runnable("onnxruntime", _source("cuda"), torch.float16)
    # The engine rows need nothing but triton: nothing to skip before building.
    for name in ("bertfast-triton", "bertfast-triton-eager"):
        providers.check_runnable(name, _source("cuda"), torch.float16)


def test_fa2_needs_a_cuda_device():
    with pytest.raises(providers.ProviderSkipped, match="needs a CUDA device"):
        providers.check_runnable("hf-fa2", _source("cpu"), torch.float16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_bench_on_cuda_without_cuda_exits_2(capsys):
    assert cli.main(["bench", "--device", "cuda", "--config", "tiny", "--workloads", "b1xs16"]) == 2
    assert "--device cuda: CUDA is not available here" in capsys.readouterr().err


def test_ragged_from_n_workload():
    wl = workloads.Workload.parse("b32xs512-ragged64")
    assert (wl.batch, wl.seqlen, wl.lengths, wl.name) == (32, 512, "ragged64", "b32xs512-ragged64")
    lengths = workloads.sample_lengths(32, 512, "ragged64", seed=0)
    assert min(lengths) >= 64 and max(lengths) <= 512 and len(set(lengths)) == 32
    # Stratified: the 32 evenly spaced quantiles of U{64..512}, whatever the order.
    assert sorted(lengths) == [64 + int((i + 0.5) * 449 / 32) for i in range(32)]
    assert workloads.sample_lengths(8, 128, "ragged16") == workloads.sample_lengths(8, 128, "ragged")
    with pytest.raises(ValueError, match="ragged<N>"):
        workloads.Workload.parse("b8xs128-raggedx")
