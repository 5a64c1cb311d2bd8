"""`bertfast serve` over real HTTP: the server runs in a subprocess on a free loopback port.

Every route and every documented error, vectors bitwise equal to `Encoder.encode` on the cpu backend
(also when requests are merged into one batch and split by the token budget), overload answered
429 at once, and SIGTERM with requests in flight answering every accepted one (both with the engine thread held on
the server's test gate, so the queue fills the same way on every run). Waits are bounded and the server is killed in
`finally`.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="bertfast serve needs the serve extra (fastapi): pip install 'bertfast[serve]'")
pytest.importorskip("uvicorn", reason="bertfast serve needs the serve extra (uvicorn): pip install 'bertfast[serve]'")
pytest.importorskip("prometheus_client", reason="bertfast serve needs the serve extra (prometheus-client)")
httpx = pytest.importorskip("httpx", reason="the serve tests' HTTP client, httpx, is in the test extra")

from helpers.serve import ROOT, TEXTS, WAIT, Server, as_f32, free_port, join, start_threads  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    # A small token budget so that requests are merged and split across batches.
    srv = Server("--api-key", KEY, "--max-client-batch-size", "8", "--max-batch-tokens", "96",
                 "--max-body-bytes", "65536")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def encoder(minilm_path):
    import bertfast

    return bertfast.Encoder.from_pretrained(minilm_path, backend="cpu")


def test_health_info_openapi(client, server):
    import bertfast

    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}  # no key needed
    info = client.get("/info").json()
    assert info["dimension"] == 384 and info["max_input_length"] == 256 and info["backend"] == "cpu"
    assert info["dtype"] == "float32" and info["isa"] == bertfast.cpu_info()["active"]
    assert info["max_client_batch_size"] == 8 and info["max_batch_tokens"] == 96
    assert info["model_id"] == "sentence-transformers/all-MiniLM-L6-v2" and info["normalizes"] is True
    assert info["model_type"] == "embedding" and info["routes"] == ["/embed", "/embed_all", "/v1/embeddings"]
    assert info["labels"] is None and info["architecture"] == "BertModel"
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/embed", "/embed_all", "/v1/embeddings", "/v1/models", "/predict", "/rerank", "/tokenize", "/health",
            "/info", "/metrics"} <= set(paths)


def test_models_of_a_one_model_server(client):
    """/v1/models lists the one model; its id may hold a '/'; an unknown id is OpenAI's 404 there, while requests
    naming any model are answered by the one model (test_openai_embeddings)."""
    listed = client.get("/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["sentence-transformers/all-MiniLM-L6-v2"]
    assert client.get("/v1/models/sentence-transformers/all-MiniLM-L6-v2").json() == listed["data"][0]
    missing = client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_embed_equals_encode(client, encoder):
    got = client.post("/embed", json={"inputs": TEXTS})
    assert got.status_code == 200, got.text
    assert np.array_equal(as_f32(got.json()), encoder.encode(TEXTS).numpy())
    one = client.post("/embed", json={"inputs": TEXTS[1]}).json()
    assert np.array_equal(as_f32(one), encoder.encode([TEXTS[1]]).numpy())
    raw = client.post("/embed", json={"inputs": TEXTS[:3], "normalize": False}).json()
    assert np.array_equal(as_f32(raw), encoder.encode(TEXTS[:3], normalize=False).numpy())


def test_embed_truncation(client, encoder):
    from bertfast.tokenization import unpadded

    long = "one two three four five six seven " * 60
    right = client.post("/embed", json={"inputs": [long], "truncate": True}).json()
    assert np.array_equal(as_f32(right), encoder.encode([long]).numpy())  # encode keeps the start
    left = client.post("/embed", json={"inputs": long, "truncate": True, "truncation_direction": "Left"}).json()
    ids = unpadded(encoder.tokenizer, "left").encode(long).ids
    assert len(ids) == 256
    ids = __import__("torch").tensor([ids])
    expect = encoder.embed_tokens(ids, ids.new_ones(ids.shape), ids.new_zeros(ids.shape))
    assert np.array_equal(as_f32(left), expect.numpy())


def test_openai_embeddings(client, encoder):
    got = client.post("/v1/embeddings", json={"input": TEXTS[:4], "model": "m"}).json()
    assert got["object"] == "list" and got["model"] == "m"
    assert [d["index"] for d in got["data"]] == [0, 1, 2, 3] and got["data"][0]["object"] == "embedding"
    assert np.array_equal(as_f32([d["embedding"] for d in got["data"]]), encoder.encode(TEXTS[:4]).numpy())
    ids = encoder.tokenizer.encode_batch(TEXTS[:2])
    tokens = [e.ids[:sum(e.attention_mask)] for e in ids]
    assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"] == sum(
        len(encoder.tokenizer.encode(t).ids) for t in TEXTS[:4])
    b64 = client.post("/v1/embeddings", json={"input": tokens, "encoding_format": "base64"}).json()
    vecs = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64["data"]])
    assert np.array_equal(vecs, encoder.encode(TEXTS[:2]).numpy())
    single = client.post("/v1/embeddings", json={"input": tokens[0]}).json()
    assert np.array_equal(as_f32(single["data"][0]["embedding"]), encoder.encode(TEXTS[:1])[0].numpy())
    short = client.post("/v1/embeddings", json={"input": TEXTS[:3], "dimensions": 64}).json()
    short = as_f32([d["embedding"] for d in short["data"]])
    assert short.shape == (3, 64)
    assert np.array_equal(short, encoder.encode(TEXTS[:3], truncate_dim=64, normalize=True).numpy())
    assert np.allclose(np.linalg.norm(short, axis=1), 1, atol=1e-6)


def test_precision(client, encoder, tmp_path):
    from bertfast import quantization_ranges, quantize_embeddings

    want = encoder.encode(TEXTS[:4], convert_to_numpy=True)
    for precision in ("binary", "ubinary"):
        got = np.array(client.post("/embed", json={"inputs": TEXTS[:4], "precision": precision}).json())
        assert np.array_equal(got, quantize_embeddings(want, precision)), precision
    openai = client.post("/v1/embeddings", json={"input": TEXTS[:4], "precision": "ubinary"}).json()
    assert np.array_equal(np.array([d["embedding"] for d in openai["data"]]), quantize_embeddings(want, "ubinary"))
    b64 = client.post("/v1/embeddings", json={"input": TEXTS[:4], "precision": "binary",
                                              "encoding_format": "base64"}).json()
    packed = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.int8) for d in b64["data"]])
    assert np.array_equal(packed, quantize_embeddings(want, "binary"))
    # int8 / uint8 with the server's ranges: each text's codes alone equal its codes in a batch
    ranges = quantization_ranges(encoder.encode(TEXTS, convert_to_numpy=True))
    np.save(tmp_path / "ranges.npy", ranges)
    srv = Server("--ranges", str(tmp_path / "ranges.npy"))
    try:
        for precision in ("int8", "uint8"):
            batch = httpx.post(srv.url + "/embed", json={"inputs": TEXTS[:4], "precision": precision}, timeout=60)
            assert np.array_equal(np.array(batch.json()), quantize_embeddings(want, precision, ranges)), precision
            alone = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS[2], "precision": precision},
                               timeout=60).json()["data"][0]["embedding"]
            assert alone == batch.json()[2]
        short = httpx.post(srv.url + "/v1/embeddings", json={"input": "a", "precision": "int8", "dimensions": 8},
                           timeout=60)
        assert short.status_code == 422 and "ranges are for 384 dimensions" in short.json()["error"]
    finally:
        srv.stop()


def test_tokenize(client, encoder):
    got = client.post("/tokenize", json={"inputs": ["hello world", "x"]}).json()
    assert [[t["text"] for t in row] for row in got] == [["[CLS]", "hello", "world", "[SEP]"], ["[CLS]", "x", "[SEP]"]]
    assert got[0][1] == {"id": encoder.tokenizer.token_to_id("hello"), "text": "hello", "special": False,
                         "start": 0, "stop": 5}
    assert got[0][0]["special"] and got[0][0]["start"] is None
    bare = client.post("/tokenize", json={"inputs": "hello", "add_special_tokens": False}).json()
    assert [t["text"] for t in bare[0]] == ["hello"]


BAD = [  # (id, method, path, body: dict/None or raw bytes, headers, status, field, limit)
    ("empty-list", "POST", "/embed", {"inputs": []}, AUTH, 422, "inputs", None),
    ("empty-string", "POST", "/embed", {"inputs": ["a", ""]}, AUTH, 422, "inputs[1]", None),
    ("wrong-type", "POST", "/embed", {"inputs": 5}, AUTH, 422, "inputs", None),
    ("wrong-bool", "POST", "/embed", {"inputs": "a", "truncate": "yes"}, AUTH, 422, "truncate", None),
    ("missing-field", "POST", "/embed", {"text": "a"}, AUTH, 422, "inputs", None),
    ("not-an-object", "POST", "/embed", [1, 2], AUTH, 422, "body", None),
    ("invalid-json", "POST", "/embed", b'{"inputs": ', AUTH, 400, "body", None),
    ("non-utf8", "POST", "/embed", b'{"inputs": "\xff\xfe"}', AUTH, 400, "body", None),
    ("too-many", "POST", "/embed", {"inputs": ["a"] * 9}, AUTH, 413, "inputs", 8),
    ("too-long", "POST", "/embed", {"inputs": ["a", "word " * 300]}, AUTH, 413, "inputs[1]", 256),
    # the first long input is the tokenizers library's (not ASCII), the second the native WordPiece's
    ("long-unicode", "POST", "/embed", {"inputs": ["a", "é " * 300, "word " * 300]}, AUTH, 413, "inputs[1]", 256),
    ("long-ascii", "POST", "/embed", {"inputs": ["a", "word " * 300, "é " * 300]}, AUTH, 413, "inputs[1]", 256),
    ("body-too-large", "POST", "/embed", {"inputs": "a" * 70000}, AUTH, 413, "body", 65536),
    ("bad-prompt", "POST", "/embed", {"inputs": "a", "prompt_name": "nope"}, AUTH, 422, "prompt_name", None),
    ("openai-mixed", "POST", "/v1/embeddings", {"input": ["a", 1]}, AUTH, 422, "input", None),
    ("openai-empty", "POST", "/v1/embeddings", {"input": []}, AUTH, 422, "input", None),
    ("openai-empty-ids", "POST", "/v1/embeddings", {"input": [[]]}, AUTH, 422, "input", None),
    ("openai-vocab", "POST", "/v1/embeddings", {"input": [101, 10 ** 9]}, AUTH, 422, "input", 30522),
    ("openai-ids-too-long", "POST", "/v1/embeddings", {"input": [[101] * 300]}, AUTH, 413, "input", 256),
    ("openai-dimensions", "POST", "/v1/embeddings", {"input": "a", "dimensions": 999}, AUTH, 422, "dimensions", 384),
    ("openai-format", "POST", "/v1/embeddings", {"input": "a", "encoding_format": "hex"}, AUTH, 422,
     "encoding_format", None),
    ("bad-precision", "POST", "/embed", {"inputs": "a", "precision": "int4"}, AUTH, 422, "precision", None),
    ("int8-without-ranges", "POST", "/embed", {"inputs": ["a", "b"], "precision": "int8"}, AUTH, 422, "precision",
     None),
    ("openai-uint8-without-ranges", "POST", "/v1/embeddings", {"input": "a", "precision": "uint8"}, AUTH, 422,
     "precision", None),
    ("unknown-route", "GET", "/nope", None, AUTH, 404, None, None),
    ("wrong-method", "GET", "/embed", None, AUTH, 405, None, None),
    ("no-key", "POST", "/embed", {"inputs": "a"}, {}, 401, "Authorization", None),
    ("wrong-key", "POST", "/embed", {"inputs": "a"}, {"Authorization": "Bearer nope"}, 401, "Authorization", None),
    ("predict-on-embedding-model", "POST", "/predict", {"inputs": "a"}, AUTH, 424, None, None),
    ("rerank-on-embedding-model", "POST", "/rerank", {"query": "a", "texts": ["b"]}, AUTH, 424, None, None),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests(server, case):
    _, method, path, body, headers, status, field, limit = case
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    r = httpx.request(method, server.url + path, content=content, timeout=30,
                      headers={**headers, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()
    assert isinstance(err["error"], str) and err["error"] and err["error_type"]
    assert err["field"] == field and err["limit"] == limit, err
    if status == 424:  # a route for another kind of model: says what this model is, as TEI's 424
        assert err["error_type"] == "model_type" and "an embedding model (BertModel)" in err["error"], err
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # unharmed


DIRECT = [(path, body) for _, method, path, body, headers, *_ in BAD
          if method == "POST" and path in ("/embed", "/v1/embeddings") and headers is AUTH] + [
    ("/embed", {"inputs": TEXTS[:3]}), ("/embed", {"inputs": "x", "normalize": False, "truncate": True}),
    ("/v1/embeddings", {"input": ["a", "b"], "encoding_format": "base64", "model": "m"}),
    ("/v1/embeddings", {"input": [[101, 7592, 102]]}), ("/v1/embeddings", {"input": "a", "dimensions": 8})]


def test_direct_path_answers_as_the_app(server):
    """A POST to /embed or /v1/embeddings sent as application/json is answered by the Gate's direct path;
    the same body as application/vnd.api+json goes through the FastAPI app (which reads any +json type as
    JSON): the same status and body for every valid and invalid request."""
    for path, body in DIRECT:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        direct = httpx.post(server.url + path, content=content, timeout=30,
                            headers={**AUTH, "Content-Type": "application/json"})
        app = httpx.post(server.url + path, content=content, timeout=30,
                         headers={**AUTH, "Content-Type": "application/vnd.api+json"})
        assert (direct.status_code, direct.content) == (app.status_code, app.content), (path, body)


def test_concurrent_clients_bitwise(server, client, encoder):
    """16 threads x 4 requests of different texts, merged by the engine thread with a 96-token budget:
    every vector equals encode's bit for bit (the engine is batch-invariant on the cpu backend)."""
    reference = encoder.encode(TEXTS).numpy()
    failures, lock = [], threading.Lock()

    def worker(seed):
        rng = np.random.default_rng(seed)
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
            for _ in range(4):
                pick = rng.choice(len(TEXTS), size=int(rng.integers(1, 6)), replace=True)
                route = "/embed" if rng.random() < 0.5 else "/v1/embeddings"
                body = {"inputs": [TEXTS[i] for i in pick]} if route == "/embed" else {"input": [TEXTS[i] for i in pick]}
                r = c.post(route, json=body)
                vecs = as_f32(r.json() if route == "/embed" else [d["embedding"] for d in r.json()["data"]]) \
                    if r.status_code == 200 else None
                if vecs is None or not np.array_equal(vecs, reference[pick]):
                    with lock:
                        failures.append((seed, route, r.status_code, r.text[:200]))

    join(start_threads(worker, range(16)))
    assert not failures, failures[:3]
    metrics = client.get("/metrics").text
    for name in ("bertfast_queue_depth", "bertfast_requests_in_flight", "bertfast_batch_tokens_bucket",
                 "bertfast_request_duration_seconds_bucket", "bertfast_tokens_total"):
        assert name in metrics
    rows = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("bertfast_batch_rows_sum"))
    assert rows >= 16 * 4  # every text went through the engine


