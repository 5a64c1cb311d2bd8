"""`bertfast serve` with two models in one process, and TEI's /embed_all, over real HTTP on 127.0.0.1.

Two random BERTs of different widths (hidden 64 and 32, the default model's tokenizer, 64 positions) served at once
(`--model alpha=DIR --model beta=DIR`): concurrent clients send /embed, /v1/embeddings and /embed_all to either, and
every answer equals that model's own `Encoder` output computed directly, bit for bit (cpu backend: the engine is
batch-invariant), whatever it was batched with; /v1/models lists both (OpenAI's list shape), `/info` describes the
default or `?model=`; an unknown model is a 404 in OpenAI's error shape on the /v1 routes and in the server's own
elsewhere; /embed_all returns each input's final hidden states for every token (special and prompt tokens included)
and answers its errors without leaving a request in flight. Every loop is bounded in count and time; the server is
killed in `finally`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="bertfast serve needs the serve extra (fastapi): pip install 'bertfast[serve]'")
pytest.importorskip("uvicorn", reason="bertfast serve needs the serve extra (uvicorn): pip install 'bertfast[serve]'")
pytest.importorskip("prometheus_client", reason="bertfast serve needs the serve extra (prometheus-client)")
httpx = pytest.importorskip("httpx", reason="the serve tests' HTTP client, httpx, is in the test extra")
torch = pytest.importorskip("torch")

from conftest import hf_bert  # noqa: E402
from helpers.serve import ROOT, TEXTS, WAIT, Server, as_f32, free_port, join, ok, post, start_threads  # noqa: E402

LIMIT = 64  # max_position_embeddings of both models: the served input limit
MAX_INPUTS = 8  # --max-client-batch-size
LONG = "one two three four five six seven eight nine ten " * 12  # ~120 tokens, over LIMIT
PROMPT = "query: "  # beta's configured prompt "query"
CLIENTS, REQUESTS_PER_CLIENT, SECONDS = 8, 6, 90  # the cross-talk test's count and time bounds


def save_model(path, minilm_path, seed: int, prompts: dict | None = None, **config) -> str:
    """conftest's random BertModel (as `tiny_text_model`), LIMIT positions, with the default model's tokenizer."""
    model = hf_bert(seed=seed, vocab_size=30522, max_position_embeddings=LIMIT, **config)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(minilm_path, name)):
            shutil.copy(os.path.join(minilm_path, name), path)
    if prompts:
        with open(os.path.join(path, "config_sentence_transformers.json"), "w") as f:
            json.dump({"prompts": prompts}, f)
    return str(path)


class Reference:
    """A model's Encoder (cpu backend), computed directly: sentence embeddings and per-token final states."""

    def __init__(self, path):
        import bertfast

        self.encoder = bertfast.Encoder.from_pretrained(path, backend="cpu")

    def embed(self, texts) -> np.ndarray:
        return self.encoder.encode(texts).numpy()

    def tokens(self, text: str, ids: list[int] | None = None) -> np.ndarray:
        """(tokens, hidden) final hidden states of one text alone (or of the given ids)."""
        if ids is None:
            ids = self.encoder.tokenize([text])[0][0].tolist()
        ids = torch.tensor([ids])
        with torch.inference_mode():
            return self.encoder(ids, torch.ones_like(ids), output_dtype=torch.float32).last_hidden_state[0].numpy()


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_path):
    alpha = save_model(tmp_path_factory.mktemp("alpha"), minilm_path, seed=11)
    beta = save_model(tmp_path_factory.mktemp("beta"), minilm_path, seed=12, prompts={"query": PROMPT},
                      hidden_size=32, num_attention_heads=2, intermediate_size=64)
    return {"alpha": (alpha, Reference(alpha)), "beta": (beta, Reference(beta))}


@pytest.fixture(scope="module")
def server(models):
    # A small token budget: requests of both models are split across batches and merged with others.
    srv = Server("--model", f"alpha={models['alpha'][0]}", "--model", f"beta={models['beta'][0]}",
                 "--max-batch-tokens", "48", "--max-client-batch-size", str(MAX_INPUTS))
    try:
        yield srv
    finally:
        log = srv.stop()
    assert "Exception in ASGI application" not in log, log[-3000:]  # nothing raised, after a response either


