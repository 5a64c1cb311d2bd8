"""`bertfast serve` driven by the clients users run, and TEI's whole route table by raw requests.

OpenAI's Python client (`openai.OpenAI(...).embeddings.create`, which asks for base64 unless told otherwise) and
Hugging Face's `huggingface_hub.InferenceClient(base_url=...)` (`feature_extraction`, `sentence_similarity`,
`text_classification`: what LangChain's and LlamaIndex's TEI integrations call; they post to `/`) against real
servers on 127.0.0.1: vectors equal `Encoder.encode`'s bit for bit (cpu backend), scores equal transformers' within
1e-5. Raw requests cover TEI's default route (POST / and /invocations: the route of the model's kind, for an
embedding model, a classifier, a reranker, a SPLADE model, a ColBERT model and BGE-M3), GET / and /ping (health, without the API key),
/embeddings (OpenAI's route at TEI's alias), /similarity, /decode, and each route's bad input: a 4xx JSON naming
the field, the same at / as at the route it stands for.
"""

from __future__ import annotations

import base64
import importlib.util
import json

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="bertfast serve needs the serve extra (fastapi): pip install 'bertfast[serve]'")
pytest.importorskip("uvicorn", reason="bertfast serve needs the serve extra (uvicorn): pip install 'bertfast[serve]'")
pytest.importorskip("prometheus_client", reason="bertfast serve needs the serve extra (prometheus-client)")
httpx = pytest.importorskip("httpx", reason="the serve tests' HTTP client, httpx, is in the test extra")
openai = pytest.importorskip("openai", reason="OpenAI's client is in the test extra: pip install openai")
huggingface_hub = pytest.importorskip("huggingface_hub",
                                      reason="Hugging Face's client is in the test extra: pip install huggingface_hub")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.bgem3 import save_bgem3  # noqa: E402
from helpers.colbert import write_colbert  # noqa: E402
# LIMIT, checkpoint: the classifier and reranker checkpoints the task routes' tests use (random, MiniLM's tokenizer).
from helpers.serve import LIMIT, TEXTS, TOL, Reference, Server, as_f32, checkpoint, ok  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_INPUTS = 8  # --max-client-batch-size
LONG = "one two three four five six seven " * 60  # over MiniLM's 256 tokens
HF = huggingface_hub.__version__


@pytest.fixture(scope="module")
def server():
    srv = Server("--api-key", KEY, "--max-client-batch-size", str(MAX_INPUTS), "--max-batch-tokens", "512")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def encoder(minilm_path):
    import bertfast

    return bertfast.Encoder.from_pretrained(minilm_path, backend="cpu")


@pytest.fixture(scope="module")
def kinds(request, tmp_path_factory, minilm_path):
    """One server of a model of each other kind: a classifier (the default model), a reranker, a ColBERT model, a
    BGE-M3 model and, where sentence-transformers can save one, a SPLADE model. POST / answers each as its kind,
    picked by the body's `model`."""
    cls = checkpoint(tmp_path_factory.mktemp("classifier"), minilm_path, 3, seed=0)
    rerank = checkpoint(tmp_path_factory.mktemp("reranker"), minilm_path, 1, seed=1)
    colbert = write_colbert(tmp_path_factory.mktemp("colbert") / "model", minilm_path)
    m3 = save_bgem3(tmp_path_factory.mktemp("bgem3") / "model")
    models = ["--model", f"cls={cls}", "--model", f"rerank={rerank}", "--model", f"colbert={colbert}",
              "--model", f"m3={m3}"]
    if importlib.util.find_spec("sentence_transformers") is not None:
        models += ["--model", f"sparse={request.getfixturevalue('splade_model')}"]
    srv = Server(*models, "--max-client-batch-size", str(MAX_INPUTS))
    try:
        yield srv, Reference(cls, LIMIT), Reference(rerank, LIMIT)
    finally:
        srv.stop()


@pytest.fixture
def hf_client(monkeypatch):
    """InferenceClient(base_url=url, api_key=...) -> a client. The Hub's offline switch (HF_HUB_OFFLINE, which other
    test modules set so that nothing downloads) refuses every request of the client, a loopback server's too; these
    calls go to that server only."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return lambda url, api_key=None: huggingface_hub.InferenceClient(base_url=url, api_key=api_key, timeout=60)


def post(srv, route, body, headers=AUTH) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + route, content=content, timeout=60,
                      headers={**headers, "Content-Type": "application/json"})


def requests_to(srv, route: str, status: int = 200) -> float:
    """bertfast_requests_total{route, status} from /metrics: which route a client's call reached."""
    metrics = httpx.get(srv.url + "/metrics", headers=AUTH, timeout=10).text
    line = f'bertfast_requests_total{{route="{route}",status="{status}"}}'
    return next((float(m.split()[-1]) for m in metrics.splitlines() if m.startswith(line)), 0.0)