def test_overload_and_graceful_shutdown(encoder):
    """2 request places, the engine thread held before its first batch: of 16 requests sent at once exactly 2 are
    accepted and 14 answered 429 at once (nothing can free a place while the engine is held). Then SIGTERM; once the
    server says it is shutting down the engine is released, and both accepted requests are answered 200 with
    encode's vectors before the process exits."""
    heavy = ["one two three four five six seven eight nine ten " * 25] * 8  # 8 texts x 256 tokens
    expect = np.repeat(encoder.encode(heavy[:1]).numpy(), 8, axis=0)
    srv = Server("--max-concurrent-requests", "2", "--max-batch-tokens", "512", gated=True)
    try:
        srv.hold()
        answers = queue.Queue()

        def send(_):
            r = httpx.post(srv.url + "/embed", json={"inputs": heavy, "truncate": True}, timeout=WAIT)
            if r.status_code == 200:
                answers.put((200, np.array_equal(as_f32(r.json()), expect)))
            else:
                answers.put((r.status_code, r.json().get("error_type")))

        senders = start_threads(send, range(16))
        refused = [answers.get(timeout=WAIT) for _ in range(14)]
        assert refused == [(429, "overloaded")] * 14
        assert "bertfast_requests_in_flight 2.0" in httpx.get(srv.url + "/metrics", timeout=WAIT).text
        assert answers.empty()  # the accepted two wait for the engine

        srv.proc.send_signal(signal.SIGTERM)
        srv.wait_for("Shutting down")
        srv.release()
        join(senders, timeout=WAIT)
        assert [answers.get_nowait() for _ in range(2)] == [(200, True)] * 2
        # uvicorn re-raises the signal once it has shut down gracefully: killed by SIGTERM, after the log line
        assert srv.proc.wait(timeout=WAIT) in (0, -signal.SIGTERM)
    finally:
        log = srv.stop()
    assert "Application shutdown complete" in log
    access = [json.loads(line) for line in log.splitlines() if line.startswith('{"ts"')]
    assert sorted(a["status"] for a in access if a["path"] == "/embed") == [200] * 2 + [429] * 14


def test_bad_model_directory_exits_with_a_message(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "bertfast", "serve", "--model", str(tmp_path / "none"),
                        "--port", str(free_port())], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is not a directory" in r.stderr


def test_bad_ranges_file_exits_with_a_message(tmp_path, minilm_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    np.save(tmp_path / "r.npy", np.zeros((3, 384), dtype=np.float32))
    r = subprocess.run([sys.executable, "-m", "bertfast", "serve", "--model", minilm_path, "--ranges",
                        str(tmp_path / "r.npy"), "--port", str(free_port())], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "need a (2, D) float array" in r.stderr