def in_flight(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("bertfast_requests_in_flight "))


def test_models_listed_and_described(server):
    listed = ok(httpx.get(server.url + "/v1/models", timeout=10))
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["alpha", "beta"]
    assert all(m["object"] == "model" and isinstance(m["created"], int) and m["owned_by"] for m in listed["data"])
    assert ok(httpx.get(server.url + "/v1/models/beta", timeout=10)) == listed["data"][1]
    default = ok(httpx.get(server.url + "/info", timeout=10))
    assert default["model_id"] == "alpha" and default["dimension"] == 64 and default["max_input_length"] == LIMIT
    assert default["routes"] == ["/embed", "/embed_all", "/v1/embeddings"] and default["max_batch_tokens"] == 48
    beta = ok(httpx.get(server.url + "/info", params={"model": "beta"}, timeout=10))
    assert beta["model_id"] == "beta" and beta["dimension"] == 32
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ('bertfast_model_requests_in_flight{model="alpha"}', 'bertfast_model_queue_depth{model="beta"}',
                 'route="/v1/models"', 'route="/v1/models/{model:path}"', 'route="/info"'):  # routes named by template
        assert name in metrics, name


def test_two_models_no_cross_talk(server, models):
    """CLIENTS threads send REQUESTS_PER_CLIENT requests each, to a random model and route, at once: every answer is
    that model's own output for those texts, bit for bit (`model` omitted on some /embed requests: the default)."""
    embedded = {name: ref.embed(TEXTS) for name, (_, ref) in models.items()}
    states = {name: [ref.tokens(t) for t in TEXTS] for name, (_, ref) in models.items()}
    failures, lock, stop = [], threading.Lock(), time.monotonic() + SECONDS

    def check(name, route, pick, r):
        if r.status_code != 200:
            return f"{r.status_code} {r.text[:200]}"
        got = r.json()
        if route == "/embed_all":
            same = len(got) == len(pick) and all(np.array_equal(as_f32(g), states[name][i]) for g, i in zip(got, pick))
        else:
            vectors = got if route == "/embed" else [d["embedding"] for d in got["data"]]
            same = np.array_equal(as_f32(vectors), embedded[name][pick])
            same = same and (route == "/embed" or got["model"] == name)
        return None if same else "wrong values"

    def client(seed):
        rng = np.random.default_rng(seed)
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for _ in range(REQUESTS_PER_CLIENT):
                if time.monotonic() > stop:
                    break
                name = ["alpha", "beta"][int(rng.integers(2))]
                route = ["/embed", "/v1/embeddings", "/embed_all"][int(rng.integers(3))]
                pick = rng.choice(len(TEXTS), size=int(rng.integers(1, 5)), replace=True)
                texts = [TEXTS[i] for i in pick]
                body = {"input": texts, "model": name} if route == "/v1/embeddings" else {"inputs": texts}
                if route != "/v1/embeddings" and (name == "beta" or rng.random() < 0.5):
                    body["model"] = name
                problem = check(name, route, pick, c.post(route, json=body))
                if problem:
                    with lock:
                        failures.append((seed, name, route, list(pick), problem))

    join(start_threads(client, range(CLIENTS)), timeout=SECONDS + 30)
    assert not failures, failures[:3]
    assert in_flight(server.url) == 0


