"""`bertfast serve --adapter`: LoRA adapters chosen per request, over real HTTP on 127.0.0.1.

A random BERT (`CASES["bert"]`'s model, its vocabulary widened to the default model's tokenizer) served with two PEFT
LoRA adapters (`save_lora`, every slot bertfast adapts) as `base`, `base:legal` and `base:med`. Concurrent clients
send /embed (TEI's `adapter` field) and /v1/embeddings (OpenAI's `"model": "base:legal"`) with either adapter or
none: every answer equals `Encoder.encode(texts, adapter=...)` bit for bit (cpu backend: the engine is
batch-invariant, adapters included), whatever it was batched with; with the engine held, rows of the base model and
of both adapters are queued and then run as one model call, each still its own adapter's output. /v1/models lists
the adapters as MODEL:ADAPTER; an unknown adapter is a 404 in each API's error shape; a bad --adapter exits 2 before
loading anything. Every loop is bounded in count and time; the server is killed in `finally`.
"""

from __future__ import annotations

import os
import re
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
pytest.importorskip("peft", reason="the adapters are saved by PEFT (the test extra)")
httpx = pytest.importorskip("httpx", reason="the serve tests' HTTP client, httpx, is in the test extra")

from helpers.adapters import CASES, save_lora  # noqa: E402
from helpers.serve import (ROOT, WAIT, as_f32, concurrent_clients, free_port, join, metric, ok,  # noqa: E402
                           one_model_call, serving, start_threads, until)

# Short texts: the random model takes 40 positions.
TEXTS = ["hello world", "A man is eating food.", "x", "Paris is the capital of France.", "short",
         "Ünïcödé テキスト and emoji 🙂", "cats, dogs and other animals", "the quick brown fox"]
ADAPTERS = [None, "legal", "med"]
CLIENTS, REQUESTS_PER_CLIENT, SECONDS = 6, 5, 60  # the concurrent tests' count and time bounds
KEY = "test-key"
LOAD_CYCLES = 3  # loads and unloads of one adapter under load
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, minilm_path):
    """(base directory, {adapter: directory}, expected vectors {adapter or None: (len(TEXTS), D)})."""
    import bertfast

    build, targets = CASES["bert"]
    model = build()
    model.resize_token_embeddings(30522)  # the default model's tokenizer; LoRA leaves the embeddings alone
    base = tmp_path_factory.mktemp("base")
    model.save_pretrained(base)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(minilm_path, name)):
            shutil.copy(os.path.join(minilm_path, name), base)
    dirs = {}
    for seed, name in enumerate(ADAPTERS[1:], start=1):
        dirs[name] = str(tmp_path_factory.mktemp(name))
        save_lora(model, dirs[name], seed=seed, r=4, lora_alpha=8, target_modules=targets)
    enc = bertfast.Encoder.from_pretrained(str(base), backend="cpu")
    for name, path in dirs.items():
        enc.load_adapter(name, path)
    expected = {a: enc.encode(TEXTS, adapter=a).numpy() for a in ADAPTERS}
    expected["encoder"] = enc
    assert not np.array_equal(expected[None], expected["legal"]) and not np.array_equal(expected["legal"],
                                                                                        expected["med"])
    return str(base), dirs, expected


@pytest.fixture(scope="module")
def root(served, tmp_path_factory) -> str:
    """The --adapter-root: `extra` (a copy of med), `pickle` (adapter_model.bin only), `escape` (a symlink to a
    directory outside), `filelink` (its safetensors a symlink to a file outside)."""
    dirs = served[1]
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(dirs["med"], root / "extra")
    (root / "pickle").mkdir()
    shutil.copy(os.path.join(dirs["legal"], "adapter_config.json"), root / "pickle")
    (root / "pickle" / "adapter_model.bin").write_bytes(b"not loaded")
    os.symlink(dirs["legal"], root / "escape")
    (root / "filelink").mkdir()
    shutil.copy(os.path.join(dirs["legal"], "adapter_config.json"), root / "filelink")
    outside = os.path.join(dirs["legal"], "adapter_model.safetensors")
    os.symlink(outside, root / "filelink" / "adapter_model.safetensors")
    return str(root)


@pytest.fixture(scope="module")
def server(served, root):
    base, dirs, _ = served
    # A small token budget: requests are split across batches and merged with others. Gated: the engine can be held.
    yield from serving("--model", f"base={base}", "--adapter", f"legal={dirs['legal']}",
                       "--adapter", f"base:med={dirs['med']}", "--max-batch-tokens", "48", "--max-client-batch-size",
                       "8", "--api-key", KEY, "--adapter-root", root, gated=True)