# --- OpenAI's client ---

def test_openai_client_embeddings(server, encoder):
    """Through /v1 and through the server's root (the client then posts to /embeddings, TEI's alias): the client's
    default (it asks for base64 and decodes float32), encoding_format float and base64, dimensions."""
    want = encoder.encode(TEXTS).numpy()
    for base_url in (server.url + "/v1", server.url):
        client = openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=60)
        raw = client.embeddings.with_raw_response.create(model="any-name", input=TEXTS)
        assert json.loads(raw.http_request.content)["encoding_format"] == "base64"  # the client's default
        got = raw.parse()
        assert got.model == "any-name" and [d.index for d in got.data] == list(range(len(TEXTS)))
        assert np.array_equal(np.array([d.embedding for d in got.data], dtype=np.float32), want)
        assert got.usage.prompt_tokens == got.usage.total_tokens == sum(
            len(encoder.tokenizer.encode(t).ids) for t in TEXTS)
        floats = client.embeddings.create(model="m", input=TEXTS[:3], encoding_format="float")
        assert np.array_equal(as_f32([d.embedding for d in floats.data]), want[:3])
        b64 = client.embeddings.create(model="m", input=TEXTS[3], encoding_format="base64")
        packed = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")
        assert np.array_equal(packed, want[3])
        short = client.embeddings.create(model="m", input=TEXTS[:2], dimensions=64)
        assert np.array_equal(np.array([d.embedding for d in short.data], dtype=np.float32),
                              encoder.encode(TEXTS[:2], truncate_dim=64, normalize=True).numpy())
    assert requests_to(server, "/embeddings") >= 4 and requests_to(server, "/v1/embeddings") >= 4


def test_openai_client_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.embeddings.create(model="m", input=[])
    assert e.value.status_code == 422 and e.value.response.json()["field"] == "input"
    # The client reads OpenAI's {"error": {"message"}}; of the server's shape it keeps the message as `body`.
    assert "input is empty" in e.value.body
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.embeddings.create(model="m", input="a", dimensions=385)
    err = e.value.response.json()
    assert err["field"] == "dimensions" and err["limit"] == 384
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).embeddings.create(model="m", input="a")


# --- Hugging Face's InferenceClient ---

def test_hf_feature_extraction(server, encoder, hf_client):
    """feature_extraction posts TEI's /embed body to `/`: the vectors of /embed, with its parameters."""
    client = hf_client(server.url, KEY)
    before = requests_to(server, "/")
    one = client.feature_extraction(TEXTS[1])
    assert one.dtype == np.float32 and np.array_equal(one, encoder.encode([TEXTS[1]]).numpy())
    assert np.array_equal(client.feature_extraction(TEXTS), encoder.encode(TEXTS).numpy())
    raw = client.feature_extraction(TEXTS[:3], normalize=False)
    assert np.array_equal(raw, encoder.encode(TEXTS[:3], normalize=False).numpy())
    unit = client.feature_extraction(TEXTS[:3], normalize=True)  # TEI's default; MiniLM normalizes anyway
    assert np.array_equal(unit, encoder.encode(TEXTS[:3]).numpy())
    long = client.feature_extraction(LONG, truncate=True)
    assert np.array_equal(long, encoder.encode([LONG]).numpy())  # encode keeps the start, as truncate does
    query = client.feature_extraction(TEXTS[:2], prompt_name="query")
    assert np.array_equal(query, encoder.encode(TEXTS[:2], prompt_name="query").numpy())
    short = client.feature_extraction(TEXTS[:2], dimensions=32)
    assert np.array_equal(short, encoder.encode(TEXTS[:2], truncate_dim=32, normalize=True).numpy())
    assert requests_to(server, "/") - before == 7  # every call went to the root
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as e:
        client.feature_extraction("")
    assert e.value.response.status_code == 422 and e.value.response.json()["field"] == "inputs[0]"