def test_embed_all_equals_encoder_states(server, models):
    _, alpha = models["alpha"]
    _, beta = models["beta"]
    got = ok(post(server, "/embed_all", {"inputs": TEXTS[:3]}))  # the default model
    tokens = ok(post(server, "/tokenize", {"inputs": TEXTS[:3]}))
    for g, t, text in zip(got, tokens, TEXTS[:3]):
        assert np.asarray(g).shape == (len(t), 64)  # every token, [CLS] and [SEP] included
        assert np.array_equal(as_f32(g), alpha.tokens(text))
    one = ok(post(server, "/embed_all", {"inputs": "x", "model": "beta"}))
    assert len(one) == 1 and np.array_equal(as_f32(one[0]), beta.tokens("x"))
    prompted = ok(post(server, "/embed_all", {"inputs": ["x"], "model": "beta", "prompt_name": "query"}))
    assert np.array_equal(as_f32(prompted[0]), beta.tokens(PROMPT + "x"))  # the prompt's tokens included, as TEI
    right = ok(post(server, "/embed_all", {"inputs": LONG, "truncate": True}))
    assert np.array_equal(as_f32(right[0]), alpha.tokens(LONG))  # Encoder's tokenizer keeps the start
    left = ok(post(server, "/embed_all", {"inputs": LONG, "truncate": True, "truncation_direction": "left"}))
    from bertfast.tokenization import unpadded

    ids = unpadded(alpha.encoder.tokenizer, "left").encode(LONG).ids
    assert len(ids) == LIMIT and np.array_equal(as_f32(left[0]), alpha.tokens(LONG, ids))


EMBED_ALL_BAD = [  # (id, body, status, field, limit)
    ("empty-list", {"inputs": []}, 422, "inputs", None),
    ("empty-string", {"inputs": ["a", ""]}, 422, "inputs[1]", None),
    ("wrong-type", {"inputs": 3}, 422, "inputs", None),
    ("too-many", {"inputs": ["a"] * (MAX_INPUTS + 1)}, 413, "inputs", MAX_INPUTS),
    ("too-long", {"inputs": ["a", LONG]}, 413, "inputs[1]", LIMIT),
    ("wrong-direction", {"inputs": "a", "truncation_direction": "up"}, 422, "truncation_direction", None),
    ("bad-prompt", {"inputs": "a", "model": "beta", "prompt_name": "nope"}, 422, "prompt_name", None),
    ("unknown-model", {"inputs": "a", "model": "gamma"}, 404, "model", None),
]


@pytest.mark.parametrize("case", EMBED_ALL_BAD, ids=[c[0] for c in EMBED_ALL_BAD])
def test_embed_all_errors(server, case):
    _, body, status, field, limit = case
    r = post(server, "/embed_all", body)
    assert r.status_code == status, r.text
    err = r.json()
    assert isinstance(err["error"], str) and err["error"] and err["field"] == field and err["limit"] == limit, err
    assert ok(post(server, "/embed_all", {"inputs": "a"}))  # answered after the error: nothing left waiting
    assert in_flight(server.url) == 0


UNKNOWN = [("/embed", {"inputs": "a"}), ("/embed_all", {"inputs": "a"}), ("/embed_sparse", {"inputs": "a"}),
           ("/tokenize", {"inputs": "a"}), ("/predict", {"inputs": "a"}), ("/rerank", {"query": "a", "texts": ["b"]})]


