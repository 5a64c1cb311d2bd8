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
WAIT = 120  # seconds for any one wait on the server: generous for a loaded 2-core machine, still bounded


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m bertfast serve ...` in a child process; `url` once uvicorn says it is running (WAIT s at most).
    A thread reads its output as it comes (`wait_for`, `stop`), copied to the file `log` if given, so no pipe fills.

    gated: the engine thread can be held before each batch (`hold`, `release`): requests are admitted and queued,
    none is answered until the release. The gate is open at start."""

    def __init__(self, *args, log: str | None = None, gated: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.lines: list[str] = []
        self._read = threading.Condition()
        self._ended = False
        path = [ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH")]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
        command, fds, self._gate = [sys.executable, "-m", "bertfast"], (), None
        if gated:
            self._gate, theirs = socket.socketpair()
            self._gate.settimeout(WAIT)
            fds = (theirs.fileno(),)
            command = [sys.executable, "-c", f"from helpers.serve import serve_gated; serve_gated({fds[0]})"]
        self.proc = subprocess.Popen([*command, "serve", "--port", str(self.port), "--backend", "cpu", *args],
                                     env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     pass_fds=fds)
        if gated:
            theirs.close()
        self._reader = threading.Thread(target=self._read_output, name="server-output", daemon=True)
        self._reader.start()
        try:
            self.wait_for("Uvicorn running on")  # logged once every model is loaded and the port is bound
        except BaseException:
            self.stop()
            raise

    def _read_output(self) -> None:
        sink = open(self.log, "w") if self.log is not None else None
        for line in self.proc.stdout:
            if sink is not None:
                sink.write(line)
            with self._read:
                self.lines.append(line)
                self._read.notify_all()
        if sink is not None:
            sink.close()
        with self._read:
            self._ended = True
            self._read.notify_all()

    def wait_for(self, text: str, timeout: float = WAIT) -> None:
        """Until a line of the server's output holds `text`; fails if the output ends first or after `timeout` s."""
        seen = 0

        def found():
            nonlocal seen
            hit = any(text in line for line in self.lines[seen:])
            seen = len(self.lines)
            return hit or self._ended

        with self._read:
            if not self._read.wait_for(found, timeout) or not any(text in line for line in self.lines):
                pytest.fail(f"no {text!r} in the server's output within {timeout} s:\n{''.join(self.lines)[-4000:]}")

    def hold(self) -> None:
        """Close the gate: from now on the engine thread waits before each batch (a gated Server)."""
        self._command(b"h")

    def release(self) -> None:
        """Open the gate: the held batch and every later one run."""
        self._command(b"r")

    def _command(self, command: bytes) -> None:
        self._gate.sendall(command)
        assert self._gate.recv(1) == command, "the server did not acknowledge the gate command"  # WAIT s at most

    def stop(self) -> str:
        """Kill the server if it still runs; its whole output."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._reader.join(30)
        if self._gate is not None:
            self._gate.close()
        return "".join(self.lines)


def serve_gated(fd: int) -> None:
    """The child of a gated Server: `bertfast serve` (this process's arguments) whose engine thread waits, before each
    batch, while the gate is closed. On the socket `fd`: b"h" closes it, b"r" opens it, each echoed once done (so the
    test knows); the socket's end opens it for good."""
    from bertfast.tools.cli import main
    from bertfast.tools.serve import batcher

    sock, gate = socket.socket(fileno=fd), threading.Event()
    gate.set()

    def commands():
        while command := sock.recv(1):
            (gate.clear if command == b"h" else gate.set)()
            sock.sendall(command)
        gate.set()

    threading.Thread(target=commands, name="test-gate", daemon=True).start()
    batcher._test_hook = gate.wait
    sys.exit(main(sys.argv[1:]))


def serving(*args, **kwargs):
    """A `Server(*args, **kwargs)` for a fixture (`yield from serving(...)`): yields it, stops it, then fails if the
    app logged an exception."""
    srv = Server(*args, **kwargs)
    try:
        yield srv
    finally:
        log = srv.stop()
    assert "Exception in ASGI application" not in log, log[-3000:]


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


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """The server's /metrics value of `name` (a series with its labels, as written there)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=WAIT).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def until(url: str, name: str, value: float, headers: dict | None = None) -> None:
    """Until the metric `name` reads `value`; fails after WAIT s."""
    deadline = time.monotonic() + WAIT
    while metric(url, name, headers) != value:
        assert time.monotonic() < deadline, f"{name} is {metric(url, name, headers)}, not {value}, after {WAIT} s"
        time.sleep(0.01)


def queue_behind(server, send, first, rest, headers: dict | None = None) -> list[threading.Thread]:
    """The engine held (`server.hold`) on `first`'s row, then each of `rest` sent and queued (one row each), then
    released: what a test needs to see queued requests run as one model call. send(item) sends one; returns the
    started threads."""
    server.hold()
    try:
        threads = start_threads(send, [first])
        until(server.url, "bertfast_requests_in_flight", 1, headers)
        until(server.url, "bertfast_queue_depth", 0, headers)  # the first row is taken: the engine waits at the gate
        threads += start_threads(send, rest)
        until(server.url, "bertfast_queue_depth", len(rest), headers)
    finally:
        server.release()
    return threads


def one_model_call(server, model: str, post, first, rest, headers: dict) -> list:
    """`queue_behind` for one-row requests post(client, item) -> response: the responses to `rest`, in its order,
    once the queued requests ran as one model call (checked: the served `model`'s batches rose by 2 in all)."""
    name = f'bertfast_batch_rows_count{{model="{model}"}}'
    batches, answers = metric(server.url, name, headers), {}

    def send(item):
        with httpx.Client(base_url=server.url, headers=headers, timeout=WAIT) as c:
            answers[id(item)] = post(c, item)

    join(queue_behind(server, send, first, rest, headers), timeout=WAIT)
    assert metric(server.url, name, headers) == batches + 2
    return [answers[id(item)] for item in rest]


def concurrent_clients(url: str, headers: dict, clients: int, requests: int, seconds: float, check) -> list:
    """`clients` threads, each with its own HTTP client and a generator seeded by its number, each calling
    check(client, rng) up to `requests` times or until `seconds` have passed; returns what the calls returned other
    than None (the failures)."""
    failures, lock, stop = [], threading.Lock(), time.monotonic() + seconds

    def client(seed):
        rng = np.random.default_rng(seed)
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            for _ in range(requests):
                if time.monotonic() > stop:
                    break
                failure = check(c, rng)
                if failure is not None:
                    with lock:
                        failures.append(failure)

    join(start_threads(client, range(clients)), timeout=seconds + WAIT)
    return failures


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
