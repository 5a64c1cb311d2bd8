"""`bertfast serve` beyond one dense vector: a PyLate ColBERT and a BGE-M3 model (random checkpoints written as
tests/helpers/colbert.py and tests/helpers/bgem3.py write them) served next to a dense model, over real HTTP on
127.0.0.1. /embed_multi equals `ColBERT.encode` and `BGEM3.encode(return_colbert_vecs=True)` bit for bit (cpu backend,
fp32), BGE-M3's /embed its dense vectors and /embed_sparse its lexical weights in TEI's shape, also under concurrent
load in shared batches; each route a model cannot serve is a 424, bad input a 422, too much a 413. The batch budget
counts a ColBERT query at its expanded length. Every loop is bounded in count and time; the server is killed in
`finally`.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download; set before the hub libraries load

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="bertfast serve needs the serve extra (fastapi): pip install 'bertfast[serve]'")
pytest.importorskip("uvicorn", reason="bertfast serve needs the serve extra (uvicorn): pip install 'bertfast[serve]'")
pytest.importorskip("prometheus_client", reason="bertfast serve needs the serve extra (prometheus-client)")
httpx = pytest.importorskip("httpx", reason="the serve tests' HTTP client, httpx, is in the test extra")
pytest.importorskip("transformers")

import bertfast  # noqa: E402
from helpers.bgem3 import save_bgem3  # noqa: E402
from helpers.colbert import write_colbert  # noqa: E402
from helpers.serve import TEXTS, Server, as_f32, join, ok, post, start_threads  # noqa: E402

MAX_INPUTS = 8  # --max-client-batch-size
BUDGET = 64  # --max-batch-tokens: two expanded ColBERT queries (32 each) per batch, a long document alone
M3_LIMIT = 128  # the BGE-M3 checkpoint's 130 positions less XLM-R's offset
LONG = "one two three four five six seven eight nine ten " * 12  # ~120 tokens: over query_length (32)
LONGER = LONG * 2  # ~240 tokens: over document_length (180) and BGE-M3's 128
CLIENTS, SECONDS = 12, 90  # the concurrency test's request count and time bound


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, minilm_path, tiny_text_model):
    return {"colbert": write_colbert(tmp_path_factory.mktemp("colbert") / "model", minilm_path, dense_bias=True),
            "m3": save_bgem3(tmp_path_factory.mktemp("bgem3") / "model"), "dense": tiny_text_model}


@pytest.fixture(scope="module")
def server(dirs):
    srv = Server(*(a for name, path in dirs.items() for a in ("--model", f"{name}={path}")),
                 "--max-client-batch-size", str(MAX_INPUTS), "--max-batch-tokens", str(BUDGET))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def colbert(dirs):
    return bertfast.ColBERT.from_pretrained(dirs["colbert"], backend="cpu")


@pytest.fixture(scope="module")
def m3(dirs):
    return bertfast.BGEM3.from_pretrained(dirs["m3"], backend="cpu")


def same_vectors(got, expect) -> None:
    """Per input the same (tokens, dim) shape and the same float32 values, bit for bit."""
    assert len(got) == len(expect)
    for g, e in zip(got, expect):
        g = as_f32(g)
        assert g.shape == e.shape and np.array_equal(g, e)


def sparse_entries(weights: dict) -> list[dict]:
    """BGE-M3's lexical weights in TEI's /embed_sparse shape: ascending index."""
    return [{"index": int(k), "value": float(weights[k])} for k in sorted(weights, key=int)]


def test_kinds_are_detected(dirs):
    from bertfast.tools.serve.model import BGEM3, COLBERT, EMBEDDING, kind_of

    assert [kind_of(dirs[name])[0] for name in ("colbert", "m3", "dense")] == [COLBERT, BGEM3, EMBEDDING]


@pytest.mark.parametrize("is_query", [True, False], ids=["query", "document"])
def test_colbert_embed_multi_equals_encode(server, colbert, is_query):
    texts = TEXTS[:MAX_INPUTS - 1] + [LONGER]
    got = ok(post(server, "/embed_multi", {"model": "colbert", "inputs": texts, "is_query": is_query,
                                           "truncate": True}))
    expect = colbert.encode(texts, is_query=is_query)
    if is_query:  # expanded to query_length, every position kept
        assert all(len(v) == 32 for v in got)
    same_vectors(got, expect)
    one = ok(post(server, "/embed_multi", {"model": "colbert", "inputs": texts[3], "is_query": is_query}))
    same_vectors(one, expect[3:4])


def test_bgem3_routes_equal_encode(server, dirs, m3):
    texts = TEXTS[:MAX_INPUTS]
    expect = m3.encode(texts, max_length=M3_LIMIT, return_colbert_vecs=True)
    same_vectors(ok(post(server, "/embed_multi", {"model": "m3", "inputs": texts})), expect["colbert_vecs"])
    same_vectors(ok(post(server, "/embed_multi", {"model": "m3", "inputs": texts, "is_query": True})),
                 expect["colbert_vecs"])  # queries and documents alike
    dense = as_f32(ok(post(server, "/embed", {"model": "m3", "inputs": texts})))
    assert np.array_equal(dense, expect["dense_vecs"])
    raw = bertfast.BGEM3.from_pretrained(dirs["m3"], backend="cpu", normalize_embeddings=False)
    unnormalized = as_f32(ok(post(server, "/embed", {"model": "m3", "inputs": texts, "normalize": False})))
    assert np.array_equal(unnormalized, raw.encode(texts, max_length=M3_LIMIT, return_sparse=False)["dense_vecs"])
    sparse = ok(post(server, "/embed_sparse", {"model": "m3", "inputs": texts}))
    assert sparse == [sparse_entries(w) for w in expect["lexical_weights"]]
    assert all(sparse[:2])  # the comparison is not between empty lists


def test_embed_multi_batch_invariant_under_load(server):
    """Concurrent one-text requests to both models, merged into shared batches (budget 64 tokens), equal each text
    sent alone."""
    cases = [(model, text, q) for text in TEXTS[:4] for model, q in (("colbert", True), ("colbert", False),
                                                                      ("m3", None))]
    body = {i: {"model": m, "inputs": t, "is_query": q} for i, (m, t, q) in enumerate(cases)}
    alone = {i: ok(post(server, "/embed_multi", b)) for i, b in body.items()}
    results = {}

    def client(i):
        results[i] = post(server, "/embed_multi", body[i % len(cases)]).json()

    join(start_threads(client, range(CLIENTS * 2)), SECONDS)
    assert len(results) == CLIENTS * 2 and all(results[i] == alone[i % len(cases)] for i in results)


def test_info(server):
    info = {name: ok(httpx.get(server.url + "/info", params={"model": name}, timeout=30)) for name in ("colbert", "m3")}
    assert info["colbert"]["model_type"] == "colbert" and info["colbert"]["routes"] == ["/embed_multi"]
    assert (info["colbert"]["max_query_length"], info["colbert"]["max_input_length"]) == (32, 180)
    assert info["colbert"]["dimension"] == info["colbert"]["token_dimension"] == 32
    assert info["m3"]["model_type"] == "bge-m3" and info["m3"]["routes"] == ["/embed", "/embed_sparse", "/embed_multi"]
    assert (info["m3"]["dimension"], info["m3"]["token_dimension"], info["m3"]["max_input_length"]) == (64, 64, 128)


@pytest.mark.parametrize("model,route,body,status,field,limit", [
    ("colbert", "/embed", {"inputs": "a"}, 424, None, None),
    ("colbert", "/embed_sparse", {"inputs": "a"}, 424, None, None),
    ("colbert", "/v1/embeddings", {"input": "a"}, 424, None, None),
    ("m3", "/embed_all", {"inputs": "a"}, 424, None, None),
    ("dense", "/embed_multi", {"inputs": "a", "is_query": True}, 424, None, None),
    ("colbert", "/embed_multi", {"inputs": "a"}, 422, "is_query", None),
    ("colbert", "/embed_multi", {"inputs": "a", "is_query": "yes"}, 422, "is_query", None),
    ("colbert", "/embed_multi", {"inputs": [], "is_query": True}, 422, "inputs", None),
    ("colbert", "/embed_multi", {"inputs": ["a", ""], "is_query": False}, 422, "inputs[1]", None),
    ("m3", "/embed_multi", {"inputs": "a", "prompt_name": "query"}, 422, "prompt_name", None),
    ("colbert", "/embed_multi", {"inputs": ["a"] * (MAX_INPUTS + 1), "is_query": True}, 413, "inputs", MAX_INPUTS),
    ("colbert", "/embed_multi", {"inputs": ["a", LONG], "is_query": True}, 413, "inputs[1]", 32),
    ("colbert", "/embed_multi", {"inputs": [LONGER], "is_query": False}, 413, "inputs[0]", 180),
    ("m3", "/embed_multi", {"inputs": [LONGER]}, 413, "inputs[0]", M3_LIMIT),
    ("m3", "/embed_sparse", {"inputs": ["a", LONGER]}, 413, "inputs[1]", M3_LIMIT),
], ids=["embed-on-colbert", "sparse-on-colbert", "openai-on-colbert", "embed-all-on-m3", "multi-on-dense",
        "no-is-query", "is-query-string", "empty", "empty-string", "m3-prompt", "too-many", "query-too-long",
        "document-too-long", "m3-too-long", "m3-sparse-too-long"])
def test_errors(server, model, route, body, status, field, limit):
    r = post(server, route, {**body, "model": model})
    assert r.status_code == status, r.text
    err = r.json()
    assert (err["field"], err["limit"]) == (field, limit), err
    if status == 424:
        assert err["error_type"] == "model_type" and route in err["error"]
        if route == "/embed_multi":
            assert "ColBERT" in err["error"] and "BGE-M3" in err["error"]
    assert ok(httpx.get(server.url + "/health", timeout=30)) == {"status": "ok"}  # nothing left broken


def test_colbert_query_costs_its_expanded_length():
    """The batch budget counts an expanded ColBERT query at query_length: 3-token queries, budget 64, expansion to
    32 -> two rows per model call (four without the expansion counted)."""
    from bertfast.tools.serve.batcher import Batcher, Job

    calls = []

    def run(key, rows, types, adapters):
        calls.append(len(rows))
        return np.zeros((len(rows), 1), np.float32)

    batcher = Batcher(max_batch_tokens=BUDGET, max_requests=4)
    try:
        batcher.start(lambda: run).result(timeout=30)
        calls.clear()
        with batcher.admit():
            batcher.submit(Job([[1, 2, 3]] * 4, ("multi", True), min_tokens=32)).result(timeout=30)
            batcher.submit(Job([[1, 2, 3]] * 4, ("multi", False))).result(timeout=30)
    finally:
        batcher.close(timeout=30)
    assert calls == [2, 2, 4]
