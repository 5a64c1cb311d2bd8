"""`bertfast serve --adapter` on task models: /predict and /rerank with LoRA adapters, over real HTTP on 127.0.0.1.

Two random BertForSequenceClassification checkpoints (`helpers.serve.checkpoint`: 3 labels, and 1 label: a reranker)
are served as `cls` and `rr`, each with two PEFT SEQ_CLS adapters (`save_lora` on every BERT slot; PEFT saves the
classifier whole: `modules_to_save`). Concurrent clients send /predict and /rerank (TEI's `adapter` field) with either
adapter or none, scores or raw logits: every answer equals, bit for bit, the `TaskModel` forward of that input alone
with `adapter_ids=[adapter]` (then `scores`), whatever it was batched with (cpu backend: batch-invariant, heads
included); with the engine held, rows of the base model and of both adapters run as one model call. An unknown adapter
is a 404 naming `adapter`; the admin route loads an adapter onto a task model, requests get its scores, the unload
refuses it again; an adapter saved for another num_labels is a 422 that loads nothing. Every loop is bounded in count and time; the server is killed in `finally`.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="bertfast serve needs the serve extra (fastapi): pip install 'bertfast[serve]'")
pytest.importorskip("uvicorn", reason="bertfast serve needs the serve extra (uvicorn): pip install 'bertfast[serve]'")
pytest.importorskip("prometheus_client", reason="bertfast serve needs the serve extra (prometheus-client)")
pytest.importorskip("peft", reason="the adapters are saved by PEFT (the test extra)")
httpx = pytest.importorskip("httpx", reason="the serve tests' HTTP client, httpx, is in the test extra")

from helpers.adapters import ALL_BERT, save_lora  # noqa: E402
from helpers.serve import (WAIT, as_f32, checkpoint, concurrent_clients, metric, ok,  # noqa: E402
                           one_model_call, serving)

TEXTS = ["hello world", "A man is eating food.", "x", "Ünïcödé テキスト and emoji 🙂",
         "cats, dogs and other animals"]
PAIRS = [("what is the capital of france?", "Paris is the capital of France."), ("q", "a")]
INPUTS = [*TEXTS, *PAIRS]  # /predict's inputs
QUERY = "how do cats sleep"  # /rerank pairs it with each of TEXTS
MODELS = {"cls": (3, ["a", "b"]), "rr": (1, ["x", "y"])}  # served name -> (num_labels, its adapters)
LABELS = {name: [f"label-{i}" for i in range(n)] for name, (n, _) in MODELS.items()}
CLIENTS, REQUESTS_PER_CLIENT, SECONDS = 4, 6, 60  # the concurrent test's count and time bounds
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _peft_adapter(model, path, seed: int) -> str:
    """A SEQ_CLS LoRA adapter of `model` at `path`: every BERT slot, the classifier saved whole (perturbed)."""
    save_lora(model, path, seed=seed, r=4, lora_alpha=8, target_modules=ALL_BERT, task_type="SEQ_CLS")
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory, minilm_path):
    """(served name -> checkpoint directory, (model, adapter) -> directory, expected scores): expected[(model,
    adapter, raw)] is (len(inputs), labels) float32, each input's row from the TaskModel on that input alone."""
    import torch
    import transformers

    import bertfast
    from bertfast.tokenization import unpadded

    paths, dirs, expected = {}, {}, {}
    for seed, (name, (labels, adapters)) in enumerate(MODELS.items()):
        paths[name] = checkpoint(tmp_path_factory.mktemp(name), minilm_path, labels, seed=seed)
        hf = transformers.BertForSequenceClassification.from_pretrained(paths[name]).eval()
        task = bertfast.load(paths[name], backend="cpu")
        for i, adapter in enumerate(adapters, start=1):
            dirs[name, adapter] = _peft_adapter(hf, tmp_path_factory.mktemp(f"{name}-{adapter}"), seed=10 * seed + i)
            task.load_adapter(adapter, dirs[name, adapter])
        tok = unpadded(task.encoder.tokenizer, "right")
        inputs = INPUTS if name == "cls" else [(QUERY, t) for t in TEXTS]
        for adapter in (None, *adapters):
            rows = {False: [], True: []}
            for item in inputs:
                e = tok.encode(*((item,) if isinstance(item, str) else item))
                ids = torch.tensor([e.ids])
                logits = task(ids, torch.ones_like(ids), torch.tensor([e.type_ids]), adapter_ids=[adapter]).logits
                rows[False].append(task.scores(logits)[0].numpy())
                rows[True].append(logits.float()[0].numpy())
            for raw, got in rows.items():
                expected[name, adapter, raw] = np.stack(got)
        base, first, second = (expected[name, a, False] for a in (None, *adapters))
        assert not np.array_equal(base, first) and not np.array_equal(first, second)  # each adapter changes scores
    return paths, dirs, expected


@pytest.fixture(scope="module")
def root(served, tmp_path_factory) -> str:
    """The --adapter-root: `extra` (a copy of cls's `a`), `wide` (cls's `b`: 3 labels, not the reranker's 1)."""
    dirs = served[1]
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(dirs["cls", "a"], root / "extra")
    shutil.copytree(dirs["cls", "b"], root / "wide")
    return str(root)


@pytest.fixture(scope="module")
def server(served, root):
    paths, dirs, _ = served
    # A small token budget: requests are split across batches and merged with others. Gated: the engine can be held.
    yield from serving("--model", f"cls={paths['cls']}", "--model", f"rr={paths['rr']}",
                       "--adapter", f"a={dirs['cls', 'a']}", "--adapter", f"cls:b={dirs['cls', 'b']}",
                       "--adapter", f"rr:x={dirs['rr', 'x']}", "--adapter", f"rr:y={dirs['rr', 'y']}",
                       "--max-batch-tokens", "48", "--max-client-batch-size", "8", "--api-key", KEY,
                       "--adapter-root", root, gated=True)


