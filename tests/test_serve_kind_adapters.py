"""`bertfast serve --adapter` on the models beyond one dense vector: a SPLADE model (its adapter's LoRA reaching the MLM
head's transform), a PyLate ColBERT and a BGE-M3 model, each with a PEFT LoRA adapter given at start, over real HTTP
on 127.0.0.1. Concurrent clients send /embed_sparse, /embed_multi and BGE-M3's /embed with the adapter or none: every
answer equals the model's `encode(texts, adapter=...)` bit for bit (cpu backend). The admin route loads and unloads an
adapter on the SPLADE and ColBERT models at run time; an unknown adapter is a 404 naming `adapter`. Every loop is
bounded in count and time; the server is killed in `finally`.
"""

from __future__ import annotations

import os
import shutil
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download; set before the hub libraries load

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="bertfast serve needs the serve extra (fastapi): pip install 'bertfast[serve]'")
pytest.importorskip("uvicorn", reason="bertfast serve needs the serve extra (uvicorn): pip install 'bertfast[serve]'")
pytest.importorskip("prometheus_client", reason="bertfast serve needs the serve extra (prometheus-client)")
pytest.importorskip("peft", reason="the adapters are saved by PEFT (the test extra)")
httpx = pytest.importorskip("httpx", reason="the serve tests' HTTP client, httpx, is in the test extra")
transformers = pytest.importorskip("transformers")

import bertfast  # noqa: E402
from bertfast.tools.serve.routes_tei import sparse_entries  # noqa: E402
from helpers.adapters import save_lora  # noqa: E402
from helpers.bgem3 import save_bgem3  # noqa: E402
from helpers.colbert import write_colbert  # noqa: E402
from helpers.serve import TEXTS, WAIT, as_f32, concurrent_clients, ok, serving  # noqa: E402
from helpers.splade import save_splade  # noqa: E402

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CLIENTS, REQUESTS_PER_CLIENT, SECONDS = 6, 5, 90  # the concurrent test's count and time bounds
M3_LIMIT = 128  # the BGE-M3 checkpoint's 130 positions less XLM-R's offset
TARGETS = ["query", "key", "value", "dense"]  # SPLADE's "dense" reaches cls.predictions.transform.dense too
ROUTES = [("sp", "/embed_sparse", None), ("colbert", "/embed_multi", True), ("colbert", "/embed_multi", False),
          ("m3", "/embed_multi", None), ("m3", "/embed", None), ("m3", "/embed_sparse", None)]


def _lora(model_dir, out, auto, seed: int) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_lora(auto.from_pretrained(model_dir).eval(), out, seed=seed, r=4, lora_alpha=8, target_modules=TARGETS)
    return str(out)


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_path):
    """{model name: (directory, adapter directory, the bertfast model with the adapter loaded as "a")}."""
    tmp = tmp_path_factory.mktemp("kinds")
    sp = save_splade(tmp / "sp", minilm_path, seed=6)
    colbert = write_colbert(tmp / "colbert", minilm_path, seed=7)
    m3 = save_bgem3(tmp / "m3", seed=8)
    out = {}
    for name, path, auto, cls in (("sp", sp, transformers.AutoModelForMaskedLM, bertfast.SparseEncoder),
                                  ("colbert", colbert, transformers.AutoModel, bertfast.ColBERT),
                                  ("m3", m3, transformers.AutoModel, bertfast.BGEM3)):
        lora = _lora(path, tmp / f"lora-{name}", auto, seed=len(out) + 11)
        model = cls.from_pretrained(path, backend="cpu")
        (model if name == "sp" else model.encoder).load_adapter("a", lora)
        out[name] = (str(path), lora, model)
    assert out["sp"][2]._vocab_heads  # the SPLADE adapter runs its own head
    return out