def get(url: str, route: str) -> httpx.Response:
    return httpx.get(url + route, headers=AUTH, timeout=WAIT)


def post(url: str, route: str, body) -> httpx.Response:
    return httpx.post(url + route, json=body, headers=AUTH, timeout=WAIT)




def request(adapter: str | None, route: str, texts: list[str]) -> dict:
    if route == "/v1/embeddings":
        return {"input": texts, "model": "base" if adapter is None else f"base:{adapter}"}
    return {"inputs": texts} if adapter is None else {"inputs": texts, "adapter": adapter}


def vectors_of(route: str, r: httpx.Response) -> np.ndarray:
    got = ok(r)
    return as_f32(got if route == "/embed" else [d["embedding"] for d in got["data"]])


def test_models_lists_adapters(server):
    listed = ok(get(server.url, "/v1/models"))
    assert [m["id"] for m in listed["data"]] == ["base", "base:legal", "base:med"]
    assert all(m["object"] == "model" and isinstance(m["created"], int) for m in listed["data"])
    assert ok(get(server.url, "/v1/models/base:legal"))["id"] == "base:legal"


def test_concurrent_mixed_adapters(server, served):
    """CLIENTS threads send REQUESTS_PER_CLIENT requests each, with a random adapter or none, on a random route: each
    answer is `Encoder.encode` with that adapter, bit for bit (the model echoed as asked on /v1/embeddings)."""
    expected = served[2]

    def check(c, rng):
        adapter = ADAPTERS[int(rng.integers(3))]
        route = ["/embed", "/v1/embeddings"][int(rng.integers(2))]
        pick = rng.choice(len(TEXTS), size=int(rng.integers(1, 6)), replace=True)
        body = request(adapter, route, [TEXTS[i] for i in pick])
        r = c.post(route, json=body)
        same = r.status_code == 200 and np.array_equal(vectors_of(route, r), expected[adapter][pick])
        if route == "/v1/embeddings" and same:
            same = r.json()["model"] == body["model"]
        return None if same else (adapter, route, r.status_code, r.text[:200])

    failures = concurrent_clients(server.url, AUTH, CLIENTS, REQUESTS_PER_CLIENT, SECONDS, check)
    assert not failures, failures[:5]


def test_one_model_call_mixes_adapters(server, served):
    """The engine held behind a first request: one request per adapter (and one of the base model) queue, then run as
    one model call (one batch more than before for the four requests, 2 in all); each is its own adapter's output."""
    expected = served[2]
    rest = [(None, "/v1/embeddings", 1), ("legal", "/embed", 3), ("med", "/v1/embeddings", 3)]

    def post_one(c, item):
        adapter, route, i = item
        return c.post(route, json=request(adapter, route, [TEXTS[i]]))

    answers = one_model_call(server, "base", post_one, (None, "/embed", 0), rest, AUTH)
    for r, (adapter, route, i) in zip(answers, rest):
        assert np.array_equal(vectors_of(route, r), expected[adapter][[i]]), (adapter, route)


def test_embed_all_and_similarity_take_the_adapter(server, served):
    """/embed_all: the adapter's final hidden states of the text alone (`Encoder` forward, `adapter_ids`), bit for
    bit; /similarity: the cosines of its unnormalized vectors (as the route computes them from `encode`'s)."""
    import torch

    from bertfast.tools.serve.routes_tei import cosines

    enc = served[2]["encoder"]
    for adapter in ADAPTERS:
        got = ok(post(server.url, "/embed_all", request(adapter, "/embed_all", TEXTS[:2])))
        for text, states in zip(TEXTS[:2], got):
            ids = enc.tokenize([text])[0][:1]
            with torch.inference_mode():
                want = enc(ids, torch.ones_like(ids), adapter_ids=[adapter],
                           output_dtype=torch.float32).last_hidden_state[0].numpy()
            assert np.array_equal(as_f32(states), want), adapter
        body = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:4]}, "adapter": adapter}
        got = ok(post(server.url, "/similarity", body))
        vectors = enc.encode(TEXTS[:4], adapter=adapter, normalize=False).numpy()
        assert np.array_equal(np.asarray(got), cosines(vectors[0], vectors[1:])), adapter


