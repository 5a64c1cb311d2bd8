"""Quantized embeddings (`bertfast.quantize_embeddings`, `Encoder.encode(precision=...)`): bit for bit what
sentence-transformers' `quantize_embeddings` gives, for every precision, with ranges from the embeddings, from
calibration embeddings and given; clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sentence_transformers.util import quantization as st_quantization

from bertfast import Encoder, quantization_ranges, quantize_embeddings
from bertfast.precision import PRECISIONS


def _embeddings(n, d, seed, constant_dim=True):
    g = np.random.default_rng(seed)
    emb = (g.standard_normal((n, d)) * g.uniform(0.01, 2.0, d)).astype(np.float32)
    if constant_dim:
        emb[:, 3] = 0.25  # a dimension with no range: its step is 1, as sentence-transformers has it
    return emb


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("d", [384, 13], ids=["D384", "D13-partial-byte"])
def test_equals_sentence_transformers(precision, d):
    emb, calib = _embeddings(50, d, 0), _embeddings(300, d, 1)
    cases = [dict(), dict(calibration_embeddings=calib), dict(ranges=quantization_ranges(calib))]
    for kwargs in cases if precision.endswith("int8") else cases[:1]:
        ours = quantize_embeddings(emb, precision, **kwargs)
        theirs = st_quantization.quantize_embeddings(emb, precision=precision, **kwargs)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, kwargs
        assert np.array_equal(ours, theirs), (precision, sorted(kwargs))
    if precision.endswith("int8"):  # values outside calibration ranges clip to the end codes
        assert {0, 255} <= set(np.unique(quantize_embeddings(emb * 3, "uint8", quantization_ranges(calib))))
    if precision.endswith("binary"):
        assert quantize_embeddings(emb, precision).shape == (50, -(-d // 8))


def test_torch_input_and_a_single_vector_with_ranges():
    emb = _embeddings(20, 32, 2)
    ranges = quantization_ranges(emb)
    one = quantize_embeddings(torch.from_numpy(emb[:1]), "int8", ranges)
    assert np.array_equal(one, quantize_embeddings(emb, "int8", ranges)[:1])
    assert np.array_equal(quantize_embeddings(emb[0], "ubinary"), np.packbits(emb[0] > 0))


def test_errors_name_what_is_wrong():
    emb = _embeddings(4, 16, 3)
    with pytest.raises(ValueError, match="precision must be one of float32, int8, uint8, binary, ubinary"):
        quantize_embeddings(emb, "int4")
    with pytest.raises(ValueError, match="ranges need at least 2 embeddings"):
        quantize_embeddings(emb[:1], "int8")
    with pytest.raises(ValueError, match=r"ranges must be \(2, 16\)"):
        quantize_embeddings(emb, "uint8", np.zeros((2, 8)))
    with pytest.raises(ValueError, match="must be floating point"):
        quantize_embeddings(emb.astype(np.int8), "binary")


@pytest.fixture(scope="module")
def encoder(tiny_text_model):
    return Encoder.from_pretrained(tiny_text_model, backend="cpu")


TEXTS = ["a first text", "the second one, longer than the first", "three", "and a fourth text here"]


@pytest.mark.parametrize("precision", PRECISIONS[1:])
def test_encode_precision_is_the_quantized_fp32_encoding(encoder, precision):
    fp32 = encoder.encode(TEXTS, convert_to_numpy=True)
    ours = encoder.encode(TEXTS, precision=precision, convert_to_numpy=True)
    assert np.array_equal(ours, st_quantization.quantize_embeddings(fp32, precision=precision))
    as_tensor = encoder.encode(TEXTS, precision=precision)
    assert torch.is_tensor(as_tensor) and np.array_equal(as_tensor.numpy(), ours)


def test_encode_in_parts_with_a_corpus_range(encoder):
    ranges = quantization_ranges(encoder.encode(TEXTS, convert_to_numpy=True))
    whole = encoder.encode(TEXTS, precision="int8", ranges=ranges, convert_to_numpy=True)
    parts = [encoder.encode(TEXTS[i:i + 1], precision="int8", ranges=ranges, convert_to_numpy=True)
             for i in range(len(TEXTS))]
    assert np.array_equal(np.concatenate(parts), whole)
    with pytest.raises(ValueError, match="precision must be one of"):
        encoder.encode(TEXTS, precision="fp8")