def test_unknown_model(server):
    """404 naming the served models: TEI's shape on its routes (before any check of the model's kind), OpenAI's on
    /v1 (the Gate's direct path and FastAPI's answer alike)."""
    for route, body in UNKNOWN:
        r = post(server, route, {**body, "model": "gamma"})
        assert r.status_code == 404, (route, r.text)
        err = r.json()
        assert err["error_type"] == "model_not_found" and err["field"] == "model", err
        assert "'gamma'" in err["error"] and "alpha, beta" in err["error"]
    info = httpx.get(server.url + "/info", params={"model": "gamma"}, timeout=10)
    assert info.status_code == 404 and info.json()["error_type"] == "model_not_found"
    content = json.dumps({"input": "a", "model": "gamma"}).encode()
    answers = [httpx.post(server.url + "/v1/embeddings", content=content, timeout=30, headers={"Content-Type": kind})
               for kind in ("application/json", "application/vnd.api+json")]
    assert answers[0].status_code == answers[1].status_code == 404 and answers[0].content == answers[1].content
    err = answers[0].json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "model_not_found" and err["param"] == "model"
    assert "'gamma'" in err["message"]
    card = httpx.get(server.url + "/v1/models/gamma", timeout=10)
    assert card.status_code == 404 and card.json()["error"]["code"] == "model_not_found"
    assert in_flight(server.url) == 0 and httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_model_names_on_the_command_line(models, tmp_path):
    """Two models of one name, or an empty name, exit 2 with a message before loading anything."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    alpha, beta = models["alpha"][0], models["beta"][0]
    for args, message in ([["--model", f"m={alpha}", "--model", f"m={beta}"], "two models are named 'm'"],
                          [["--model", f"={alpha}"], "the name before '=' is empty"],
                          [["--model", alpha, "--model", f"x={tmp_path / 'none'}"], "is not a directory"]):
        r = subprocess.run([sys.executable, "-m", "bertfast", "serve", *args, "--port", str(free_port())], env=env,
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr[-500:])


def _until_in_flight(url: str, n: int) -> None:
    """Until the server counts `n` requests in flight (admitted, not answered); fails after WAIT s."""
    deadline = time.monotonic() + WAIT
    while in_flight(url) != n:
        assert time.monotonic() < deadline, f"{in_flight(url)} requests in flight, not {n}, after {WAIT} s"
        time.sleep(0.01)


def test_each_model_has_its_own_request_places(models, minilm_path):
    """--max-concurrent-requests 1, each model, the engines held at their gate: one MiniLM request takes MiniLM's one
    place and a second is refused at once (429 overloaded, limit 1), while a request to the other model is admitted
    to a place of its own (a shared place would refuse it); released, both are answered, the other model's with its
    own vectors, and nothing is left in flight."""
    _, beta = models["beta"]
    srv = Server("--model", f"minilm={minilm_path}", "--model", f"beta={models['beta'][0]}",
                 "--max-concurrent-requests", "1", gated=True)
    try:
        srv.hold()
        answers = {}

        def send(name, body):
            with httpx.Client(base_url=srv.url, timeout=WAIT) as c:
                answers[name] = c.post("/embed", json=body)

        first = threading.Thread(target=send, args=("minilm", {"inputs": TEXTS[:2]}))
        first.start()
        _until_in_flight(srv.url, 1)
        refused = httpx.post(srv.url + "/embed", json={"inputs": TEXTS[:2]}, timeout=WAIT)
        assert refused.status_code == 429, refused.text
        assert (refused.json()["error_type"], refused.json()["limit"]) == ("overloaded", 1)
        other = threading.Thread(target=send, args=("beta", {"inputs": TEXTS[:2], "model": "beta"}))
        other.start()
        _until_in_flight(srv.url, 2)
        srv.release()
        join([first, other])
        assert answers["minilm"].status_code == 200 and answers["beta"].status_code == 200
        assert np.array_equal(as_f32(answers["beta"].json()), beta.embed(TEXTS[:2]))
        assert in_flight(srv.url) == 0
    finally:
        srv.stop()


def test_embed_all_under_bf16_sends_the_unrounded_stream(tmp_path, minilm_path):
    """/embed_all's batch call on a bf16 model (cpu backend): each row's states are the fp32 residual stream
    (`output_dtype=torch.float32`) of that text alone, bit for bit, not their rounding to bf16 (JSON carries fp32)."""
    from bertfast.tools.serve.model import TOKENS, ServedModel

    served = ServedModel(save_model(tmp_path / "m", minilm_path, seed=5), backend="cpu", dtype="bf16")
    served.load()
    rows = [served.encoder.tokenize([t])[0][0].tolist() for t in TEXTS[:3]]
    got = served.run(TOKENS, rows, [None] * len(rows))
    for row, states in zip(rows, got):
        ids = torch.tensor([row])
        with torch.inference_mode():
            want = served.encoder(ids, torch.ones_like(ids), output_dtype=torch.float32).last_hidden_state[0]
        assert states.dtype == np.float32 and np.array_equal(states, want.numpy())
        assert not np.array_equal(states, want.to(torch.bfloat16).float().numpy())
