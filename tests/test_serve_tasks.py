"""`bertfast serve` with sequence-classification checkpoints: /predict and /rerank over real HTTP.

Random-weight transformers `BertForSequenceClassification` checkpoints (3 labels with softmax, 4 labels
with problem_type multi_label_classification, 1 label: a cross-encoder) saved with the default model's
tokenizer; the server runs in a subprocess on a loopback port (tests/helpers/serve.py's `Server`). Scores equal
transformers' own logits -> softmax/sigmoid within 1e-5 (fp32), on transformers' own tokenization of
texts and pairs; results are sorted best first; an input's score is the same bits alone and inside any
batch (also with many clients at once); every error is a 4xx JSON naming the field and the limit, and the
routes of another kind of model answer 424 naming what the model is.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="bertfast serve needs the serve extra (fastapi): pip install 'bertfast[serve]'")
pytest.importorskip("uvicorn", reason="bertfast serve needs the serve extra (uvicorn): pip install 'bertfast[serve]'")
pytest.importorskip("prometheus_client", reason="bertfast serve needs the serve extra (prometheus-client)")
httpx = pytest.importorskip("httpx", reason="the serve tests' HTTP client, httpx, is in the test extra")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from conftest import corpus, rel_err  # noqa: E402
from helpers.serve import (LIMIT, TOL, Reference, Server, check_predictions, checkpoint, join, ok, post,  # noqa: E402
                           start_threads)

MAX_INPUTS = 6  # --max-client-batch-size
TEXTS = ["hello world", "A man is eating food.", "x", "The quick brown fox jumps over the lazy dog",
         "Ünïcödé テキスト and emoji 🙂", "Paris is the capital of France."]
PAIRS = [("what is the capital of france?", "Paris is the capital of France."),
         ("how do cats sleep", "a much longer sentence about cats, dogs and other animals that live in houses"),
         ("q", "a")]
LONG = "one two three four five six seven eight nine ten " * 12  # ~120 tokens, over LIMIT


def serve(path, budget: int = 48):
    """A small token budget splits requests across batches; a large one merges many clients' rows."""
    return Server("--model", path, "--max-client-batch-size", str(MAX_INPUTS), "--max-batch-tokens", str(budget))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, minilm_path):
    path = checkpoint(tmp_path_factory.mktemp("classifier"), minilm_path, 3, seed=0)
    srv = serve(path)
    try:
        yield srv, Reference(path, LIMIT)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, minilm_path):
    path = checkpoint(tmp_path_factory.mktemp("reranker"), minilm_path, 1, seed=1)
    srv = serve(path, budget=2048)
    try:
        yield srv, Reference(path, LIMIT)
    finally:
        srv.stop()


def test_info_reports_the_model_kind(classifier, reranker):
    info = ok(httpx.get(classifier[0].url + "/info", timeout=10))
    assert info["model_type"] == "classifier" and info["architecture"] == "BertForSequenceClassification"
    assert info["labels"] == ["label-0", "label-1", "label-2"] and info["routes"] == ["/predict"]
    assert info["dimension"] is None and info["pooling"] is None and info["max_input_length"] == LIMIT
    info = ok(httpx.get(reranker[0].url + "/info", timeout=10))
    assert info["model_type"] == "reranker" and info["labels"] == ["label-0"]
    assert info["routes"] == ["/rerank", "/predict"]


def test_predict_equals_transformers(classifier):
    """A batch of texts and pairs, one text, one pair: softmax of transformers' logits, best first;
    raw_scores: the logits themselves."""
    server, ref = classifier
    labels = ["label-0", "label-1", "label-2"]
    inputs = [TEXTS[0], PAIRS[0], TEXTS[4], PAIRS[1], TEXTS[2], PAIRS[2]]
    logits = ref.logits(inputs)
    got = ok(post(server, "/predict", {"inputs": [[t] if isinstance(t, str) else list(t) for t in inputs]}))
    assert len(got) == len(inputs)
    for row, expect in zip(got, torch.softmax(logits, -1)):
        check_predictions(row, expect, labels)
    # A single input answers a flat list, as TEI: a string, a one-string list, a pair.
    for body, i in ((TEXTS[0], 0), ([TEXTS[4]], 2), (list(PAIRS[1]), 3)):
        check_predictions(ok(post(server, "/predict", {"inputs": body})), torch.softmax(logits[i], -1), labels)
    raw = ok(post(server, "/predict", {"inputs": [list(p) for p in PAIRS], "raw_scores": True}))
    ours = torch.tensor([[{p["label"]: p["score"] for p in row}[label] for label in labels] for row in raw])
    assert rel_err(ours, ref.logits(PAIRS)) <= TOL


