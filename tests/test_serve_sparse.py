"""`bertfast serve` with a SPLADE model (a sentence-transformers SparseEncoder): TEI's /embed_sparse against the real
server on 127.0.0.1, its errors, and the 424 a dense model answers."""

import os
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download; set before the hub libraries load

import pytest

pytest.importorskip("fastapi", reason="bertfast serve needs the serve extra (fastapi): pip install 'bertfast[serve]'")
pytest.importorskip("uvicorn", reason="bertfast serve needs the serve extra (uvicorn): pip install 'bertfast[serve]'")
pytest.importorskip("prometheus_client", reason="bertfast serve needs the serve extra (prometheus-client)")
httpx = pytest.importorskip("httpx", reason="the serve tests' HTTP client, httpx, is in the test extra")
st = pytest.importorskip("sentence_transformers")

import torch  # noqa: E402

import bertfast  # noqa: E402
from bertfast.accuracy import rel_error  # noqa: E402
from helpers.serve import TEXTS, Server, join, start_threads  # noqa: E402

LONG = "one two three four five six seven eight nine ten " * 12  # ~120 tokens, over the 64-position limit


@pytest.fixture(scope="module")
def sparse_server(splade_model):
    srv = Server("--model", splade_model, "--max-client-batch-size", "8", "--max-batch-tokens", "64")
    try:
        yield srv
    finally:
        srv.stop()


def post(server, route, body) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def as_dense(rows) -> torch.Tensor:
    out = torch.zeros(len(rows), 30522, dtype=torch.float64)
    for i, row in enumerate(rows):
        assert [e["index"] for e in row] == sorted(e["index"] for e in row)  # ascending indices, as TEI
        for e in row:
            assert e["value"] != 0
            out[i, e["index"]] = e["value"]
    return out


def test_embed_sparse_equals_encode(sparse_server, splade_model):
    r = post(sparse_server, "/embed_sparse", {"inputs": TEXTS})
    assert r.status_code == 200, r.text
    got = as_dense(r.json())
    ours = bertfast.SparseEncoder.from_pretrained(splade_model, backend="cpu").encode(TEXTS)
    assert torch.equal(got, ours.to_dense().double())  # the same kernel: bit for bit
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = st.SparseEncoder(splade_model, device="cpu").encode(TEXTS).to_dense().double()
    assert rel_error(got, theirs) <= 1e-5
    one = post(sparse_server, "/embed_sparse", {"inputs": TEXTS[3]}).json()
    assert len(one) == 1 and torch.equal(as_dense(one)[0], got[3])


def test_embed_sparse_batch_invariant_under_load(sparse_server):
    """Concurrent one-text requests, merged into shared batches (budget 64 tokens), equal each text alone."""
    alone = [post(sparse_server, "/embed_sparse", {"inputs": t}).json()[0] for t in TEXTS]
    results = {}

    def client(i):
        results[i] = post(sparse_server, "/embed_sparse", {"inputs": TEXTS[i % len(TEXTS)]}).json()[0]

    join(start_threads(client, range(3 * len(TEXTS))))
    assert all(results[i] == alone[i % len(TEXTS)] for i in results)


def test_embed_sparse_truncate_and_info(sparse_server):
    r = post(sparse_server, "/embed_sparse", {"inputs": [LONG]})
    assert r.status_code == 413 and r.json()["field"] == "inputs[0]" and r.json()["limit"] == 64
    assert post(sparse_server, "/embed_sparse", {"inputs": [LONG], "truncate": True}).status_code == 200
    info = httpx.get(sparse_server.url + "/info", timeout=30).json()
    assert info["model_type"] == "sparse" and info["routes"] == ["/embed_sparse"]
    assert info["dimension"] == 30522 and info["pooling"] == ["splade_max"]


@pytest.mark.parametrize("route,body,status,field", [
    ("/embed_sparse", {"inputs": []}, 422, "inputs"),
    ("/embed_sparse", {"inputs": ["a", ""]}, 422, "inputs[1]"),
    ("/embed_sparse", {"inputs": ["a"] * 9}, 413, "inputs"),
    ("/embed_sparse", {"inputs": "a", "prompt_name": "nope"}, 422, "prompt_name"),
    ("/embed_sparse", {"inputs": 3}, 422, "inputs"),
    ("/embed", {"inputs": "a"}, 424, None),
    ("/v1/embeddings", {"input": "a"}, 424, None),
    ("/embed_all", {"inputs": "a"}, 424, None),
], ids=["empty", "empty-string", "too-many", "prompt-name", "wrong-type", "embed-on-sparse", "openai-on-sparse",
        "embed-all-on-sparse"])
def test_sparse_server_errors(sparse_server, route, body, status, field):
    r = post(sparse_server, route, body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["field"] == field
    if status == 424:
        assert err["error_type"] == "model_type" and "sparse (SPLADE) model" in err["error"]
        assert "/embed_sparse" in err["error"]


def test_embed_sparse_on_a_dense_model(tiny_text_model):
    srv = Server("--model", tiny_text_model)
    try:
        r = post(srv, "/embed_sparse", {"inputs": "a"})
        assert r.status_code == 424, r.text
        err = r.json()
        assert err["error_type"] == "model_type" and "embedding model" in err["error"]
        assert "SPLADE model" in err["error"] and "/embed" in err["error"]
    finally:
        srv.stop()