def test_hf_sentence_similarity(server, encoder, hf_client):
    """sentence_similarity posts {"inputs": {"source_sentence", "sentences"}} to `/`: TEI's /similarity, each
    sentence's cosine to the source over the unnormalized vectors (fp64 from encode's fp32 vectors)."""
    if not hasattr(huggingface_hub.InferenceClient, "sentence_similarity"):
        pytest.skip(f"huggingface_hub {HF} has no InferenceClient.sentence_similarity")
    vectors = encoder.encode(TEXTS, normalize=False).numpy().astype(np.float64)
    want = vectors[1:] @ vectors[0] / (np.linalg.norm(vectors[1:], axis=1) * np.linalg.norm(vectors[0]))
    client = hf_client(server.url, KEY)
    before = requests_to(server, "/")
    got = client.sentence_similarity(TEXTS[0], TEXTS[1:])
    assert requests_to(server, "/") == before + 1
    assert np.allclose(got, want, rtol=0, atol=1e-12), (got, want)
    assert ok(post(server, "/similarity", {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}})) == got
    prompted = ok(post(server, "/", {"inputs": {"source_sentence": "a", "sentences": ["b"]},
                                     "parameters": {"prompt_name": "query", "truncate": True}}))
    q = encoder.encode(["a", "b"], prompt_name="query", normalize=False).numpy().astype(np.float64)
    assert abs(prompted[0] - q[1] @ q[0] / (np.linalg.norm(q[0]) * np.linalg.norm(q[1]))) <= 1e-12


def test_hf_text_classification(kinds, hf_client):
    """text_classification posts {"inputs": text} to `/` of a classifier server: TEI's /predict. Of TEI's flat list
    for one text the client (huggingface_hub 2.4) returns the first element, the best label; a list is taken too."""
    srv, cls, _ = kinds
    client = hf_client(srv.url)
    before = requests_to(srv, "/")
    for text in TEXTS[:3]:
        got = client.text_classification(text)
        best = got[0] if isinstance(got, list) else got
        scores = torch.softmax(cls.logits([text])[0], -1)
        assert best.label == f"label-{int(scores.argmax())}"
        assert abs(best.score - float(scores.max())) <= TOL
        assert best.score == ok(post(srv, "/predict", {"inputs": text}))[0]["score"]
    assert requests_to(srv, "/") == before + 3


# --- TEI's route table, raw ---

def test_health_aliases_and_info(server, kinds):
    for path in ("/", "/ping", "/health"):
        assert ok(httpx.get(server.url + path, timeout=10)) == {"status": "ok"}  # no key needed, as /health
    assert post(server, "/", {"inputs": "a"}, headers={}).status_code == 401  # POST / is a model route: key needed
    assert ok(httpx.get(server.url + "/info", headers=AUTH, timeout=10))["default_route"] == "/embed"
    srv = kinds[0]
    defaults = {"cls": "/predict", "rerank": "/rerank", "sparse": "/embed_sparse", "colbert": "/embed_multi",
                "m3": "/embed"}
    for name in ok(httpx.get(srv.url + "/v1/models", timeout=10))["data"]:
        info = ok(httpx.get(srv.url + "/info", params={"model": name["id"]}, timeout=10))
        assert info["default_route"] == defaults[name["id"]]
    paths = ok(httpx.get(server.url + "/openapi.json", timeout=10))["paths"]
    assert {"/", "/invocations", "/ping", "/embeddings", "/similarity", "/decode"} <= set(paths)


def test_default_route_of_an_embedding_model(server, encoder):
    body = {"inputs": TEXTS[:4], "normalize": False}
    want = post(server, "/embed", body)
    assert np.array_equal(as_f32(ok(want)), encoder.encode(TEXTS[:4], normalize=False).numpy())
    for path in ("/", "/invocations"):
        got = post(server, path, body)
        assert (got.status_code, got.content) == (200, want.content), path


