"""ColBERT late interaction: `bertfast.ColBERT` against PyLate's `models.ColBERT.encode` on random checkpoints PyLate
saved (skipped where PyLate cannot build one), against an oracle of PyLate's rules on checkpoints written here in its
format, the engine's key mask against transformers, batch invariance, MaxSim against `pylate.scores`, and errors."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download; set before the hub libraries load

import numpy as np
import pytest
import torch
import transformers

import bertfast
from bertfast import ConfigError
from bertfast.accuracy import rel_error, within
from conftest import hf_bert
from helpers.colbert import oracle, pylate_missing, pylate_unavailable, save_with_pylate, write_colbert
from helpers.sentences import sentences

# texts of 1 to 420 words (documents past document_length, queries past query_length), an empty one, punctuation only
TEXTS = sentences(40, seed=3) + ["", "  ...!!  ", "word, word; word.", "x" * 3]
PYLATE_REASON = pylate_unavailable()
needs_pylate = pytest.mark.skipif(PYLATE_REASON is not None, reason=str(PYLATE_REASON))


def check(ours, theirs, tol=1e-5):
    """The same token count per text, and every vector within tol of theirs (max error over max value)."""
    assert len(ours) == len(theirs)
    assert [o.shape for o in ours] == [t.shape for t in theirs]
    assert all(o.dtype == np.float32 for o in ours)
    assert rel_error(torch.from_numpy(np.concatenate(ours)), torch.from_numpy(np.concatenate(theirs)).double()) <= tol


@pytest.fixture(scope="module")
def pylate_model(tmp_path_factory, minilm_path):
    if PYLATE_REASON is not None:
        pytest.skip(PYLATE_REASON)
    return save_with_pylate(tmp_path_factory.mktemp("colbert") / "model", minilm_path)


@pytest.fixture(scope="module")
def written_model(tmp_path_factory, minilm_path):
    return write_colbert(tmp_path_factory.mktemp("colbert") / "written", minilm_path)


def pylate_model_of(path):
    import warnings

    from pylate import models

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return models.ColBERT(path, device="cpu")


def pylate_encode(path, texts, is_query, batch_size=7):
    return pylate_model_of(path).encode(texts, is_query=is_query, batch_size=batch_size)


@needs_pylate
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("is_query", [True, False], ids=["query", "document"])
def test_matches_pylate(pylate_model, backend, is_query):
    ours = bertfast.ColBERT.from_pretrained(pylate_model, backend=backend)
    check(ours.encode(TEXTS, is_query=is_query, batch_size=5), pylate_encode(pylate_model, TEXTS, is_query))


@needs_pylate
def test_from_pylate_and_optimize(pylate_model):
    """An in-memory PyLate model: `ColBERT.from_pylate` matches it; `bertfast.optimize` refuses it (the engine would
    leave its unattended expansion tokens at 0) and leaves it running unchanged."""
    model = pylate_model_of(pylate_model)
    ours = bertfast.ColBERT.from_pylate(model, backend="cpu")
    for is_query in (True, False):
        check(ours.encode(TEXTS, is_query=is_query), model.encode(TEXTS, is_query=is_query))
    with pytest.raises(bertfast.EngineUnsupported, match="from_pylate"):
        bertfast.optimize(model, strict=True)
    with pytest.warns(UserWarning, match="query expansion"):
        assert bertfast.optimize(model) is model
    check(model.encode(TEXTS[:4]), ours.encode(TEXTS[:4]))


@needs_pylate
@pytest.mark.parametrize("options", [
    pytest.param(dict(attend_to_expansion_tokens=True), id="attend-expansion"),
    pytest.param(dict(do_query_expansion=False), id="no-expansion"),
    pytest.param(dict(query_length=12, document_length=20, skiplist_words=["the", "notaword", ","]),
                 id="short-custom-skiplist"),
    pytest.param(dict(query_prefix="[unused0]", document_prefix="[unused1]"), id="stanford-prefixes"),
    pytest.param(dict(family="modernbert"), id="modernbert"),
])
def test_pylate_options(tmp_path, minilm_path, options):
    path = save_with_pylate(tmp_path / "m", minilm_path, seed=1, **options)
    ours = bertfast.ColBERT.from_pretrained(path, backend="cpu")
    for is_query in (True, False):
        check(ours.encode(TEXTS, is_query=is_query), pylate_encode(path, TEXTS, is_query))


@pytest.mark.parametrize("options", [
    pytest.param({}, id="defaults"),
    pytest.param(dict(attend_to_expansion_tokens=True, dense_bias=True), id="attend-expansion-dense-bias"),
    pytest.param(dict(do_query_expansion=False, document_prefix=""), id="no-expansion-no-document-prefix"),
    pytest.param(dict(query_length=9, document_length=15, skiplist_words=["the", "notaword"]),
                 id="short-custom-skiplist"),
    pytest.param(dict(family="modernbert"), id="modernbert"),
])
def test_format_rules(tmp_path, minilm_path, options):
    """Without PyLate: a checkpoint written here in its format against the rules applied one text at a time."""
    path = write_colbert(tmp_path / "m", minilm_path, seed=2, **options)
    ours = bertfast.ColBERT.from_pretrained(path, backend="cpu")
    for is_query in (True, False):
        check(ours.encode(TEXTS, is_query=is_query, batch_size=6), oracle(path, TEXTS, is_query))


@pytest.mark.parametrize("family", ["bert", "modernbert"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_key_mask_matches_transformers(family, backend):
    """The engine's key mask: every token computed, the masked ones attended to by none (transformers: an attention
    mask of 0 there, its outputs read at every position); rows of 1, 129 and 200 tokens, 1 to 129 keys."""
    from modern_models import build

    model = hf_bert(max_position_embeddings=256) if family == "bert" else build("modernbert", local_attention=512,
                                                                                max_position_embeddings=256)
    g = torch.Generator().manual_seed(0)
    keys = torch.tensor([1, 129, 7, 200])
    S = 200
    ids = torch.randint(3, 97, (len(keys), S), generator=g)
    key_mask = (torch.arange(S)[None, :] < keys[:, None]).long()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=key_mask).last_hidden_state.double()
    enc = bertfast.Encoder.from_hf(model, backend=backend, add_pooling_layer=False)
    ours = enc._run(ids, torch.ones_like(key_mask), None, None, False, pool=False, key_mask=key_mask)[0]
    assert rel_error(ours, ref) <= 1e-5
    with pytest.raises(ValueError, match="subset"):
        enc._run(ids, key_mask, None, None, False, pool=False, key_mask=torch.ones_like(key_mask))
    with pytest.raises(ValueError, match="without a token"):
        enc._run(ids, torch.ones_like(key_mask), None, None, False, pool=False, key_mask=0 * key_mask)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, "int8"], ids=["fp32", "bf16", "int8"])
def test_batch_invariant(written_model, isa, dtype):
    """A text alone equals the same text inside a batch of 44, bit for bit, queries and documents (cpu backend)."""
    ours = bertfast.ColBERT.from_pretrained(written_model, backend="cpu", dtype=dtype)
    for is_query in (True, False):
        batch = ours.encode(TEXTS, is_query=is_query, batch_size=len(TEXTS))
        for i in (0, 5, 41):
            assert np.array_equal(ours.encode([TEXTS[i]], is_query=is_query)[0], batch[i])


def test_low_precision(written_model):
    """bf16 within the accuracy rule against transformers' own bf16 error (both against the fp32 oracle); int8
    within 2e-2 (per-token int8 activations)."""
    texts = TEXTS[:20]
    for is_query in (True, False):
        truth = torch.from_numpy(np.concatenate(oracle(written_model, texts, is_query))).double()
        bf16 = bertfast.ColBERT.from_pretrained(written_model, backend="cpu", dtype=torch.bfloat16)
        ours = torch.from_numpy(np.concatenate(bf16.encode(texts, is_query=is_query)))
        torch_bf16 = bertfast.ColBERT.from_pretrained(written_model, backend="torch", dtype=torch.bfloat16)
        ref = torch.from_numpy(np.concatenate(torch_bf16.encode(texts, is_query=is_query)))
        assert within(rel_error(ours, truth), rel_error(ref, truth), torch.bfloat16)
        int8 = bertfast.ColBERT.from_pretrained(written_model, backend="cpu", dtype="int8")
        assert rel_error(torch.from_numpy(np.concatenate(int8.encode(texts, is_query=is_query))), truth) <= 2e-2


def test_output_forms(written_model):
    ours = bertfast.ColBERT.from_pretrained(written_model, backend="cpu")
    arrays = ours.encode(TEXTS[:3], is_query=False)
    tensors = ours.encode(TEXTS[:3], is_query=False, convert_to_tensor=True)
    assert all(isinstance(t, torch.Tensor) and np.array_equal(t.numpy(), a) for t, a in zip(tensors, arrays))
    single = ours.encode(TEXTS[1])
    assert isinstance(single, np.ndarray) and single.shape == (32, 32)
    np.testing.assert_allclose(np.linalg.norm(single, axis=1), 1, rtol=1e-6)
    raw = ours.encode(TEXTS[1], normalize_embeddings=False)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), single, rtol=1e-5, atol=1e-6)
    assert ours.encode([]) == []
    with_prompt = ours.encode(TEXTS[:2], prompt="search: ")
    assert np.array_equal(with_prompt[1], ours.encode(["search: " + TEXTS[1]])[0])


def _maxsim_case():
    """Unit queries of 32 vectors and ragged documents (3, 40, 17 and 1 vectors), the documents zero-padded."""
    g = torch.Generator().manual_seed(0)
    queries = [torch.nn.functional.normalize(torch.randn(n, 16, generator=g), dim=1) for n in (32, 32, 32)]
    docs = [torch.nn.functional.normalize(torch.randn(n, 16, generator=g), dim=1) for n in (3, 40, 17, 1)]
    return queries, docs, torch.nn.utils.rnn.pad_sequence(docs, batch_first=True)


def test_colbert_scores_match_pylate_rule():
    """MaxSim as pylate.scores.colbert_scores (its docstring's example: masked tokens score 0), ragged lists as the
    same tensors zero-padded, pairwise as the diagonal."""
    q = torch.tensor([[[1.], [0.], [0.], [0.]], [[0.], [2.], [0.], [0.]], [[0.], [0.], [3.], [0.]]])
    d = torch.tensor([[[10.], [0.], [1.]], [[0.], [100.], [10.]], [[1.], [0.], [1000.]]])
    dm = torch.tensor([[1., 1., 1.], [1., 0., 1.], [1., 1., 1.]])
    qm = torch.tensor([[1., 1., 1., 1.], [1., 1., 1., 1.], [1., 1., 0., 1.]])
    expected = torch.tensor([[10., 10., 1000.], [20., 20., 2000.], [0., 0., 0.]])
    assert torch.equal(bertfast.colbert_scores(q, d, qm, dm), expected)
    queries, docs, padded = _maxsim_case()
    full = torch.einsum("ash,bth->abst", torch.stack(queries), padded).amax(-1).sum(-1)
    ours = bertfast.colbert_scores([q.numpy() for q in queries], docs)
    assert ours.shape == (3, 4) and torch.allclose(ours, full, rtol=1e-6, atol=1e-6)
    pairs = bertfast.colbert_scores_pairwise(queries, docs[:3])
    assert torch.allclose(pairs, torch.stack([(q @ d.T).amax(-1).sum() for q, d in zip(queries, docs)]), rtol=1e-6)


@pytest.mark.skipif(pylate_missing() is not None, reason=str(pylate_missing()))
def test_colbert_scores_match_pylate_scores():
    """The same ragged case against pylate.scores.colbert_scores itself, wherever pylate is installed."""
    from pylate import scores

    queries, docs, padded = _maxsim_case()
    ours = bertfast.colbert_scores([q.numpy() for q in queries], docs)
    assert torch.allclose(ours, scores.colbert_scores(torch.stack(queries), padded), rtol=1e-6, atol=1e-6)


def test_errors(written_model, tiny_text_model, tmp_path, minilm_path):
    ours = bertfast.ColBERT.from_pretrained(written_model, backend="cpu")
    with pytest.raises(TypeError, match="item 1 is int"):
        ours.encode(["a", 3])
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        ours.encode(["a"], batch_size=0)
    with pytest.raises(TypeError, match="is_query must be True or False"):
        ours.encode(["a"], is_query="yes")
    with pytest.raises(ValueError, match="prompt name 'nope'"):
        ours.encode(["a"], prompt_name="nope")
    with pytest.raises(ConfigError, match="modules.json"):
        bertfast.ColBERT.from_pretrained(tiny_text_model)  # a plain model: PyLate would add a random projection
    with pytest.raises(ConfigError, match="no token '\\[X\\] '"):
        bertfast.ColBERT.from_pretrained(_edit(write_colbert(tmp_path / "a", minilm_path), query_prefix="[X] "))
    with pytest.raises(ConfigError, match="query_length 300 exceeds the model's 256 positions"):
        bertfast.ColBERT.from_pretrained(write_colbert(tmp_path / "b", minilm_path, query_length=300))
    with pytest.raises(ConfigError, match="document_length must be an integer >= 3"):
        bertfast.ColBERT.from_pretrained(write_colbert(tmp_path / "c", minilm_path, document_length=2))
    with pytest.raises(ValueError, match="queries have dim 4, documents 5"):
        bertfast.colbert_scores(torch.zeros(1, 2, 4), torch.zeros(1, 2, 5))
    with pytest.raises(ValueError, match="the mask is"):
        bertfast.colbert_scores(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), documents_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="2 queries but 1 documents"):
        bertfast.colbert_scores_pairwise([torch.zeros(1, 4)] * 2, [torch.zeros(1, 4)])


def _edit(path, **settings):
    """The checkpoint at `path` with these ColBERT settings changed in its config_sentence_transformers.json."""
    import json

    file = os.path.join(path, "config_sentence_transformers.json")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    with open(file, "w", encoding="utf-8") as f:
        json.dump({**config, **settings}, f)
    return path
