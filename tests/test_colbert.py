"""ColBERT late interaction: `bertfast.ColBERT` against PyLate's `models.ColBERT.encode` on random checkpoints PyLate
saved, against an oracle of PyLate's rules on checkpoints written here in its format, the engine's key mask against
transformers, batch invariance, MaxSim against `pylate.scores`, and errors.

PyLate runs in one child process per module on the side environment `bash install.sh --test` builds (PyLate pins
sentence-transformers 5.3, the test extra asks >= 6.2: tests/helpers/pylate_side.py); without it those tests fail
with the command to run (BERTFAST_ALLOW_MISSING=1: skipped)."""

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
from helpers import environment
from helpers.colbert import oracle, write_colbert
from helpers.pylate_side import load_ragged, run, save_ragged, side_missing
from helpers.sentences import sentences

# texts of 1 to 420 words (documents past document_length, queries past query_length), an empty one, punctuation only
TEXTS = sentences(40, seed=3) + ["", "  ...!!  ", "word, word; word.", "x" * 3]
# the checkpoints PyLate builds besides its defaults (seed 0): test_pylate_options' cases, each with seed 1
PYLATE_OPTIONS = {
    "attend-expansion": dict(attend_to_expansion_tokens=True),
    "no-expansion": dict(do_query_expansion=False),
    "short-custom-skiplist": dict(query_length=12, document_length=20, skiplist_words=["the", "notaword", ","]),
    "stanford-prefixes": dict(query_prefix="[unused0]", document_prefix="[unused1]"),
    "modernbert": dict(family="modernbert"),
}


def check(ours, theirs, tol=1e-5):
    """The same token count per text, and every vector within tol of theirs (max error over max value)."""
    assert len(ours) == len(theirs)
    assert [o.shape for o in ours] == [t.shape for t in theirs]
    assert all(o.dtype == np.float32 for o in ours)
    assert rel_error(torch.from_numpy(np.concatenate(ours)), torch.from_numpy(np.concatenate(theirs)).double()) <= tol


@pytest.fixture(scope="module")
def pylate_run(tmp_path_factory, minilm_path):
    """PyLate's child, run once: every checkpoint of this module built, saved and encoded by PyLate, its MaxSim on
    the ragged case and on its own vectors, and an in-memory model through from_pylate and optimize."""
    reason = side_missing()
    if reason is not None:
        (pytest.skip if environment.ALLOW_MISSING else pytest.fail)(reason)
    out = tmp_path_factory.mktemp("pylate")
    queries, docs, _ = _maxsim_case()
    save_ragged(out / "maxsim-query.npz", queries)
    save_ragged(out / "maxsim-document.npz", docs)
    models = {"defaults": dict(seed=0, options={})}
    models.update({name: dict(seed=1, options=options) for name, options in PYLATE_OPTIONS.items()})
    job = dict(tokenizer=minilm_path, texts=TEXTS, batch_size=7, models=models, from_pylate="defaults",
               scores=[["maxsim-query", "maxsim-document"], ["defaults-query", "defaults-document"]])
    report = run(job, out)
    assert report["versions"]["sentence_transformers"].startswith("5."), report
    return out, report


def pylate_encoded(out, name, is_query):
    return load_ragged(out / f"{name}-{'query' if is_query else 'document'}.npz")


@pytest.fixture(scope="module")
def written_model(tmp_path_factory, minilm_path):
    return write_colbert(tmp_path_factory.mktemp("colbert") / "written", minilm_path)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("is_query", [True, False], ids=["query", "document"])
def test_matches_pylate(pylate_run, backend, is_query):
    out, _ = pylate_run
    ours = bertfast.ColBERT.from_pretrained(str(out / "defaults"), backend=backend)
    check(ours.encode(TEXTS, is_query=is_query, batch_size=5), pylate_encoded(out, "defaults", is_query))


