"""`bertfast serve` with DeBERTa-v2/v3 sequence classifiers: /predict and /rerank over real HTTP.

Random-weight checkpoints saved with transformers' own classes and tokenizer (tests/helpers/deberta.py): a
deberta-v3-style classifier (3 labels, shared keys, log buckets, no token types) and a deberta-v2-style reranker
(one label, own position projections, token types: a pair's second text counts). Scores equal transformers' logits
-> softmax / sigmoid within 1e-5 (fp32) on its own tokenization (pairs, truncation from either side); an input's
score is the same bits alone and inside any request; /info and the other kind's routes name the architecture.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="bertfast serve needs the serve extra (fastapi): pip install 'bertfast[serve]'")
pytest.importorskip("uvicorn", reason="bertfast serve needs the serve extra (uvicorn): pip install 'bertfast[serve]'")
pytest.importorskip("prometheus_client", reason="bertfast serve needs the serve extra (prometheus-client)")
httpx = pytest.importorskip("httpx", reason="the serve tests' HTTP client, httpx, is in the test extra")
torch = pytest.importorskip("torch")

from conftest import rel_err  # noqa: E402
from helpers.deberta import build, save_tokenizer  # noqa: E402
from helpers.serve import TEXTS, TOL, Reference, Server, check_predictions, ok, post  # noqa: E402

LIMIT = 64  # max_position_embeddings of helpers.deberta's configs: the served input limit
MAX_INPUTS = 6  # --max-client-batch-size
PAIRS = [("what is the capital of france?", "Paris is the capital of France."),
         ("how do cats sleep", "a much longer sentence about cats, dogs and other animals that live in houses"),
         ("q", "a")]
LONG = "one two three four five six seven eight nine ten " * 12  # over LIMIT tokens
LABELS = ["entailment", "neutral", "contradiction"]


def checkpoint(path, style: str, num_labels: int, seed: int) -> str:
    """DebertaV2ForSequenceClassification of helpers.deberta's `style`, saved with its tokenizer; the pooler and the
    classifier scaled so that scores spread."""
    vocab = save_tokenizer(path, TEXTS + [t for p in PAIRS for t in p] + [LONG])
    labels = LABELS[:num_labels] if num_labels > 1 else ["relevance"]
    model = build(style, seed=seed, task="SequenceClassification", vocab_size=vocab, num_labels=num_labels,
                  id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)})
    with torch.no_grad():
        model.pooler.dense.weight.mul_(20)
        model.classifier.weight.mul_(5)
    model.save_pretrained(path)
    return str(path)


def serve(path, budget: int):
    return Server("--model", path, "--max-client-batch-size", str(MAX_INPUTS), "--max-batch-tokens", str(budget))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = checkpoint(tmp_path_factory.mktemp("deberta-classifier"), "v3", 3, seed=3)
    srv = serve(path, 48)  # a small budget: a request's rows split across batches
    try:
        yield srv, Reference(path, LIMIT)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = checkpoint(tmp_path_factory.mktemp("deberta-reranker"), "v2", 1, seed=4)
    srv = serve(path, 2048)
    try:
        yield srv, Reference(path, LIMIT)
    finally:
        srv.stop()


def test_info_names_the_deberta_model(classifier, reranker):
    info = ok(httpx.get(classifier[0].url + "/info", timeout=10))
    assert info["model_type"] == "classifier" and info["architecture"] == "DebertaV2ForSequenceClassification"
    assert info["labels"] == LABELS and info["routes"] == ["/predict"] and info["max_input_length"] == LIMIT
    info = ok(httpx.get(reranker[0].url + "/info", timeout=10))
    assert info["model_type"] == "reranker" and info["routes"] == ["/rerank", "/predict"]
    r = post(classifier[0], "/rerank", {"query": "a", "texts": ["b"]})
    assert r.status_code == 424 and "a classifier (DebertaV2ForSequenceClassification, 3 labels)" in r.json()["error"]


def test_predict_equals_transformers(classifier):
    """Texts and pairs in one request, one input alone, raw logits, and inputs over the limit truncated from either
    side (a pair: its longer text first): softmax of transformers' logits on its own tokenization."""
    server, ref = classifier
    inputs = [TEXTS[0], PAIRS[0], TEXTS[4], PAIRS[1], TEXTS[2], PAIRS[2]]
    logits = ref.logits(inputs)
    got = ok(post(server, "/predict", {"inputs": [[t] if isinstance(t, str) else list(t) for t in inputs]}))
    assert len(got) == len(inputs)
    for row, expect in zip(got, torch.softmax(logits, -1)):
        check_predictions(row, expect, LABELS)
    check_predictions(ok(post(server, "/predict", {"inputs": list(PAIRS[1])})), torch.softmax(logits[3], -1), LABELS)
    raw = ok(post(server, "/predict", {"inputs": [list(p) for p in PAIRS], "raw_scores": True}))
    ours = torch.tensor([[{p["label"]: p["score"] for p in row}[label] for label in LABELS] for row in raw])
    assert rel_err(ours, ref.logits(PAIRS)) <= TOL
    for side in ("right", "left"):
        long = [LONG, (LONG, "short"), ("short", LONG)]
        got = ok(post(server, "/predict", {"inputs": [[t] if isinstance(t, str) else list(t) for t in long],
                                           "truncate": True, "truncation_direction": side}))
        for row, expect in zip(got, torch.softmax(ref.logits(long, side), -1)):
            check_predictions(row, expect, LABELS)
    r = post(server, "/predict", {"inputs": [["a"], [LONG]]})
    assert r.status_code == 413 and r.json()["field"] == "inputs[1]" and r.json()["limit"] == LIMIT