@pytest.fixture(scope="module")
def root(models, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("root")
    for name in ("sp", "colbert"):
        shutil.copytree(models[name][1], root / name)
    return str(root)


@pytest.fixture(scope="module")
def server(models, root):
    args = [a for name, (path, lora, _) in models.items() for a in ("--model", f"{name}={path}", "--adapter",
                                                                      f"{name}:a={lora}")]
    yield from serving(*args, "--max-client-batch-size", "8", "--max-batch-tokens", "96", "--api-key", KEY,
                       "--adapter-root", root)


def expected(models, name: str, route: str, is_query, texts: list[str], adapter: str | None):
    """What `encode(texts, adapter=adapter)` gives, in the route's JSON shape decoded (float32 arrays, sparse
    entries)."""
    model = models[name][2]
    if name == "sp":
        return [sparse_entries(v) for v in model.encode(texts, adapter=adapter, convert_to_sparse_tensor=False).numpy()]
    if name == "colbert":
        return model.encode(texts, is_query=is_query, adapter=adapter)
    out = model.encode(texts, max_length=M3_LIMIT, return_colbert_vecs=route == "/embed_multi", adapter=adapter)
    if route == "/embed_sparse":
        return [sparse_entries(w) for w in out["lexical_weights"]]
    return out["dense_vecs"] if route == "/embed" else out["colbert_vecs"]


def same(route: str, got, want) -> bool:
    if route == "/embed_sparse":
        return got == want
    return len(got) == len(want) and all(np.array_equal(as_f32(g), w) for g, w in zip(got, want))


def body(name: str, is_query, texts: list[str], adapter: str | None) -> dict:
    b = {"model": name, "inputs": texts, **({} if adapter is None else {"adapter": adapter})}
    return b if is_query is None else {**b, "is_query": is_query}


def test_adapters_differ(models):
    texts = TEXTS[:3]
    for name, route, is_query in ROUTES:
        if route != "/embed_sparse" or name == "sp":
            assert not same(route, expected(models, name, route, is_query, texts, None),
                            expected(models, name, route, is_query, texts, "a")), (name, route)


def test_concurrent_mixed_adapters(server, models):
    """Each client sends random texts to a random model and route, with the adapter or none: every answer is that
    model's `encode(adapter=)` bit for bit, whatever it was batched with."""
    want = {(i, a): expected(models, *ROUTES[i], TEXTS, a) for i in range(len(ROUTES)) for a in (None, "a")}

    def check(c, rng):
        i, adapter = int(rng.integers(len(ROUTES))), [None, "a"][int(rng.integers(2))]
        name, route, is_query = ROUTES[i]
        pick = rng.choice(len(TEXTS), size=int(rng.integers(1, 5)), replace=True)
        r = c.post(route, json=body(name, is_query, [TEXTS[j] for j in pick], adapter))
        if r.status_code != 200 or not same(route, r.json(), [want[i, adapter][j] for j in pick]):
            return name, route, adapter, r.status_code, r.text[:300]
        return None

    assert concurrent_clients(server.url, AUTH, CLIENTS, REQUESTS_PER_CLIENT, SECONDS, check) == []


@pytest.mark.parametrize("name,route,is_query", [("sp", "/embed_sparse", None), ("colbert", "/embed_multi", True)],
                         ids=["splade", "colbert"])
def test_admin_load_and_unload(server, models, name, route, is_query):
    """An adapter loaded at run time from under --adapter-root answers as the one given at start; unloaded, a 404."""
    url, texts = server.url, TEXTS[:4]
    r = httpx.post(url + "/admin/adapters", json={"name": "extra", "path": name, "model": name}, headers=AUTH,
                   timeout=WAIT)
    assert ok(r) == {"model": name, "adapters": ["a", "extra"]}
    got = ok(httpx.post(url + route, json=body(name, is_query, texts, "extra"), headers=AUTH, timeout=WAIT))
    assert same(route, got, expected(models, name, route, is_query, texts, "a"))
    r = httpx.delete(url + "/admin/adapters/extra", params={"model": name}, headers=AUTH, timeout=WAIT)
    assert ok(r) == {"model": name, "adapters": ["a"]}
    r = httpx.post(url + route, json=body(name, is_query, texts, "extra"), headers=AUTH, timeout=WAIT)
    assert r.status_code == 404 and r.json()["error_type"] == "adapter_not_found", r.text
    assert r.json()["field"] == "adapter"


def test_models_list_adapters(server):
    names = [m["id"] for m in ok(httpx.get(server.url + "/v1/models", headers=AUTH, timeout=WAIT))["data"]]
    assert names == ["sp", "sp:a", "colbert", "colbert:a", "m3", "m3:a"]