def test_default_route_of_every_kind(kinds):
    srv, cls, rerank = kinds
    predict = {"inputs": [[TEXTS[0]], [TEXTS[1], TEXTS[2]]], "raw_scores": True}
    want = post(srv, "/predict", predict, headers={})
    rank = {"model": "rerank", "query": "what is the capital of France?", "texts": TEXTS[:4], "return_text": True}
    ranked = post(srv, "/rerank", rank, headers={})
    for path in ("/", "/invocations"):
        got = post(srv, path, predict, headers={})
        assert (got.status_code, got.content) == (200, want.content), path
        got = post(srv, path, rank, headers={})
        assert (got.status_code, got.content) == (200, ranked.content), path
    logits = cls.logits([TEXTS[0], (TEXTS[1], TEXTS[2])])
    for row, expect in zip(ok(want), logits):
        assert max(abs(p["score"] - float(expect[int(p["label"][-1])])) for p in row) <= TOL
    scores = torch.sigmoid(rerank.logits([(rank["query"], t) for t in TEXTS[:4]])[:, 0])
    assert max(abs(r["score"] - float(scores[r["index"]])) for r in ok(ranked)) <= TOL
    # bertfast's /embed_multi for ColBERT; BGE-M3's dense vectors (/embed) and their cosines (/similarity)
    for route, body in (("/embed_multi", {"model": "colbert", "inputs": TEXTS[:2], "is_query": True}),
                        ("/embed", {"model": "m3", "inputs": ["hello world", "quick brown fox"]}),
                        ("/similarity", {"model": "m3", "inputs": {"source_sentence": "hello world",
                                                                   "sentences": ["quick brown fox", "the lazy dog"]}})):
        want = post(srv, route, body, headers={})
        assert want.status_code == 200, want.text
        for path in ("/", "/invocations"):
            assert post(srv, path, body, headers={}).content == want.content, (path, route)
    if "sparse" not in {m["id"] for m in ok(httpx.get(srv.url + "/v1/models", timeout=10))["data"]}:
        pytest.skip("sentence-transformers is not installed: no SPLADE checkpoint to serve")
    sparse = {"model": "sparse", "inputs": TEXTS[:3]}
    want = post(srv, "/embed_sparse", sparse, headers={})
    assert want.status_code == 200 and len(want.json()) == 3
    for path in ("/", "/invocations"):
        assert post(srv, path, sparse, headers={}).content == want.content, path


def test_embeddings_alias(server):
    """/embeddings answers as /v1/embeddings, on the Gate's direct path and through the app alike."""
    for body in ({"input": TEXTS[:3], "model": "m"}, {"input": [[101, 7592, 102]], "encoding_format": "base64"},
                 {"input": []}, {"input": "a", "dimensions": 0}):
        want = post(server, "/v1/embeddings", body)
        direct = post(server, "/embeddings", body)
        app = httpx.post(server.url + "/embeddings", content=json.dumps(body).encode(), timeout=60,
                         headers={**AUTH, "Content-Type": "application/vnd.api+json"})
        assert (direct.status_code, direct.content) == (app.status_code, app.content) == (
            want.status_code, want.content), body


def test_decode_inverts_tokenize(server, encoder):
    tokens = ok(post(server, "/tokenize", {"inputs": TEXTS}))
    ids = [[t["id"] for t in row] for row in tokens]
    assert ok(post(server, "/decode", {"ids": ids})) == encoder.tokenizer.decode_batch(ids)
    kept = ok(post(server, "/decode", {"ids": ids, "skip_special_tokens": False}))
    assert kept == encoder.tokenizer.decode_batch(ids, skip_special_tokens=False)
    assert kept[0] == "[CLS] hello world [SEP]"
    assert ok(post(server, "/decode", {"ids": ids[0]})) == ["hello world"]  # one list of ids: one text


