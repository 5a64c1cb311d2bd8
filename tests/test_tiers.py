"""Every ISA tier the CPU supports, at model level: the cpu backend against transformers.

Per tier (the `isa` fixture switches the extension in-process): fp32 within 1e-5 relative on a ragged batch with a 1-token row; bf16 no worse than
twice Hugging Face's own bf16 error; a sequence alone equals itself inside the batch, bit for bit, in fp32, bf16
and int8, up to batches of 481 tokens (past every row count where a GEMM once left the extension); int8
sentence embeddings meet the int8 report's targets (bertfast.tools.validate.int8_report); dtype="auto" gives bf16 exactly
where the tier has native bf16 dot products; an explicit bf16 warns once where it is measured slower.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from bertfast import Encoder
from bertfast.tools.validate import int8_report as quant_report
from bertfast.backends import available_backends
from bertfast.accuracy import within

from conftest import hf_bert, ragged_batch, rel_err

CPU_REASON = available_backends("cpu").get("cpu")
pytestmark = pytest.mark.skipif(CPU_REASON is not None, reason=f"backend 'cpu' unavailable: {CPU_REASON}")

LENGTHS = [23, 1, 17, 9]  # 50 tokens
# 481 tokens: past 64, 128, 256 and 384 rows, where GEMMs went to oneDNN or MKL before the extension ran them all
LONG_LENGTHS = [40, 1, 33, 40, 17, 40, 39, 2, 40, 28, 40, 36, 40, 40, 36, 9]
INT8_SENTENCES = 48  # of the report's fixed set: a broken tier kernel fails on any of them


@pytest.fixture(scope="module")
def hf():
    # intermediate 416: the FFN-out GEMM sums K in three blocks of the fp32 kernels (192 steps)
    return hf_bert(seed=3, hidden_size=96, num_attention_heads=3, intermediate_size=416)


@pytest.fixture(scope="module")
def batch():
    return ragged_batch(LENGTHS, seqlen=25, seed=4)


def test_fp32_matches_transformers(isa, hf, batch):
    ids, mask, types = batch
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, token_type_ids=types)
    out = Encoder.from_hf(hf, backend="cpu", dtype=torch.float32)(ids, mask, types)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
    assert rel_err(out.pooler_output, ref.pooler_output) <= 1e-5
    assert bool((out.last_hidden_state[~mask.bool()] == 0).all())


def test_bf16_within_twice_hf_bf16(isa, hf, batch):
    ids, mask, types = batch
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        hf_low = copy.deepcopy(hf).to(torch.bfloat16)(ids, attention_mask=mask, token_type_ids=types)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slower-than-fp32 notice on some tiers (tested below)
        enc = Encoder.from_hf(hf, backend="cpu", dtype=torch.bfloat16)
    out = enc(ids, mask, types).last_hidden_state
    assert out.dtype == torch.bfloat16
    ours, theirs = rel_err(out, ref, mask), rel_err(hf_low.last_hidden_state, ref, mask)
    assert within(ours, theirs, torch.bfloat16, floor=0.0, cap=False), \
        f"bf16 error {ours:.3g} vs Hugging Face bf16 {theirs:.3g}"


@pytest.mark.parametrize("lengths", [[20, 1, 9], LENGTHS, LONG_LENGTHS], ids=["30-tokens", "50-tokens", "481-tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"], ids=["fp32", "bf16", "int8"])
def test_batch_invariance(isa, hf, dtype, lengths):
    ids, mask, types = ragged_batch(lengths, seqlen=max(lengths), seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enc = Encoder.from_hf(hf, backend="cpu", dtype=dtype)
    together = enc(ids, mask, types).last_hidden_state
    rows = range(len(lengths)) if len(lengths) < 8 else (0, 1, 2, 13)
    for b, n in ((b, lengths[b]) for b in rows):
        alone = enc(ids[b:b + 1, :n], token_type_ids=types[b:b + 1, :n]).last_hidden_state[0]
        assert torch.equal(alone, together[b, :n]), f"row {b} ({n} tokens) differs alone"


@pytest.fixture(scope="module")
def sentence_fp32(minilm_path):
    from bertfast.tools.validate.sentences import sentences

    texts = sentences()[:INT8_SENTENCES]
    fp32 = Encoder.from_pretrained(minilm_path, backend="torch", dtype=torch.float32)
    return texts, fp32.encode(texts, normalize=True)


def test_int8_report_targets(isa, minilm_path, sentence_fp32):
    texts, fp32 = sentence_fp32
    int8 = Encoder.from_pretrained(minilm_path, backend="cpu", dtype="int8")
    rep = quant_report.compare_embeddings(fp32, int8.encode(texts, normalize=True), texts)
    assert rep["passed"], rep


def _native_bf16(tier: str) -> bool:
    """The rule, stated independently of bertfast.backends.cpu.isa: amx or amx_emulated, or avx512_vnni on a CPU with
    AVX-512 BF16."""
    from bertfast import _C

    return tier in ("amx", "amx_emulated") or (tier == "avx512_vnni" and _C.has_avx512_bf16())


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_auto_dtype_follows_the_tier(isa, hf, backend):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" never warns
        enc = Encoder.from_hf(hf, backend=backend, dtype="auto")
    assert enc.dtype == (torch.bfloat16 if _native_bf16(isa) else torch.float32)
    ids, mask, types = ragged_batch(LENGTHS, seqlen=25, seed=5)
    assert torch.isfinite(enc(ids, mask, types).last_hidden_state.float()).all()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_explicit_bf16_warns_once_where_slower(isa, hf, backend, monkeypatch):
    """cpu: on the tiers its bf16 forward measured slower (BF16_SLOWER_TIERS); torch: wherever the tier
    lacks native bf16 (ATen's scalar bf16 dot)."""
    from bertfast import backends
    from bertfast.backends.cpu.backend import BF16_SLOWER_TIERS
    from bertfast.backends.cpu.isa import active_cap

    monkeypatch.setattr(backends, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in ("fp32", torch.float32, "auto", None):
            Encoder.from_hf(hf, backend=backend, dtype=dtype)
        assert not caught, [str(w.message) for w in caught]
        for _ in range(2):
            Encoder.from_hf(hf, backend=backend, dtype="bf16")
    messages = [str(w.message) for w in caught]
    tier = active_cap()  # the cap's own name, or avx512_vnni-nobf16 for avx512_vnni on a CPU without AVX-512 BF16
    if (tier in BF16_SLOWER_TIERS) if backend == "cpu" else not _native_bf16(isa):
        assert len(messages) == 1, messages
        assert f"{tier} ISA tier" in messages[0] and "float32" in messages[0] and "'auto'" in messages[0]
    else:
        assert not messages



@pytest.fixture(scope="module")
def family_models():
    return {}  # family -> its parity model, built once for every tier and dtype


FAMILIES = ("bert", "roberta", "distilbert", "albert", "electra", "mpnet", "modernbert", "nomic_bert", "gte",
            "deberta-v2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"], ids=["fp32", "bf16", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_batch_invariant_past_every_old_threshold(isa, family, dtype, family_models):
    """Each family's rows alone equal, bit for bit, their slices of a ~600-token ragged batch (a 1-token row,
    rows at the position limit) on every tier: relative bias, rotary, windows, gated FFNs and factorised
    embeddings included."""
    from bertfast.tools.gpucheck import parity

    if family not in family_models:
        try:
            family_models[family] = parity.build_model(family)
        except parity.FamilySkipped as e:
            pytest.skip(str(e))
    model = family_models[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enc = Encoder.from_hf(model, backend="cpu", dtype=dtype)
    limit = enc.config.max_sequence_length
    lengths = [limit, 1, 57, limit - 3, 9, limit, 100, limit - 1]
    inputs, mask = parity.make_inputs(model, lengths, seed=3)
    assert int(mask.sum()) > 512
    together = enc(**inputs).last_hidden_state
    for b in (1, 2, 3):
        n = lengths[b]
        alone = enc(**{k: v[b:b + 1, :n] for k, v in inputs.items()}).last_hidden_state[0]
        assert torch.equal(alone, together[b, :n]), f"{family}: row {b} ({n} tokens) changes with its batch"