def test_unknown_adapter_is_404(server):
    r = post(server.url, "/embed", {"inputs": "hello", "adapter": "nope"})
    assert r.status_code == 404, r.text
    body = r.json()
    assert (body["error_type"], body["field"]) == ("adapter_not_found", "adapter") and "legal, med" in body["error"]
    r = post(server.url, "/v1/embeddings", {"input": "hello", "model": "base:nope"})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert "'nope'" in error["message"]
    assert get(server.url, "/v1/models/base:nope").status_code == 404
    assert metric(server.url, "bertfast_requests_in_flight", AUTH) == 0


def test_bad_adapter_specs_are_refused(served, tmp_path):
    """A malformed --adapter, an unknown model, a name given twice, a missing directory or one without safetensors
    (a pickle adapter_model.bin) is a ValueError naming it (`adapter_args`, what the command checks first)."""
    from bertfast.tools.serve.cli import adapter_args

    _, dirs, _ = served
    pickle_only = tmp_path / "pickle"
    pickle_only.mkdir()
    shutil.copy(os.path.join(dirs["legal"], "adapter_config.json"), pickle_only)
    (pickle_only / "adapter_model.bin").write_bytes(b"")
    assert adapter_args([f"legal={dirs['legal']}", f"beta:med={dirs['med']}"], ["alpha", "beta"]) == {
        "alpha": {"legal": dirs["legal"]}, "beta": {"med": dirs["med"]}}
    for given, message in ([["legal"], "expected [MODEL:]NAME=DIR"],
                           [[f"={dirs['legal']}"], "expected [MODEL:]NAME=DIR"],
                           [[f"base:={dirs['legal']}"], "expected [MODEL:]NAME=DIR"],
                           [[f"other:legal={dirs['legal']}"], "no model named 'other' is served (served: base)"],
                           [[f"a={dirs['legal']}", f"base:a={dirs['med']}"], "already has an adapter named 'a'"],
                           [[f"a={tmp_path / 'none'}"], "is not a directory"],
                           [[f"a={pickle_only}"], "has no adapter_model.safetensors"]):
        with pytest.raises(ValueError, match=re.escape(message)):
            adapter_args(given, ["base"])


def test_bad_adapter_exits_2(served, tmp_path):
    """The command exits 2 with the message, before loading anything."""
    base = served[0]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "bertfast", "serve", "--model", f"base={base}", "--adapter",
                        f"legal={tmp_path / 'none'}", "--port", str(free_port())], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--adapter legal=" in r.stderr and "is not a directory" in r.stderr, r.stderr[-500:]


def test_adapter_root_needs_api_key(served, root):
    base = served[0]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "bertfast", "serve", "--model", f"base={base}", "--adapter-root", root,
                        "--port", str(free_port())], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--adapter-root needs --api-key" in r.stderr, r.stderr[-500:]


def test_admin_refusals_change_nothing(server, root):
    """Without the key: 401. A path that is absolute, holds '..', or leads out of the root by a symlink (the
    directory or its safetensors file), a pickle-only directory, a missing one: 422 naming `path`; a name loaded
    already: 409; unloading an unknown adapter: 404. The served adapters are the same after each."""
    url, names = server.url, ok(get(server.url, "/v1/models"))
    r = httpx.post(url + "/admin/adapters", json={"name": "x", "path": "extra"}, timeout=WAIT)
    assert r.status_code == 401, r.text
    for path, message in ((os.path.join(root, "extra"), "relative to the server's --adapter-root"),
                          ("../root/extra", "holds '..'"), ("extra/../extra", "holds '..'"),
                          ("escape", "outside the server's --adapter-root"),
                          ("filelink", "outside the server's --adapter-root"),
                          ("pickle", "pickle files are not loaded"), ("none", "is not a directory")):
        r = post(url, "/admin/adapters", {"name": "x", "path": path})
        assert r.status_code == 422 and r.json()["field"] == "path" and message in r.json()["error"], (path, r.text)
    for name in ("", "a:b"):
        r = post(url, "/admin/adapters", {"name": name, "path": "extra"})
        assert r.status_code == 422 and r.json()["field"] == "name", r.text
    r = post(url, "/admin/adapters", {"name": "legal", "path": "extra"})
    assert r.status_code == 409 and r.json()["field"] == "name", r.text
    r = httpx.delete(url + "/admin/adapters/nope", headers=AUTH, timeout=WAIT)
    assert r.status_code == 404 and r.json()["error_type"] == "adapter_not_found", r.text
    assert ok(get(url, "/v1/models")) == names and metric(url, "bertfast_requests_in_flight", AUTH) == 0


