"""`bertfast serve` under closed-loop load, next to in-process `Encoder.encode` in the same run.

First the in-process baseline on the same sentences and dtype (throughput over batches of 32, and
the latency of a one-sentence call), then the server in a child process: its vectors are checked
against encode bit for bit before any timing, then C client threads (one keep-alive connection each)
send one sentence per request back to back for --seconds at each concurrency. Prints requests/s,
sentences/s, tokens/s, p50/p90/p99 latency and errors, then one line per concurrency with the ratio
server/in-process and the p50 difference at concurrency 1. The clients are raw HTTP/1.1 on a socket
(requests built once, responses read by Content-Length; the first of each kind is checked against
encode): an httpx request costs the client a few hundred microseconds of CPU, which on a 2-core host
is taken from the server. They still share the machine with it, so the ratios are a floor.

With --peer infinity=PATH (the `infinity_emb` that benchmarks/peer_infinity.sh installs in a venv of
its own), Infinity then serves the same checkpoint, fp32 on the CPU, once bertfast has stopped, under
the same load. Both are measured on their OpenAI-style routes (bertfast's /v1/embeddings, Infinity's
/embeddings: same request and response shapes); the peer's vectors must be within --peer-atol of
encode's before it is timed. One table per server, then the bertfast/peer ratio per concurrency.

    python benchmarks/bench_serve.py [--concurrency 1,8,32,128] [--seconds 10] [--dtype float32]
    python benchmarks/bench_serve.py --concurrency 1,32 --peer infinity=/path/to/venv/bin/infinity_emb
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

import httpx
import numpy as np

import bertfast
from bertfast.tools.bench.measure import quantile
from bertfast.tools.validate.sentences import sentences

MODEL_NAME = "all-MiniLM-L6-v2"  # the name sent in (and served under) the OpenAI-style routes
READY_S = 120.0  # Infinity warms up on a batch of 256-token texts before it answers /health
# The peer runs offline and sends nothing anywhere: no Hub look-ups, no anonymous usage stats.
PEER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
            "INFINITY_ANONYMOUS_USAGE_STATS": "0"}


def parse_tei(body: bytes) -> np.ndarray:
    """TEI /embed: a JSON list of vectors (float64 text of float32 values)."""
    return np.asarray(json.loads(body), dtype=np.float64).astype(np.float32)


def parse_openai(body: bytes) -> np.ndarray:
    """OpenAI embeddings: {"data": [{"embedding": [...], "index": i}, ...]}, rows put back in index order."""
    rows = sorted(json.loads(body)["data"], key=lambda d: d["index"])
    return np.asarray([d["embedding"] for d in rows], dtype=np.float64).astype(np.float32)


@dataclass
class Route:
    path: str
    body: Callable[[str | list[str]], dict]  # one text (or a list, for validation) -> the request's JSON
    parse: Callable[[bytes], np.ndarray]  # response body -> (n, dim) float32


TEI = Route("/embed", lambda t: {"inputs": t}, parse_tei)


def openai(path: str) -> Route:
    return Route(path, lambda t: {"input": t, "model": MODEL_NAME}, parse_openai)


def max_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max()) if got.shape == want.shape else float("inf")


def in_process(enc, texts, seconds: float) -> dict:
    """encode's sentences/s over batches of 32, and the median latency of one-sentence calls."""
    enc.encode(texts[:32])
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        enc.encode(texts)
        done += len(texts)
    rate = done / (time.perf_counter() - start)
    single = []
    for i in range(200):
        t = time.perf_counter()
        enc.encode([texts[i % len(texts)]])
        single.append(time.perf_counter() - t)
    return {"sentences_per_s": rate, "single_p50_ms": quantile(single, 0.5) * 1e3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bertfast_cmd(args, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "bertfast", "serve", "--port", str(port), "--backend", args.backend,
           "--log-level", "warning", "--max-concurrent-requests", str(args.max_concurrent_requests),
           "--model-id", MODEL_NAME]
    return cmd + ["--dtype", args.dtype] if args.dtype else cmd


def infinity_cmd(exe: str, port: int) -> list[str]:
    # fp32 torch on the CPU, loopback only; no vector cache (the load repeats sentences, a cache would
    # answer them without running the model); warning level turns uvicorn's per-request access line off.
    return [exe, "v2", "--model-id", bertfast.default_model_path(), "--served-model-name", MODEL_NAME,
            "--engine", "torch", "--device", "cpu", "--dtype", "float32", "--batch-size", "32",
            "--no-vector-disk-cache", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


def start(name: str, cmd: list[str], port: int, log, env=None) -> subprocess.Popen:
    """Run cmd and wait (at most READY_S) until it answers GET /health with 200; the caller stops it."""
    # a session of its own: stop() signals the whole group, so nothing the server spawned outlives the bench
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{name} exited with status {proc.returncode} before it was ready{log_tail(log)}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return proc
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"{name} did not answer /health within {READY_S:.0f} s{log_tail(log)}")
    except BaseException:  # not ready, or interrupted while waiting: the server must not outlive the bench
        stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the whole group has exited already
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            pass


def log_tail(log) -> str:
    if log is subprocess.DEVNULL:
        return ""
    log.flush()
    log.seek(0)
    return ":\n" + log.read().decode(errors="replace")[-3000:]


class Connection:
    """One keep-alive HTTP/1.1 connection: post(request bytes) -> (status, body)."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    @staticmethod
    def request(path: str, obj) -> bytes:
        body = json.dumps(obj).encode()
        return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode() + body

    def post(self, request: bytes) -> tuple[int, bytes]:
        self.sock.sendall(request)
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.recv()
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(int(v) for k, _, v in (line.partition(b":") for line in lines[1:])
                      if k.strip().lower() == b"content-length")
        while len(rest) < length:
            rest += self.recv()
        self.buf = rest[length:]
        return int(lines[0].split()[1]), rest[:length]

    def recv(self) -> bytes:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        return data


def closed_loop(port: int, route: Route, texts: list[str], expect: np.ndarray, atol: float, concurrency: int,
                seconds: float) -> dict:
    latencies, errors, lock = [], [0], threading.Lock()
    requests = [Connection.request(route.path, route.body(t)) for t in texts]
    stop_at = time.perf_counter() + seconds

    def client(k):
        mine, bad, conn = [], 0, Connection(port)
        i = k
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            status, body = conn.post(requests[i % len(texts)])
            mine.append(time.perf_counter() - t)
            if i < len(texts):  # each sentence's first answer is checked (parsing costs client CPU)
                bad += status != 200 or not max_diff(route.parse(body), expect[i:i + 1]) <= atol
            else:
                bad += status != 200
            i += concurrency
        conn.sock.close()
        with lock:
            latencies.extend(mine)
            errors[0] += bad

    start_at = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start_at
    n = len(latencies)
    return {"concurrency": concurrency, "requests_per_s": n / wall,
            "p50_ms": quantile(latencies, 0.5) * 1e3, "p90_ms": quantile(latencies, 0.9) * 1e3,
            "p99_ms": quantile(latencies, 0.99) * 1e3, "errors": errors[0], "requests": n}


def measure(name: str, cmd: list[str], port: int, route: Route, atol: float, enc, texts, base: dict,
            tokens_per_text: float, args, log=subprocess.DEVNULL, env=None) -> list[dict]:
    """Start one server, check its vectors against encode (max abs diff <= atol; 0 = bit for bit), then
    time the closed loop at each concurrency and print its table. The server is stopped on the way out."""
    proc = start(name, cmd, port, log, env)
    try:
        got = route.parse(httpx.post(f"http://127.0.0.1:{port}{route.path}", json=route.body(texts[:32]),
                                     timeout=60).content)
        diff = max_diff(got, enc.encode(texts[:32]).numpy())
        if not diff <= atol:
            raise SystemExit(f"{name}'s {route.path} vectors differ from encode's (max abs diff {diff:.3g}, "
                             f"allowed {atol:g}): not timing a wrong server")
        same = "== encode (bitwise)" if atol == 0 else f"vs encode: max abs diff {diff:.2g} (allowed {atol:g})"
        print(f"{name} {route.path} vectors {same} on 32 sentences")
        expect = enc.encode(texts).numpy()
        rows = []
        print(f"{'conc':>5} {'req/s':>8} {'sent/s':>8} {'tok/s':>9} {'vs encode':>9} {'p50 ms':>8} {'p90 ms':>8} "
              f"{'p99 ms':>8} {'errors':>6}")
        for c in (int(x) for x in args.concurrency.split(",")):
            r = closed_loop(port, route, texts, expect, atol, c, args.seconds)
            rows.append(r)
            rps = r["requests_per_s"]
            print(f"{c:>5} {rps:>8.1f} {rps:>8.1f} {rps * tokens_per_text:>9.0f} "
                  f"{rps / base['sentences_per_s']:>8.0%} {r['p50_ms']:>8.2f} {r['p90_ms']:>8.2f} "
                  f"{r['p99_ms']:>8.2f} {r['errors']:>6}")
        return rows
    finally:
        stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-concurrent-requests", type=int, default=512)
    p.add_argument("--peer", default=None, metavar="infinity=PATH",
                   help="also load Infinity, PATH its infinity_emb executable (benchmarks/peer_infinity.sh)")
    p.add_argument("--peer-atol", type=float, default=1e-4, help="allowed max abs diff of the peer's vectors vs encode")
    args = p.parse_args()
    kind, _, peer = (args.peer or "").partition("=")
    if args.peer:
        if kind != "infinity" or not peer:
            p.error(f"--peer takes infinity=PATH (the only peer so far), got {args.peer!r}")
        if not (os.path.isfile(peer) and os.access(peer, os.X_OK)):
            p.error(f"--peer: {peer} is not an executable file (bash benchmarks/peer_infinity.sh installs one)")
        if args.dtype not in (None, "float32", "fp32"):
            p.error("--peer compares fp32 servers (Infinity runs --dtype float32): leave --dtype out")
    texts = sentences()
    enc = bertfast.Encoder.from_pretrained(bertfast.default_model_path(), backend=args.backend, dtype=args.dtype)
    tokens_per_text = float(np.mean([len(enc.tokenizer.encode(t).ids) for t in texts]))
    print(f"cpu: {bertfast.cpu_info()}")
    print(f"model: all-MiniLM-L6-v2, {enc.backend}, {enc.dtype}; {len(texts)} sentences, "
          f"{tokens_per_text:.1f} tokens each on average; {os.cpu_count()} CPUs")
    base = in_process(enc, texts, args.seconds)
    print(f"in-process encode: {base['sentences_per_s']:.0f} sentences/s (batches of 32), "
          f"one-sentence call p50 {base['single_p50_ms']:.2f} ms")
    # With a peer, bertfast answers on its OpenAI route too: the same request and response shapes as the peer's.
    route = openai("/v1/embeddings") if peer else TEI
    port = free_port()
    # bertfast's output goes to /dev/null (measure's default): its access log would cost a write per request
    rows = measure("bertfast", bertfast_cmd(args, port), port, route, 0.0, enc, texts, base, tokens_per_text, args)
    for r in rows:
        print(f"concurrency {r['concurrency']}: server/in-process throughput "
              f"{r['requests_per_s'] / base['sentences_per_s']:.0%} ({r['requests_per_s']:.0f} vs "
              f"{base['sentences_per_s']:.0f} sentences/s), {r['errors']} errors")
        if r["concurrency"] == 1:
            print(f"concurrency 1: p50 latency {r['p50_ms']:.2f} ms vs in-process {base['single_p50_ms']:.2f} ms "
                  f"({r['p50_ms'] - base['single_p50_ms']:+.2f} ms)")
    if peer:
        port = free_port()
        with tempfile.TemporaryFile() as log:  # Infinity's console, shown if it fails to start
            peer_rows = measure("infinity", infinity_cmd(peer, port), port, openai("/embeddings"), args.peer_atol,
                                enc, texts, base, tokens_per_text, args, log, os.environ | PEER_ENV)
        for r, q in zip(rows, peer_rows):
            print(f"concurrency {r['concurrency']}: bertfast {r['requests_per_s']:.0f} req/s vs infinity "
                  f"{q['requests_per_s']:.0f} req/s = {r['requests_per_s'] / q['requests_per_s']:.2f}x "
                  f"({r['errors']} / {q['errors']} errors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