def post(url: str, route: str, body) -> httpx.Response:
    return httpx.post(url + route, json=body, headers=AUTH, timeout=WAIT)




def request(model: str, adapter: str | None, pick, raw: bool = False) -> tuple[str, dict]:
    """(route, body): /predict of INPUTS[pick] on cls, /rerank of TEXTS[pick] on rr."""
    if model == "cls":
        inputs = [INPUTS[i] for i in pick]
        route, body = "/predict", {"inputs": [[t] if isinstance(t, str) else list(t) for t in inputs]}
    else:
        route, body = "/rerank", {"query": QUERY, "texts": [TEXTS[i] for i in pick]}
    body.update(model=model, raw_scores=raw)
    return route, body if adapter is None else {**body, "adapter": adapter}


def scores_of(model: str, r: httpx.Response) -> np.ndarray:
    """A /predict or /rerank answer as (inputs, labels) float32 scores, in input and label order."""
    got = ok(r)
    if model == "rr":
        return as_f32([[e["score"]] for e in sorted(got, key=lambda e: e["index"])])
    return as_f32([[{p["label"]: p["score"] for p in row}[label] for label in LABELS[model]] for row in got])


def test_models_list_task_adapters(server):
    listed = ok(httpx.get(server.url + "/v1/models", headers=AUTH, timeout=WAIT))
    assert [m["id"] for m in listed["data"]] == ["cls", "cls:a", "cls:b", "rr", "rr:x", "rr:y"]


def test_concurrent_mixed_adapters(server, served):
    """CLIENTS threads send REQUESTS_PER_CLIENT requests each to a random model (/predict on cls, /rerank on rr) with a
    random adapter of it or none, scores or logits: each answer is the TaskModel's on each input alone, bit for bit."""
    expected = served[2]

    def check(c, rng):
        model = ["cls", "rr"][int(rng.integers(2))]
        adapter = [None, *MODELS[model][1]][int(rng.integers(3))]
        count = len(INPUTS if model == "cls" else TEXTS)
        pick, raw = rng.choice(count, size=int(rng.integers(1, 6)), replace=True), bool(rng.integers(2))
        route, body = request(model, adapter, pick, raw)
        r = c.post(route, json=body)
        if r.status_code != 200 or not np.array_equal(scores_of(model, r), expected[model, adapter, raw][pick]):
            return model, adapter, raw, r.status_code, r.text[:200]
        return None

    failures = concurrent_clients(server.url, AUTH, CLIENTS, REQUESTS_PER_CLIENT, SECONDS, check)
    assert not failures, failures[:5]


def test_one_model_call_mixes_adapters(server, served):
    """The engine held behind a first request: one /predict per adapter and one of the base model queue, then run as
    one model call (one batch more than before for the four requests, 2 in all); each gets its own adapter's scores."""
    expected = served[2]
    rest = [(None, 5), ("a", 5), ("b", 1)]

    def post_one(c, item):
        route, body = request("cls", item[0], [item[1]])
        return c.post(route, json=body)

    answers = one_model_call(server, "cls", post_one, (None, 0), rest, AUTH)
    for r, (adapter, i) in zip(answers, rest):
        assert np.array_equal(scores_of("cls", r), expected["cls", adapter, False][[i]]), adapter


def test_unknown_adapter_is_404(server):
    """An adapter the model lacks (another model's included), on each task route and at POST /: 404 naming
    `adapter` and the model's adapters; nothing held."""
    for route, body, loaded in (("/predict", {"inputs": "hello", "adapter": "x"}, "a, b"),
                                ("/", {"inputs": "hello", "adapter": "nope"}, "a, b"),
                                ("/rerank", {"query": "q", "texts": ["a"], "model": "rr", "adapter": "a"}, "x, y")):
        r = post(server.url, route, body)
        assert r.status_code == 404, r.text
        error = r.json()
        assert (error["error_type"], error["field"]) == ("adapter_not_found", "adapter") and loaded in error["error"]
    assert metric(server.url, "bertfast_requests_in_flight", AUTH) == 0


def test_admin_load_request_unload(server, served):
    """POST /admin/adapters loads `extra` (cls's `a` copied under the root) onto cls: listed, and /predict with it gives
    `a`'s scores; DELETE unloads it: a 404 again. `wide` (3 labels) onto the reranker: 422 naming `path` and the
    num_labels, nothing loaded."""
    expected, url = served[2], server.url
    assert ok(post(url, "/admin/adapters", {"name": "extra", "path": "extra", "model": "cls"}))["adapters"] == [
        "a", "b", "extra"]
    route, body = request("cls", "extra", range(len(INPUTS)))
    assert np.array_equal(scores_of("cls", post(url, route, body)), expected["cls", "a", False])
    r = httpx.delete(url + "/admin/adapters/extra", params={"model": "cls"}, headers=AUTH, timeout=WAIT)
    assert ok(r) == {"model": "cls", "adapters": ["a", "b"]}
    r = post(url, route, body)
    assert r.status_code == 404 and r.json()["error_type"] == "adapter_not_found", r.text
    r = post(url, "/admin/adapters", {"name": "wide", "path": "wide", "model": "rr"})
    assert r.status_code == 422 and r.json()["field"] == "path" and "num_labels" in r.json()["error"], r.text
    names = [m["id"] for m in ok(httpx.get(url + "/v1/models", headers=AUTH, timeout=WAIT))["data"]]
    assert names == ["cls", "cls:a", "cls:b", "rr", "rr:x", "rr:y"]