def test_admin_route_off_without_root(served):
    """A server started without --adapter-root answers the admin routes 403 (checked before anything is read)."""
    from starlette.testclient import TestClient

    from bertfast.tools.serve.app import create_app
    from bertfast.tools.serve.model import ServedModel

    client = TestClient(create_app(ServedModel(served[0])))  # no lifespan: nothing is loaded
    r = client.post("/admin/adapters", json={"name": "x", "path": "extra"})
    assert r.status_code == 403 and r.json()["error_type"] == "admin_disabled", r.text
    assert client.delete("/admin/adapters/legal").status_code == 403


def test_load_and_unload_under_load(server, served):
    """Clients send requests with no adapter, `legal` or `extra` while `extra` (med's copy, under the root) is loaded
    and unloaded LOAD_CYCLES times: every answer is its adapter's output bit for bit, or a 404 for `extra` while it
    is not loaded; nothing else (no request lost or failed); once loaded it is listed and answers."""
    expected, url = {**served[2], "extra": served[2]["med"]}, server.url
    failures, lock, done = [], threading.Lock(), threading.Event()

    def client(seed):
        rng = np.random.default_rng(seed)
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
            for _ in range(4 * REQUESTS_PER_CLIENT):
                if done.is_set():
                    break
                adapter = [None, "legal", "extra"][int(rng.integers(3))]
                route = ["/embed", "/v1/embeddings"][int(rng.integers(2))]
                pick = rng.choice(len(TEXTS), size=int(rng.integers(1, 4)), replace=True)
                r = c.post(route, json=request(adapter, route, [TEXTS[i] for i in pick]))
                if adapter == "extra" and r.status_code == 404:
                    continue
                if r.status_code != 200 or not np.array_equal(vectors_of(route, r), expected[adapter][pick]):
                    with lock:
                        failures.append((adapter, route, r.status_code, r.text[:200]))

    threads = start_threads(client, range(4))
    try:
        for _ in range(LOAD_CYCLES):
            assert ok(post(url, "/admin/adapters", {"name": "extra", "path": "extra"}))["adapters"][-1] == "extra"
            time.sleep(0.05)
            r = httpx.delete(url + "/admin/adapters/extra", headers=AUTH, timeout=WAIT)
            assert ok(r)["adapters"] == ["legal", "med"]
    finally:
        done.set()
        join(threads, timeout=SECONDS + WAIT)
    assert not failures, failures[:5]
    ok(post(url, "/admin/adapters", {"name": "extra", "path": "extra"}))
    assert [m["id"] for m in ok(get(url, "/v1/models"))["data"]] == ["base", "base:legal", "base:med", "base:extra"]
    assert np.array_equal(vectors_of("/embed", post(url, "/embed", request("extra", "/embed", TEXTS))),
                          expected["extra"])
    ok(httpx.delete(url + "/admin/adapters/extra", headers=AUTH, timeout=WAIT))


def test_unload_waits_for_requests_in_flight(server, served):
    """The engine held: a request with `extra` is queued, then `extra` is unloaded. New requests naming it get a 404
    at once, the unload waits; released, the queued request gets `extra`'s vectors, then the unload answers."""
    expected, url = served[2], server.url
    ok(post(url, "/admin/adapters", {"name": "extra", "path": "extra"}))
    answers = {}

    def send(item):
        key, method, route, body = item
        with httpx.Client(base_url=url, headers=AUTH, timeout=WAIT) as c:
            answers[key] = c.request(method, route, json=body)

    server.hold()
    try:
        threads = start_threads(send, [("first", "POST", "/embed", {"inputs": [TEXTS[0]]})])
        until(url, "bertfast_requests_in_flight", 1, AUTH)
        until(url, "bertfast_queue_depth", 0, AUTH)  # the engine waits at the gate with the first request's row
        threads += start_threads(send, [("extra", "POST", "/embed", request("extra", "/embed", TEXTS[:3]))])
        until(url, "bertfast_queue_depth", 3, AUTH)
        threads += start_threads(send, [("unload", "DELETE", "/admin/adapters/extra", None)])
        until(url, "bertfast_requests_in_flight", 3, AUTH)
        deadline = time.monotonic() + WAIT
        while (r := post(url, "/embed", request("extra", "/embed", TEXTS[:1]))).status_code != 404:
            assert time.monotonic() < deadline, r.text  # the unload has not started yet
        assert "unload" not in answers  # it waits for the queued request
    finally:
        server.release()
    join(threads, timeout=WAIT)
    assert np.array_equal(vectors_of("/embed", answers["extra"]), expected["med"][:3])
    assert ok(answers["unload"])["adapters"] == ["legal", "med"]
    assert "base:extra" not in [m["id"] for m in ok(get(url, "/v1/models"))["data"]]
