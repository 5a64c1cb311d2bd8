"""LoRA adapters on SPLADE: `SparseEncoder.load_adapter` and `encode(adapter=)`. An adapter that reaches the MLM head's
transform (PEFT's `dense` target, all-linear) runs its own copy of the head on its rows. Each text's vector with an
adapter equals sentence-transformers' SparseEncoder on the checkpoint with that adapter merged in (PEFT's
merge_and_unload) within 1e-5, a text without one the base model's bit for bit, and a vector is the same bits alone
and in a batch mixing adapters (fp32 and bf16)."""

from __future__ import annotations

import os
import shutil
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download; set before the hub libraries load

import pytest
import torch
import transformers

import bertfast
from bertfast.accuracy import rel_error
from bertfast.adapters import UnknownAdapter
from bertfast.backends import available_backends
from bertfast.loading import LoadError
from helpers.adapters import save_lora
from helpers.splade import save_splade

st = pytest.importorskip("sentence_transformers", reason="the reference, sentence-transformers, is in the test extra")

TEXTS = ["a short one", "the quick brown fox jumps over the lazy dog again and again", "x",
         "padding must never change what a sentence means", "seven words in this one right here",
         "search engines rank documents by their terms"]
ROWS = ["head", None, "body", "head", None, "body"]
# "head": the encoder's linears and the MLM head's transform dense (its own head copy); "body": the encoder only
TARGETS = {"head": ["query", "key", "value", "dense"], "body": ["query", "value"]}


@pytest.fixture(scope="module")
def adapted(tmp_path_factory, minilm_path):
    """(base SPLADE directory, {adapter: LoRA directory}, {adapter: merged SPLADE directory})."""
    tmp = tmp_path_factory.mktemp("splade-lora")
    path = save_splade(tmp / "m", minilm_path, seed=2)
    loras, merged = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed, (name, targets) in enumerate(TARGETS.items(), start=3):
            model = transformers.AutoModelForMaskedLM.from_pretrained(path).eval()
            loras[name] = tmp / f"lora-{name}"
            pm = save_lora(model, loras[name], seed=seed, r=4, lora_alpha=8, target_modules=targets)
            merged[name] = shutil.copytree(path, tmp / f"merged-{name}")
            pm.merge_and_unload().save_pretrained(merged[name])
    return path, loras, merged


def _reference(path) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return st.SparseEncoder(str(path), device="cpu").encode(TEXTS, convert_to_sparse_tensor=False).float()


TRITON_REASON = available_backends("cpu").get("triton")


@pytest.mark.parametrize("backend", ["cpu", "torch", pytest.param("triton", marks=pytest.mark.skipif(
    TRITON_REASON is not None, reason=f"backend 'triton' unavailable: {TRITON_REASON}"))])
def test_splade_adapter_per_text(adapted, backend):
    """Parity on every backend (triton under the interpreter); bits alone against mixed on the cpu backend (the
    others pool through torch's GEMMs, whose summation order may follow the row count)."""
    path, loras, merged = adapted
    ours = bertfast.SparseEncoder.from_pretrained(path, backend=backend)
    for name, lora in loras.items():
        ours.load_adapter(name, lora)
    assert ours.adapters == ["head", "body"] and sorted(ours._vocab_heads) == ["head"]
    assert ours._vocab_heads["head"].decoder is ours._vocab.decoder  # the vocabulary shared, not copied
    mixed = ours.encode(TEXTS, adapter=ROWS, batch_size=4, convert_to_sparse_tensor=False)
    base = ours.encode(TEXTS, convert_to_sparse_tensor=False)
    want = {name: _reference(m) for name, m in merged.items()}
    for i, a in enumerate(ROWS):
        if a is None:
            assert torch.equal(mixed[i], base[i]) if backend == "cpu" else rel_error(mixed[i], base[i]) <= 1e-6
            continue
        assert rel_error(mixed[i], want[a][i]) <= 1e-5 and rel_error(mixed[i], base[i]) > 1e-3
        if backend == "cpu":
            assert torch.equal(ours.encode(TEXTS[i], adapter=a, convert_to_sparse_tensor=False), mixed[i])
    with pytest.raises(UnknownAdapter, match="no adapter named 'c'"):
        ours.encode(TEXTS, adapter="c")
    with pytest.raises(ValueError, match="2 entries for 6 rows"):
        ours.encode(TEXTS, adapter=["head", None])
    ours.default_adapter = "head"
    default = ours.encode(TEXTS[0], convert_to_sparse_tensor=False)
    assert rel_error(default, mixed[0]) <= (0 if backend == "cpu" else 1e-6)
    ours.default_adapter = None
    ours.unload_adapter("head")
    assert ours.adapters == ["body"] and not ours._vocab_heads
    with pytest.raises(UnknownAdapter):
        ours.encode(TEXTS, adapter="head")


def test_splade_adapter_bf16_batch_invariant(adapted):
    path, loras, _ = adapted
    ours = bertfast.SparseEncoder.from_pretrained(path, backend="cpu", dtype=torch.bfloat16)
    for name, lora in loras.items():
        ours.load_adapter(name, lora)
    mixed = ours.encode(TEXTS, adapter=ROWS, batch_size=6, convert_to_sparse_tensor=False)
    for i, a in enumerate(ROWS):
        assert torch.equal(ours.encode(TEXTS[i], adapter=a, convert_to_sparse_tensor=False), mixed[i])


def test_splade_adapter_refusals(adapted, tmp_path):
    path, loras, _ = adapted
    ours = bertfast.SparseEncoder.from_pretrained(path, backend="cpu")
    other = save_splade(tmp_path / "other", bertfast.default_model_path(), seed=5, hidden_size=32, intermediate_size=48)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_lora(transformers.AutoModelForMaskedLM.from_pretrained(other).eval(), tmp_path / "wrong", r=4,
                  target_modules=TARGETS["head"])
    with pytest.raises(LoadError):
        ours.load_adapter("w", tmp_path / "wrong")
    assert ours.adapters == [] and not ours._vocab_heads and not ours._adapter_heads
