"""The `torch-varlen` bench row (`bertfast/tools/bench/varlen_peer.py`): its composition equals transformers on CPU,
with a per-sequence SDPA loop standing in for the CUDA-only varlen flash attention, and `check_runnable` names each
condition it cannot run under. The row itself runs on a GPU only (`bertfast bench --device cuda`)."""

from __future__ import annotations

import functools
import importlib
import sys

import pytest
import torch

from bertfast.config import ModelConfig
from bertfast.tools import workloads
from bertfast.tools.bench import providers, runner
from bertfast.tools.bench.source import Source, load_source, reference_output
from bertfast.tools.bench.varlen_peer import VarlenEncoder, sdpa_loop_for_tests
from conftest import rel_err
from helpers.families import batch_for, build

# Ragged: a 1-token row, a full-length row, lengths that are no multiple of anything.
LENGTHS = [23, 1, 37, 9]


def _encoder(model, dtype=torch.float32):
    return VarlenEncoder(model, ModelConfig.from_dict(model.config.to_dict()), dtype, "cpu",
                         attention=sdpa_loop_for_tests)


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_equals_transformers_on_real_positions(family):
    model = build(family)
    kwargs, mask = batch_for(model, LENGTHS)
    ours = _encoder(model)(**kwargs)
    with torch.inference_mode():
        ref = model(**kwargs).last_hidden_state
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert rel_err(ours, ref, mask) <= 1e-5
    assert not ours[~mask.bool()].any(), "padded positions are not 0"


def test_a_row_alone_equals_itself_in_the_batch():
    model = build("xlm-roberta")
    kwargs, mask = batch_for(model, LENGTHS)
    enc = _encoder(model)
    batch = enc(**kwargs)
    for row, n in enumerate(LENGTHS):
        alone = enc(**{k: v[row:row + 1, :n] for k, v in kwargs.items()})
        assert rel_err(alone[0], batch[row, :n]) <= 1e-5, f"row {row} ({n} tokens)"


def test_weights_are_copies_of_the_reference():
    model = build("bert")
    enc = _encoder(model)
    params = {p.data_ptr() for p in model.parameters()}
    assert enc.word.data_ptr() not in params and enc.emb_ln[0].data_ptr() not in params


def test_the_factory_output_passes_the_bench_validation(monkeypatch):
    """The row as the runner validates it, with the CPU stand-in as its attention."""
    source = load_source(config_name="tiny")
    monkeypatch.setattr(providers, "VarlenEncoder", functools.partial(VarlenEncoder, attention=sdpa_loop_for_tests))
    prov = providers.FACTORIES["torch-varlen"](source, torch.float32)
    batch = workloads.make_batch(4, 24, [24, 1, 13, 7], vocab_size=source.config.vocab_size)
    ref = reference_output(source, batch)
    err, _, reason = runner.check_output(prov.fn(batch), ref, batch.attention_mask,
                                         runner.tolerance(source, batch, ref, torch.float32))
    assert prov.name == "torch-varlen" and reason == "" and err <= 1e-5


def test_unwired_family_is_refused_at_build():
    with pytest.raises(ValueError, match="wired for bert, roberta, xlm-roberta only .this is mpnet"):
        VarlenEncoder(None, workloads.model_config("mpnet-base"), torch.float16, "cpu")


# ----------------------------------------------------------------------------------------------
# check_runnable


def _source(device, config="tiny"):
    return Source(config, workloads.model_config(config), None, None, device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given without CUDA")
def test_skips_without_cuda():
    with pytest.raises(providers.ProviderSkipped, match=r"CUDA is not available here \(torch.cuda.is_available"):
        providers.check_runnable("torch-varlen", _source("cuda"), torch.float16)


def test_needs_a_cuda_device():
    with pytest.raises(providers.ProviderSkipped, match="needs a CUDA device"):
        providers.check_runnable("torch-varlen", _source("cpu"), torch.float16)


@pytest.mark.parametrize("config, dtype, reason", [
    ("tiny", torch.float32, r"fp16 and bf16 only \(varlen flash attention, varlen_attn, has no fp32 kernel\)"),
    ("mpnet-base", torch.float16, r"wired for bert, roberta, xlm-roberta only .*this is mpnet\)"),
    ("modernbert-base", torch.bfloat16, r"wired for .* only .*this is modernbert\)"),
], ids=["fp32", "mpnet", "modernbert"])
def test_names_its_dtype_and_family_limits(monkeypatch, config, dtype, reason):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(providers.ProviderSkipped, match=reason):
        providers.check_runnable("torch-varlen", _source("cuda", config), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_runs_where_torch_has_varlen_attn(monkeypatch, dtype):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    providers.check_runnable("torch-varlen", _source("cuda"), dtype)  # nothing to skip before building


@pytest.mark.parametrize("missing", ["function", "module"])
def test_names_the_missing_varlen_attn(monkeypatch, missing):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if missing == "function":
        monkeypatch.delattr(importlib.import_module("torch.nn.attention.varlen"), "varlen_attn")
    else:  # a torch without the module: importing it raises ImportError
        monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)
    with pytest.raises(providers.ProviderSkipped, match=r"has no torch\.nn\.attention\.varlen\.varlen_attn"):
        providers.check_runnable("torch-varlen", _source("cuda"), torch.float16)
