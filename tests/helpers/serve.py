"""`bertfast serve` in a child process on a free loopback port, the client threads the serve tests run against it,
and what the task routes' tests compare with (transformers' logits on the same directory). Every wait is bounded; the
caller stops the server in `finally`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="the serve tests' HTTP client, httpx, is in the test extra")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
TEXTS = ["hello world", "A man is eating food.", "x", "The quick brown fox jumps over the lazy dog " * 3,
         "Ünïcödé テキスト and emoji 🙂", "a much longer sentence about cats, dogs and other animals that live in houses",
         "short", "Paris is the capital of France."]
TOL = 1e-5  # /predict and /rerank scores against transformers' fp32 logits
LIMIT = 64  # max_position_embeddings of the task checkpoints: the served input limit


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m bertfast serve ...` in a child process; `url` once /health answers 200 (60 s at most).
    Its output goes to a pipe read at `stop()`, or to the file `log` (many requests: a pipe nobody
    reads fills up with access lines and blocks the server)."""

    def __init__(self, *args, log: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = subprocess.PIPE if log is None else open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "bertfast", "serve", "--port", str(self.port),
                                      "--backend", "cpu", *args], env=env, cwd=ROOT,
                                     stdout=out, stderr=subprocess.STDOUT, text=True)
        if log is not None:
            out.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.stop()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not become healthy within 60 s")

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        out, _ = self.proc.communicate(timeout=30)
        if self.log is not None:
            with open(self.log) as f:
                return f.read()
        return out


def start_threads(target, args) -> list[threading.Thread]:
    """One started thread per argument, running target(arg)."""
    threads = [threading.Thread(target=target, args=(a,)) for a in args]
    for t in threads:
        t.start()
    return threads


def join(threads, timeout: float = 120) -> None:
    """Join every thread within `timeout` seconds in all; fail if one still runs (a hung client)."""
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a client thread hung"


def as_f32(vectors) -> np.ndarray:
    """JSON floats as float32 (through float64: the values the server wrote)."""
    return np.asarray(vectors, dtype=np.float64).astype(np.float32)


def post(server, route, body) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def ok(r: httpx.Response):
    assert r.status_code == 200, r.text
    return r.json()


class Reference:
    """transformers' sequence classifier (its Auto class: any family) and tokenizer on the same directory: fp32
    logits of texts and pairs, each truncated to `limit` tokens as the server truncates it."""

    def __init__(self, path, limit: int):
        import transformers

        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.limit = limit

    def logits(self, inputs, side: str = "right"):
        import torch

        self.tok.truncation_side = side
        rows = []
        for item in inputs:  # one at a time: no padding in the reference either
            a, b = (item, None) if isinstance(item, str) else item
            enc = self.tok(a, b, truncation=True, max_length=self.limit, return_tensors="pt")
            with torch.no_grad():
                rows.append(self.model(**enc).logits[0])
        return torch.stack(rows)


def check_predictions(got, expect, labels) -> None:
    """One input's predictions: every label once, sorted by score descending, scores within TOL of `expect`
    (a tensor of the labels' scores, in `labels`' order)."""
    import torch

    assert [p["score"] for p in got] == sorted((p["score"] for p in got), reverse=True)
    assert sorted(p["label"] for p in got) == sorted(labels)
    by_label = {p["label"]: p["score"] for p in got}
    ours = torch.tensor([by_label[label] for label in labels], dtype=torch.float64)
    assert (ours - expect.double()).abs().max() <= TOL, (ours, expect)


def checkpoint(path, minilm_path, num_labels: int, seed: int, **config) -> str:
    """A random 2-layer BertForSequenceClassification (hidden 64, LIMIT positions) with the default
    model's tokenizer. LayerNorms and biases are perturbed and the classifier scaled so scores spread."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=96, max_position_embeddings=LIMIT, num_labels=num_labels,
                                  id2label={i: f"label-{i}" for i in range(num_labels)}, **config)
    model = transformers.BertForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        model.bert.pooler.dense.weight.mul_(20)
        model.classifier.weight.mul_(5)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(minilm_path, name), path)
    return str(path)
