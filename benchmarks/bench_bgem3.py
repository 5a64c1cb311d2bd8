"""Texts/s of BGE-M3's three outputs (dense, lexical weights, ColBERT vectors), end to end (tokenization included):
FlagEmbedding's `BGEM3FlagModel.encode` (torch, fp32) against `bertfast.BGEM3.encode` (cpu backend, fp32 unless
--dtypes says more), each engine in a spawned process of its own (libraries sharing a process slow each other's
thread pools: docs/bench-method.md#isolation), on a BGE-M3 directory (--model) or, by default, a random small one
saved in FlagEmbedding's layout by the tests' builder (XLM-R, hidden 256, 4 layers; `tests/helpers/bgem3.py`).

    python benchmarks/bench_bgem3.py [--texts 256] [--hidden 256] [--layers 4] [--rounds 3] [--dtypes fp32,bf16]
    python benchmarks/bench_bgem3.py --model /path/to/bge-m3 --max-length 512

Every bertfast row is checked against FlagEmbedding's outputs before it is timed (fp32: each output within 1e-5 of
its largest value, by `bertfast.accuracy.rel_error`, and the same lexical keys; bf16/int8: the errors are printed);
a failed fp32 check stops the run. Rows are timed interleaved (`bertfast.tools.bench.measure.interleaved`, one call
per worker per round after a 100 ms pause and an untimed call): medians and the ratio to FlagEmbedding.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

OUTPUTS = dict(return_dense=True, return_sparse=True, return_colbert_vecs=True)


def _engine(name: str, path: str):
    """`name` ('flagembedding', 'bertfast-fp32', 'bertfast-bf16', 'bertfast-int8') loaded from `path`."""
    import torch

    if name == "flagembedding":
        from helpers.bgem3 import flag_embedding_m3

        model_class, reason = flag_embedding_m3()
        if model_class is None:
            raise SystemExit(reason)
        return model_class(path, use_fp16=False, devices="cpu")
    import bertfast

    dtype = {"fp32": None, "bf16": torch.bfloat16, "int8": "int8"}[name.rpartition("-")[2]]
    return bertfast.BGEM3.from_pretrained(path, backend="cpu", dtype=dtype)


def _worker(conn, name: str, path: str, texts: list[str], batch_size: int, max_length: int, threads: int):
    """One engine in its own process: load, send its outputs, then answer "time" with one timed encode's seconds
    until "close"."""
    warnings.filterwarnings("ignore")
    import torch

    from bertfast.tools.bench.measure import time_once

    torch.set_num_threads(threads)
    model = _engine(name, path)

    def run():
        with contextlib.redirect_stderr(io.StringIO()):  # FlagEmbedding's progress bars
            return model.encode(texts, batch_size=batch_size, max_length=max_length, **OUTPUTS)

    conn.send(run())
    while conn.recv() == "time":
        conn.send(time_once(run, settle_s=0.1))


def errors(ours, theirs) -> dict:
    """Per output, max error over max value against FlagEmbedding; lexical weights over the union of keys."""
    import numpy as np
    import torch

    from bertfast.accuracy import rel_error

    ours_w, theirs_w = [], []
    for a, b in zip(ours["lexical_weights"], theirs["lexical_weights"]):
        for key in set(a) | set(b):
            ours_w.append(float(a.get(key, 0)))
            theirs_w.append(float(b.get(key, 0)))
    as_t = (lambda parts: torch.from_numpy(np.concatenate(parts)).double())
    return {"dense": rel_error(torch.from_numpy(ours["dense_vecs"]).double(), as_t([theirs["dense_vecs"]])),
            "sparse": rel_error(torch.tensor(ours_w, dtype=torch.float64), torch.tensor(theirs_w, dtype=torch.float64)),
            "colbert": rel_error(as_t(ours["colbert_vecs"]), as_t(theirs["colbert_vecs"])),
            "same keys": all(list(a) == list(b) for a, b in zip(ours["lexical_weights"], theirs["lexical_weights"]))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a BGE-M3 directory as FlagEmbedding saves it (default: a random small one)")
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="torch threads per engine (default: torch's)")
    p.add_argument("--dtypes", default="fp32", help="bertfast rows: fp32, bf16, int8 (comma separated)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    import bertfast
    from bertfast.tools.bench.measure import interleaved, quantile
    from helpers.bgem3 import TRAIN_WORDS, save_bgem3

    threads = args.threads or torch.get_num_threads()
    rng = random.Random(0)
    texts = [" ".join(rng.choice(TRAIN_WORDS) for _ in range(rng.randint(20, 60))) for _ in range(args.texts)]
    tmp = tempfile.mkdtemp(prefix="bench-bgem3-")
    ctx = multiprocessing.get_context("spawn")
    workers = {}
    try:
        path = args.model or save_bgem3(os.path.join(tmp, "bgem3"), hidden=args.hidden, layers=args.layers,
                                        heads=max(1, args.hidden // 64), max_positions=args.max_length + 2)
        names = ["flagembedding"] + [f"bertfast-{d}" for d in args.dtypes.split(",")]
        for name in names:  # one at a time: loading in parallel would share the cores
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, name, path, texts, args.batch_size, args.max_length,
                                                     threads), daemon=True)
            proc.start()
            workers[name] = (proc, parent)
            out = parent.recv()
            if name == "flagembedding":
                reference = out
                tokens = sum(len(v) + 1 for v in out["colbert_vecs"]) / len(texts)
                continue
            err = errors(out, reference)
            print(f"{name}: max error of the largest value against FlagEmbedding: dense {err['dense']:.2e}, "
                  f"sparse {err['sparse']:.2e}, colbert {err['colbert']:.2e}; same lexical keys: {err['same keys']}")
            if name == "bertfast-fp32" and (max(err["dense"], err["sparse"], err["colbert"]) > 1e-5
                                            or not err["same keys"]):
                raise SystemExit(f"bertfast-fp32 differs from FlagEmbedding ({err}): no timing")

        def ask(conn):
            conn.send("time")
            return conn.recv()

        times = interleaved({n: (lambda c: lambda: ask(c))(c) for n, (_, c) in workers.items()}, args.rounds,
                            warmup=1)
    finally:
        for proc, conn in workers.values():
            try:
                conn.send("close")
            except (BrokenPipeError, OSError):
                pass
            proc.join(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    cpu = bertfast.cpu_info()
    shape = (f"hidden {args.hidden}, {args.layers} layers, random" if not args.model else args.model)
    print(f"{args.texts} texts of {tokens:.1f} tokens on average, {shape}; dense + sparse + colbert, batch "
          f"{args.batch_size}; CPU {cpu['cpu']}, tier {cpu['active']}, {threads} threads per engine")
    base = quantile(times["flagembedding"], 0.5)
    for name, ts in times.items():
        med = quantile(ts, 0.5)
        print(f"{name:16s} {args.texts / med:9.1f} texts/s  median {med * 1e3:8.1f} ms  "
              f"[{min(ts) * 1e3:.1f}, {max(ts) * 1e3:.1f}]  x{base / med:.2f}")


if __name__ == "__main__":
    main()
