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

    python benchmarks/bench_serve.py [--concurrency 1,8,32,128] [--seconds 10] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

import bertfast
from bertfast.tools.bench.measure import quantile
from bertfast.tools.validate.sentences import sentences


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


def launch(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "bertfast", "serve", "--port", str(port), "--backend", args.backend,
           "--log-level", "warning", "--max-concurrent-requests", str(args.max_concurrent_requests)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)  # the access log would cost a write per request
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start within 60 s")


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


def closed_loop(url: str, texts: list[str], expect: np.ndarray, concurrency: int, seconds: float) -> dict:
    latencies, errors, lock = [], [0], threading.Lock()
    port = int(url.rsplit(":", 1)[1])
    requests = [Connection.request("/embed", {"inputs": t}) for t in texts]
    stop = time.perf_counter() + seconds

    def client(k):
        mine, bad, conn = [], 0, Connection(port)
        i = k
        while time.perf_counter() < stop:
            t = time.perf_counter()
            status, body = conn.post(requests[i % len(texts)])
            mine.append(time.perf_counter() - t)
            if i < len(texts):  # each sentence's first answer is checked (parsing costs client CPU)
                bad += status != 200 or not np.array_equal(
                    np.asarray(json.loads(body), dtype=np.float64).astype(np.float32), expect[i:i + 1])
            else:
                bad += status != 200
            i += concurrency
        conn.sock.close()
        with lock:
            latencies.extend(mine)
            errors[0] += bad

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    n = len(latencies)
    return {"concurrency": concurrency, "requests_per_s": n / wall,
            "p50_ms": quantile(latencies, 0.5) * 1e3, "p90_ms": quantile(latencies, 0.9) * 1e3,
            "p99_ms": quantile(latencies, 0.99) * 1e3, "errors": errors[0], "requests": n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-concurrent-requests", type=int, default=512)
    args = p.parse_args()
    texts = sentences()
    enc = bertfast.Encoder.from_pretrained(bertfast.default_model_path(), backend=args.backend, dtype=args.dtype)
    tokens_per_text = float(np.mean([len(enc.tokenizer.encode(t).ids) for t in texts]))
    print(f"cpu: {bertfast.cpu_info()}")
    print(f"model: all-MiniLM-L6-v2, {enc.backend}, {enc.dtype}; {len(texts)} sentences, "
          f"{tokens_per_text:.1f} tokens each on average; {os.cpu_count()} CPUs")
    base = in_process(enc, texts, args.seconds)
    print(f"in-process encode: {base['sentences_per_s']:.0f} sentences/s (batches of 32), "
          f"one-sentence call p50 {base['single_p50_ms']:.2f} ms")
    proc, url = launch(args)
    try:
        got = np.asarray(httpx.post(url + "/embed", json={"inputs": texts[:32]}, timeout=60).json(),
                         dtype=np.float64).astype(np.float32)
        if not np.array_equal(got, enc.encode(texts[:32]).numpy()):
            raise SystemExit("the server's vectors differ from encode's: not timing a wrong server")
        print("server vectors == encode (bitwise) on 32 sentences")
        expect = enc.encode(texts).numpy()
        rows = []
        print(f"{'conc':>5} {'req/s':>8} {'sent/s':>8} {'tok/s':>9} {'vs encode':>9} {'p50 ms':>8} {'p90 ms':>8} "
              f"{'p99 ms':>8} {'errors':>6}")
        for c in (int(x) for x in args.concurrency.split(",")):
            r = closed_loop(url, texts, expect, c, args.seconds)
            rows.append(r)
            rps = r["requests_per_s"]
            print(f"{c:>5} {rps:>8.1f} {rps:>8.1f} {rps * tokens_per_text:>9.0f} "
                  f"{rps / base['sentences_per_s']:>8.0%} {r['p50_ms']:>8.2f} {r['p90_ms']:>8.2f} "
                  f"{r['p99_ms']:>8.2f} {r['errors']:>6}")
        for r in rows:
            print(f"concurrency {r['concurrency']}: server/in-process throughput "
                  f"{r['requests_per_s'] / base['sentences_per_s']:.0%} ({r['requests_per_s']:.0f} vs "
                  f"{base['sentences_per_s']:.0f} sentences/s), {r['errors']} errors")
            if r["concurrency"] == 1:
                print(f"concurrency 1: p50 latency {r['p50_ms']:.2f} ms vs in-process {base['single_p50_ms']:.2f} ms "
                      f"({r['p50_ms'] - base['single_p50_ms']:+.2f} ms)")
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