def test_predict_truncation(classifier):
    """truncate=true keeps LIMIT tokens (a pair: longest text first), from the end with 'left', as
    transformers' tokenizer truncates; without it the input is refused (see the error table)."""
    server, ref = classifier
    labels = ["label-0", "label-1", "label-2"]
    for side in ("right", "left"):
        inputs = [LONG, (LONG, "short"), ("short", LONG)]
        got = ok(post(server, "/predict", {"inputs": [[t] if isinstance(t, str) else list(t) for t in inputs],
                                           "truncate": True, "truncation_direction": side}))
        for row, expect in zip(got, torch.softmax(ref.logits(inputs, side), -1)):
            check_predictions(row, expect, labels)


def test_multi_label_scores_are_sigmoids(tmp_path, minilm_path):
    path = checkpoint(tmp_path, minilm_path, 4, seed=2, problem_type="multi_label_classification")
    ref = Reference(path, LIMIT)
    srv = serve(path)
    try:
        got = ok(post(srv, "/predict", {"inputs": [[TEXTS[1]], list(PAIRS[0])]}))
    finally:
        srv.stop()
    for row, expect in zip(got, torch.sigmoid(ref.logits([TEXTS[1], PAIRS[0]]))):
        check_predictions(row, expect, [f"label-{i}" for i in range(4)])


def test_rerank_equals_transformers(reranker):
    """Each text scored as the pair (query, text): sigmoid of transformers' logit, sorted best first with
    its index; return_text adds the text; raw_scores gives the logit."""
    server, ref = reranker
    query, texts = PAIRS[0][0], [p[1] for p in PAIRS] + TEXTS[:3]
    logits = ref.logits([(query, t) for t in texts])[:, 0]
    got = ok(post(server, "/rerank", {"query": query, "texts": texts}))
    assert sorted(r["index"] for r in got) == list(range(len(texts))) and all("text" not in r for r in got)
    assert [r["score"] for r in got] == sorted((r["score"] for r in got), reverse=True)
    scores = torch.tensor([r["score"] for r in sorted(got, key=lambda r: r["index"])], dtype=torch.float64)
    assert (scores - torch.sigmoid(logits).double()).abs().max() <= TOL
    with_text = ok(post(server, "/rerank", {"query": query, "texts": texts, "return_text": True}))
    assert [r["index"] for r in with_text] == [r["index"] for r in got]
    assert all(r["text"] == texts[r["index"]] for r in with_text)
    assert [list(r) for r in with_text][0] == ["index", "text", "score"]
    raw = ok(post(server, "/rerank", {"query": query, "texts": texts, "raw_scores": True}))
    raw = torch.tensor([r["score"] for r in sorted(raw, key=lambda r: r["index"])])
    assert rel_err(raw, logits) <= TOL
    long = ok(post(server, "/rerank", {"query": query, "texts": [LONG], "truncate": True}))
    expect = torch.sigmoid(ref.logits([(query, LONG)])[0, 0])
    assert abs(long[0]["score"] - float(expect)) <= TOL


def test_predict_on_a_reranker(reranker):
    """TEI serves /predict on rerankers too: the one label, sigmoid."""
    server, ref = reranker
    got = ok(post(server, "/predict", {"inputs": list(PAIRS[1])}))
    assert len(got) == 1 and got[0]["label"] == "label-0"
    assert abs(got[0]["score"] - float(torch.sigmoid(ref.logits([PAIRS[1]])[0, 0]))) <= TOL


def test_scores_are_batch_invariant(classifier, reranker):
    """An input's score alone equals, bit for bit, its score inside a request and among the requests of
    12 concurrent clients: split across batches by the classifier's 48-token budget, merged into batches
    of up to 72 rows by the reranker's 2048 (48 texts: a score whose rounding depended on its place in
    the batch would show)."""
    server, _ = classifier
    inputs = [[t] for t in TEXTS] + [list(p) for p in PAIRS]
    alone = [ok(post(server, "/predict", {"inputs": x})) for x in inputs]
    rr_server, _ = reranker
    query, texts = PAIRS[1][0], [" ".join(t.split()[:20]) for t in corpus(48)]
    rr_alone = {t: ok(post(rr_server, "/rerank", {"query": query, "texts": [t]}))[0]["score"] for t in texts}
    failures, lock = [], threading.Lock()

    def worker(seed):
        rng = np.random.default_rng(seed)
        with httpx.Client(timeout=60) as c:
            for _ in range(2):
                pick = rng.choice(len(inputs), size=int(rng.integers(1, MAX_INPUTS + 1)), replace=True).tolist()
                r = c.post(server.url + "/predict", json={"inputs": [inputs[i] for i in pick]})
                if r.status_code != 200 or r.json() != [alone[i] for i in pick]:
                    with lock:
                        failures.append(("predict", seed, r.status_code, r.text[:200]))
                chosen = [texts[i] for i in rng.choice(len(texts), size=MAX_INPUTS, replace=False)]
                r = c.post(rr_server.url + "/rerank", json={"query": query, "texts": chosen})
                got = {chosen[x["index"]]: x["score"] for x in r.json()} if r.status_code == 200 else None
                if got != {t: rr_alone[t] for t in chosen}:
                    with lock:
                        failures.append(("rerank", seed, r.status_code, r.text[:200]))

    join(start_threads(worker, range(12)))
    assert not failures, failures[:3]