def test_from_pylate_and_optimize(pylate_run):
    """An in-memory PyLate model (in PyLate's child): `ColBERT.from_pylate` matches it; `bertfast.optimize` refuses
    it (the engine would leave its unattended expansion tokens at 0) and leaves it running unchanged."""
    out, report = pylate_run
    for is_query in (True, False):
        check(pylate_encoded(out, "from_pylate", is_query), pylate_encoded(out, "defaults", is_query))
    result = report["from_pylate"]
    assert result["strict_error"] is not None and "from_pylate" in result["strict_error"], result
    assert result["returned_model"], result
    assert any(w.startswith("UserWarning") and "query expansion" in w for w in result["warnings"]), result
    check(load_ragged(out / "after_optimize.npz"), load_ragged(out / "from_pylate-first4.npz"))


@pytest.mark.parametrize("name", list(PYLATE_OPTIONS))
def test_pylate_options(pylate_run, name):
    out, _ = pylate_run
    ours = bertfast.ColBERT.from_pretrained(str(out / name), backend="cpu")
    for is_query in (True, False):
        check(ours.encode(TEXTS, is_query=is_query), pylate_encoded(out, name, is_query))


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
    """A text alone equals the same text inside a batch of 44 and in batches of 5 on one or three worker threads, bit
    for bit, queries and documents (cpu backend)."""
    ours = bertfast.ColBERT.from_pretrained(written_model, backend="cpu", dtype=dtype)
    for is_query in (True, False):
        batch = ours.encode(TEXTS, is_query=is_query, batch_size=len(TEXTS))
        for i in (0, 5, 41):
            assert np.array_equal(ours.encode([TEXTS[i]], is_query=is_query)[0], batch[i])
        for workers in (1, 3):
            spread = ours.encode(TEXTS, is_query=is_query, batch_size=5, workers=workers)
            assert all(np.array_equal(a, b) for a, b in zip(spread, batch, strict=True))


def test_low_precision(written_model):
    """bf16 within the accuracy rule against transformers' own bf16 error (both against the fp32 oracle); int8
    within 2e-2 (per-token int8 activations)."""
    texts = TEXTS[:20]
    for is_query in (True, False):
        truth = torch.from_numpy(np.concatenate(oracle(written_model, texts, is_query))).double()
        bf16 = bertfast.ColBERT.from_pretrained(written_model, backend="cpu", dtype=torch.bfloat16)
        assert all(linear.bf16 for linear, _, _ in bf16.dense)  # the projections in bf16 too (HeadLinear)
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


def test_colbert_scores_match_pylate_scores(pylate_run):
    """pylate.scores' colbert_scores (documents zero-padded, with their mask) and colbert_scores_pairwise itself:
    on the same ragged case, and on PyLate's own query and document vectors against bertfast's."""
    out, _ = pylate_run
    queries, docs, _ = _maxsim_case()
    ours = bertfast.colbert_scores([q.numpy() for q in queries], docs)
    theirs = torch.from_numpy(np.load(out / "maxsim-query-maxsim-document-scores.npy"))
    assert ours.shape == (3, 4) and torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    pairs = bertfast.colbert_scores_pairwise(queries, docs[:3])
    assert torch.allclose(pairs, torch.from_numpy(np.load(out / "maxsim-query-maxsim-document-pairwise.npy")),
                          rtol=1e-6, atol=1e-6)
    model = bertfast.ColBERT.from_pretrained(str(out / "defaults"), backend="cpu")
    q, d = (model.encode(TEXTS, is_query=is_query) for is_query in (True, False))
    theirs = torch.from_numpy(np.load(out / "defaults-query-defaults-document-scores.npy")).double()
    assert rel_error(bertfast.colbert_scores(q, d), theirs) <= 1e-5
    pairs = torch.from_numpy(np.load(out / "defaults-query-defaults-document-pairwise.npy")).double()
    assert rel_error(bertfast.colbert_scores_pairwise(q, d), pairs) <= 1e-5


def test_errors(written_model, tiny_text_model, tmp_path, minilm_path):
    ours = bertfast.ColBERT.from_pretrained(written_model, backend="cpu")
    with pytest.raises(TypeError, match="item 1 is int"):
        ours.encode(["a", 3])
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        ours.encode(["a"], batch_size=0)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        ours.encode(["a"], workers=0)
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