BAD = [  # (id, path, body (dict or raw bytes), status, field, limit); the embedding server, --max-client-batch-size 8
    ("root-invalid-json", "/", b'{"inputs": ', 400, "body", None),
    ("root-not-an-object", "/", [1, 2], 422, "body", None),
    ("root-wrong-type", "/", {"inputs": 5}, 422, "inputs", None),
    ("root-missing", "/", {"text": "a"}, 422, "inputs", None),
    ("root-empty", "/", {"inputs": []}, 422, "inputs", None),
    ("root-too-many", "/", {"inputs": ["a"] * 9}, 413, "inputs", 8),
    ("root-too-long", "/", {"inputs": ["a", LONG]}, 413, "inputs[1]", 256),
    ("root-dimensions", "/", {"inputs": "a", "dimensions": 0}, 422, "dimensions", 384),
    ("root-model-type", "/", {"inputs": "a", "model": 5}, 422, "model", None),
    ("invocations-empty-string", "/invocations", {"inputs": ["a", ""]}, 422, "inputs[1]", None),
    ("invocations-bad-precision", "/invocations", {"inputs": "a", "precision": "int4"}, 422, "precision", None),
    ("similarity-empty-source", "/similarity", {"inputs": {"source_sentence": "", "sentences": ["a"]}}, 422,
     "inputs.source_sentence", None),
    ("similarity-no-sentences", "/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 422,
     "inputs.sentences", None),
    ("similarity-empty-sentence", "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b", ""]}}, 422,
     "inputs.sentences[1]", None),
    ("similarity-too-many", "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"] * 9}}, 413,
     "inputs.sentences", 8),
    ("similarity-source-too-long", "/similarity", {"inputs": {"source_sentence": LONG, "sentences": ["b"]}}, 413,
     "inputs.source_sentence", 256),
    ("similarity-sentence-too-long", "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b", LONG]}},
     413, "inputs.sentences[1]", 256),
    ("similarity-wrong-type", "/similarity", {"inputs": {"source_sentence": "a", "sentences": "b"}}, 422, "inputs",
     None),
    ("similarity-bad-parameters", "/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]},
                                                  "parameters": {"truncate": "yes"}}, 422, "parameters", None),
    ("embeddings-empty", "/embeddings", {"input": []}, 422, "input", None),
    ("embeddings-format", "/embeddings", {"input": "a", "encoding_format": "hex"}, 422, "encoding_format", None),
    ("decode-empty", "/decode", {"ids": []}, 422, "ids", None),
    ("decode-empty-row", "/decode", {"ids": [[101], []]}, 422, "ids[1]", None),
    ("decode-out-of-vocabulary", "/decode", {"ids": [101, 30522]}, 422, "ids", 30522),
    ("decode-negative", "/decode", {"ids": [[101], [-1]]}, 422, "ids[1]", 30522),
    ("decode-wrong-type", "/decode", {"ids": "hello"}, 422, "ids", None),
    ("decode-too-many", "/decode", {"ids": [[101]] * 9}, 413, "ids", 8),
]
# The same bodies at the route / stands for: the same answer, bit for bit.
SAME = {"/": "/embed", "/invocations": "/embed"}


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests(server, case):
    _, path, body, status, field, limit = case
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()
    assert isinstance(err["error"], str) and err["error"] and err["error_type"]
    assert err["field"] == field and err["limit"] == limit, err
    if path in SAME:  # the same answer; invalid JSON's message quotes the parser (FastAPI's there, pydantic's here)
        alias = post(server, SAME[path], body)
        same = (lambda a: {**a.json(), "error": None}) if isinstance(body, bytes) else (lambda a: a.content)
        assert (alias.status_code, same(alias)) == (r.status_code, same(r))
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # unharmed


TASK_BAD = [  # (id, body, status, field) at POST / of the task server (default model: the classifier)
    ("predict-empty", {"inputs": []}, 422, "inputs"),
    ("predict-three-texts", {"inputs": ["a", "b", "c"]}, 422, "inputs"),
    ("predict-wrong-type", {"inputs": 5}, 422, "inputs"),
    ("rerank-empty-query", {"model": "rerank", "query": "", "texts": ["a"]}, 422, "query"),
    ("rerank-missing-query", {"model": "rerank", "inputs": "a"}, 422, "query"),
    ("rerank-too-many", {"model": "rerank", "query": "q", "texts": ["a"] * 9}, 413, "texts"),
    ("unknown-model", {"model": "nope", "inputs": "a"}, 404, "model"),
    ("colbert-without-is-query", {"model": "colbert", "inputs": "a"}, 422, "is_query"),
    ("m3-dimensions", {"model": "m3", "inputs": "a", "dimensions": 8}, 422, "dimensions"),
    ("m3-similarity-empty", {"model": "m3", "inputs": {"source_sentence": "a", "sentences": []}}, 422,
     "inputs.sentences"),
]


@pytest.mark.parametrize("case", TASK_BAD, ids=[c[0] for c in TASK_BAD])
def test_bad_requests_to_task_models(kinds, case):
    srv = kinds[0]
    _, body, status, field = case
    r = post(srv, "/", body, headers={})
    assert r.status_code == status, r.text
    assert r.json()["field"] == field and r.json()["error"], r.json()
    route = {"rerank": "/rerank", "colbert": "/embed_multi", "m3": "/embed"}.get(body.get("model"), "/predict")
    if isinstance(body.get("inputs"), dict):
        route = "/similarity"
    same = post(srv, route, body, headers={})
    assert (same.status_code, same.content) == (r.status_code, r.content)
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