def test_rerank_equals_transformers(reranker):
    """Each text scored as the pair (query, text), its second text of token type 1: sigmoid of transformers' logit,
    best first; raw_scores the logit; /predict on the reranker its one label."""
    server, ref = reranker
    query, texts = PAIRS[0][0], [p[1] for p in PAIRS] + TEXTS[:3]
    logits = ref.logits([(query, t) for t in texts])[:, 0]
    got = ok(post(server, "/rerank", {"query": query, "texts": texts, "return_text": True}))
    assert [r["score"] for r in got] == sorted((r["score"] for r in got), reverse=True)
    assert sorted(r["index"] for r in got) == list(range(len(texts))) and all(r["text"] == texts[r["index"]]
                                                                              for r in got)
    scores = torch.tensor([r["score"] for r in sorted(got, key=lambda r: r["index"])], dtype=torch.float64)
    assert (scores - torch.sigmoid(logits).double()).abs().max() <= TOL
    raw = ok(post(server, "/rerank", {"query": query, "texts": texts, "raw_scores": True}))
    assert rel_err(torch.tensor([r["score"] for r in sorted(raw, key=lambda r: r["index"])]), logits) <= TOL
    long = ok(post(server, "/rerank", {"query": query, "texts": [LONG], "truncate": True}))
    assert abs(long[0]["score"] - float(torch.sigmoid(ref.logits([(query, LONG)])[0, 0]))) <= TOL
    one = ok(post(server, "/predict", {"inputs": list(PAIRS[1])}))
    assert len(one) == 1 and one[0]["label"] == "relevance"
    assert abs(one[0]["score"] - float(torch.sigmoid(ref.logits([PAIRS[1]])[0, 0]))) <= TOL


def test_scores_are_batch_invariant(classifier, reranker):
    """An input's scores alone equal, bit for bit, its scores inside requests of other inputs (split across batches
    by the classifier's 48-token budget, merged into one by the reranker's 2048): rows of other widths move the
    batch's relative positions and the position projections' columns."""
    server, _ = classifier
    inputs = [[t] for t in TEXTS[:4]] + [list(p) for p in PAIRS[:2]]
    alone = [ok(post(server, "/predict", {"inputs": x})) for x in inputs]
    for order in (range(len(inputs)), reversed(range(len(inputs)))):
        order = list(order)
        assert ok(post(server, "/predict", {"inputs": [inputs[i] for i in order]})) == [alone[i] for i in order]
    rr_server, _ = reranker
    query, texts = PAIRS[1][0], TEXTS[:MAX_INPUTS]
    rr_alone = {t: ok(post(rr_server, "/rerank", {"query": query, "texts": [t]}))[0]["score"] for t in texts}
    got = ok(post(rr_server, "/rerank", {"query": query, "texts": texts}))
    assert {texts[r["index"]]: r["score"] for r in got} == rr_alone