BAD = [  # (id, server, route, body, status, field, limit)
    ("empty-list", "classifier", "/predict", {"inputs": []}, 422, "inputs", None),
    ("empty-string", "classifier", "/predict", {"inputs": ""}, 422, "inputs", None),
    ("empty-in-pair", "classifier", "/predict", {"inputs": ["a", ""]}, 422, "inputs[1]", None),
    ("empty-in-batch", "classifier", "/predict", {"inputs": [["a"], ["b", ""]]}, 422, "inputs[1][1]", None),
    ("empty-item", "classifier", "/predict", {"inputs": [["a"], []]}, 422, "inputs[1]", None),
    ("three-strings", "classifier", "/predict", {"inputs": ["a", "b", "c"]}, 422, "inputs", None),
    ("three-in-item", "classifier", "/predict", {"inputs": [["a", "b", "c"]]}, 422, "inputs[0]", None),
    ("mixed", "classifier", "/predict", {"inputs": ["a", ["b"]]}, 422, "inputs", None),
    ("wrong-type", "classifier", "/predict", {"inputs": 5}, 422, "inputs", None),
    ("wrong-bool", "classifier", "/predict", {"inputs": "a", "raw_scores": "yes"}, 422, "raw_scores", None),
    ("wrong-direction", "classifier", "/predict", {"inputs": "a", "truncation_direction": "up"}, 422,
     "truncation_direction", None),
    ("too-many", "classifier", "/predict", {"inputs": [["a"]] * (MAX_INPUTS + 1)}, 413, "inputs", MAX_INPUTS),
    ("too-long", "classifier", "/predict", {"inputs": [["a"], [LONG]]}, 413, "inputs[1]", LIMIT),
    ("pair-too-long", "classifier", "/predict", {"inputs": ["short", LONG]}, 413, "inputs[0]", LIMIT),
    ("rerank-on-classifier", "classifier", "/rerank", {"query": "a", "texts": ["b"]}, 424, None, None),
    ("embed-on-classifier", "classifier", "/embed", {"inputs": "a"}, 424, None, None),
    ("openai-on-classifier", "classifier", "/v1/embeddings", {"input": "a"}, 424, None, None),
    ("embed-all-on-classifier", "classifier", "/embed_all", {"inputs": "a"}, 424, None, None),
    ("no-query", "reranker", "/rerank", {"texts": ["a"]}, 422, "query", None),
    ("empty-query", "reranker", "/rerank", {"query": "", "texts": ["a"]}, 422, "query", None),
    ("no-texts", "reranker", "/rerank", {"query": "a", "texts": []}, 422, "texts", None),
    ("empty-text", "reranker", "/rerank", {"query": "a", "texts": ["b", ""]}, 422, "texts[1]", None),
    ("texts-string", "reranker", "/rerank", {"query": "a", "texts": "b"}, 422, "texts", None),
    ("query-list", "reranker", "/rerank", {"query": ["a"], "texts": ["b"]}, 422, "query", None),
    ("wrong-return-text", "reranker", "/rerank", {"query": "a", "texts": ["b"], "return_text": 1}, 422,
     "return_text", None),
    ("rerank-too-many", "reranker", "/rerank", {"query": "a", "texts": ["b"] * (MAX_INPUTS + 1)}, 413, "texts",
     MAX_INPUTS),
    ("rerank-too-long", "reranker", "/rerank", {"query": "a", "texts": ["b", LONG]}, 413, "texts[1]", LIMIT),
    ("embed-on-reranker", "reranker", "/embed", {"inputs": "a"}, 424, None, None),
    ("embed-all-on-reranker", "reranker", "/embed_all", {"inputs": "a"}, 424, None, None),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests(classifier, reranker, case):
    _, which, route, body, status, field, limit = case
    server = classifier[0] if which == "classifier" else reranker[0]
    r = httpx.post(server.url + route, content=json.dumps(body).encode(), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()
    assert isinstance(err["error"], str) and err["error"] and err["error_type"]
    assert err["field"] == field and err["limit"] == limit, err
    if status == 424:  # names what the model is and what it answers, as TEI's "model is not a ... model"
        kind = "a classifier (BertForSequenceClassification, 3 labels)" if which == "classifier" else \
            "a reranker (BertForSequenceClassification with one label"
        assert err["error_type"] == "model_type" and kind in err["error"] and "/predict" in err["error"], err
    if status == 413 and limit == LIMIT:
        assert f"more than {LIMIT} tokens" in err["error"] and "truncate" in err["error"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # unharmed
