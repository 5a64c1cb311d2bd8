"""LoRA adapters on the multi-vector models: `ColBERT.encode(adapter=)` and `BGEM3.encode(adapter=)` (the encoder's
adapters, `model.encoder.load_adapter`). Each text's outputs with an adapter equal the same model built on the
checkpoint with that adapter merged in (PEFT's merge_and_unload) within 1e-5, a text without one the base model's bit
for bit, and a text's outputs are the same bits alone and in a batch mixing adapters."""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest
import torch
import transformers

import bertfast
from bertfast.adapters import UnknownAdapter
from helpers.adapters import save_lora
from helpers.bgem3 import save_bgem3
from helpers.colbert import write_colbert

TEXTS = ["a short one", "the quick brown fox jumps over the lazy dog again and again", "x",
         "padding must never change what a sentence means", "seven words in this one right here"]
ROWS = ["a", None, "a", "a", None]
TARGETS = ["query", "key", "value", "dense"]


def _adapted(path, tmp_path):
    """(adapter directory, the checkpoint with it merged): a PEFT LoRA on the checkpoint's transformer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModel.from_pretrained(path).eval()
        pm = save_lora(model, tmp_path / "lora", seed=3, r=4, lora_alpha=8, target_modules=TARGETS)
        merged = shutil.copytree(path, tmp_path / "merged")
        pm.merge_and_unload().save_pretrained(merged)
    return tmp_path / "lora", merged


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_colbert_adapter_per_text(tmp_path, minilm_path):
    path = write_colbert(tmp_path / "m", minilm_path, seed=4)
    lora, merged = _adapted(path, tmp_path)
    ours = bertfast.ColBERT.from_pretrained(path, backend="cpu")
    ours.encoder.load_adapter("a", lora)
    ref = bertfast.ColBERT.from_pretrained(merged, backend="cpu")
    for is_query in (True, False):
        mixed = ours.encode(TEXTS, is_query=is_query, adapter=ROWS, batch_size=3)
        want, base = ref.encode(TEXTS, is_query=is_query), ours.encode(TEXTS, is_query=is_query)
        for i, a in enumerate(ROWS):
            if a is None:
                assert np.array_equal(mixed[i], base[i])
            else:
                assert _rel(mixed[i], want[i]) <= 1e-5 and _rel(mixed[i], base[i]) > 1e-3
                alone = ours.encode(TEXTS[i], is_query=is_query, adapter="a")
                assert np.array_equal(alone, mixed[i])
    with pytest.raises(UnknownAdapter, match="no adapter named 'b'"):
        ours.encode(TEXTS, adapter="b")
    with pytest.raises(ValueError, match="2 entries for 5 rows"):
        ours.encode(TEXTS, adapter=["a", None])


def test_bgem3_adapter_per_text(tmp_path):
    path = save_bgem3(tmp_path / "m", seed=5)
    lora, merged = _adapted(path, tmp_path)
    ours = bertfast.BGEM3.from_pretrained(path, backend="cpu")
    ours.encoder.load_adapter("a", lora)
    ref = bertfast.BGEM3.from_pretrained(merged, backend="cpu")
    kw = dict(return_dense=True, return_sparse=True, return_colbert_vecs=True)
    mixed = ours.encode(TEXTS, adapter=ROWS, batch_size=2, **kw)
    want, base = ref.encode(TEXTS, **kw), ours.encode(TEXTS, **kw)
    top_weight = max(float(v) for w in want["lexical_weights"] for v in w.values())
    for i, a in enumerate(ROWS):
        if a is None:
            assert np.array_equal(mixed["dense_vecs"][i], base["dense_vecs"][i])
            assert np.array_equal(mixed["colbert_vecs"][i], base["colbert_vecs"][i])
            assert mixed["lexical_weights"][i] == base["lexical_weights"][i]
            continue
        assert _rel(mixed["dense_vecs"][i], want["dense_vecs"][i]) <= 1e-5
        assert _rel(mixed["colbert_vecs"][i], want["colbert_vecs"][i]) <= 1e-5
        ours_w, want_w = mixed["lexical_weights"][i], want["lexical_weights"][i]
        keys = sorted(ours_w.keys() | want_w.keys())  # a weight at the relu's edge may be kept by one side only
        got, ref_w = (np.array([w.get(k, 0.0) for k in keys], dtype=np.float64) for w in (ours_w, want_w))
        assert np.abs(got - ref_w).max(initial=0.0) <= 1e-5 * top_weight
        assert _rel(mixed["dense_vecs"][i], base["dense_vecs"][i]) > 1e-3
        alone = ours.encode(TEXTS[i], adapter="a", **kw)
        assert np.array_equal(alone["dense_vecs"], mixed["dense_vecs"][i])
        assert np.array_equal(alone["colbert_vecs"], mixed["colbert_vecs"][i])
    with pytest.raises(UnknownAdapter, match="no adapter named 'b'"):
        ours.encode(TEXTS, adapter="b")
    assert torch.equal(torch.from_numpy(ours.encode(TEXTS, adapter=[None] * 5)["dense_vecs"]),
                       torch.from_numpy(base["dense_vecs"]))
