"""Worker threads (`bertfast.workers`): many batches at once, each worker on its own share of the cores.

A vector must be the same bits whatever the workers (`Encoder.encode`, `bertfast embed`), on every ISA cap and dtype;
the workers run with their own thread count and leave the caller's alone; results come back in order, an error in a
batch reaches the caller, and closing early stops the rest; a profile shares its thread-seconds out of
wall x workers.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import bertfast
from bertfast import Encoder
from bertfast.workers import MAX_WORKERS, ordered_map, plan
from conftest import corpus

TEXTS = corpus(300, seed=3)


def _native():
    from bertfast import _C

    return _C


def test_plan():
    threads = torch.get_num_threads()
    cpu = torch.device("cpu")
    assert plan(cpu, 1000) == (min(threads, MAX_WORKERS), max(1, threads // min(threads, MAX_WORKERS)))
    assert plan(cpu, 1) == (1, threads)  # never more workers than batches
    assert plan(cpu, 1000, 1) == (1, threads)
    assert plan(cpu, 1000, 3) == (3, max(1, threads // 3))
    assert plan(torch.device("cuda"), 1000) == (1, threads)
    assert plan(cpu, 1000, 3, backend="torch") == (1, threads)  # only the native backend's bits ignore threads
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="workers must be an integer >= 1"):
            plan(cpu, 10, bad)


def test_ordered_map_in_order_on_its_own_threads():
    native = _native()
    before = (native.num_threads(), torch.get_num_threads())
    seen = {}
    together = threading.Barrier(2, timeout=60)  # items 0 and 1 run at once, so on two workers, however fast

    def fn(i):
        if i < 2:
            together.wait()
        time.sleep(0.002 * ((i * 7) % 5))  # finish out of order
        torch.ones(64, 64).sum()  # a torch op first: its per-thread setup must not undo the worker's count
        seen[i] = (threading.current_thread().name, native.num_threads(), torch.get_num_threads())
        return i * i

    assert list(ordered_map(fn, range(30), 3, 2)) == [i * i for i in range(30)]
    assert {name for name, _, _ in seen.values()} <= {f"bertfast-worker_{k}" for k in range(3)}
    assert len({name for name, _, _ in seen.values()}) > 1
    assert {(count, torch_count) for _, count, torch_count in seen.values()} == {(2, 2)}
    assert (native.num_threads(), torch.get_num_threads()) == before  # the caller's own are unchanged
    # One worker: in the calling thread, as plain map.
    here = threading.current_thread().name
    assert list(ordered_map(lambda i: threading.current_thread().name, range(3), 1, 8)) == [here] * 3


def test_ordered_map_reads_ahead_boundedly():
    consumed = []

    def items():
        for i in range(100):
            consumed.append(i)
            yield i

    out = ordered_map(lambda i: i, items(), 2, 1)
    assert next(out) == 0
    assert len(consumed) <= 2 * 2 + 1
    out.close()


def test_ordered_map_error_and_early_close():
    def fn(i):
        if i == 5:
            raise KeyError("batch 5")
        return i

    got = []
    with pytest.raises(KeyError, match="batch 5"):
        for r in ordered_map(fn, range(50), 2, 1):
            got.append(r)
    assert got == [0, 1, 2, 3, 4]

    calls = []
    lock = threading.Lock()

    def slow(i):
        time.sleep(0.005)
        with lock:
            calls.append(i)
        return i

    out = ordered_map(slow, range(1000), 2, 1)
    assert [next(out) for _ in range(3)] == [0, 1, 2]
    out.close()  # cancels what has not started, waits for what has
    settled = len(calls)
    time.sleep(0.05)
    assert len(calls) == settled < 20


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_encode_is_bitwise_whatever_the_workers(isa, tiny_text_model, dtype):
    # batch_size 7 and batch_tokens 64 / 2048: batches of 1 to hundreds of rows, on 1, 2 and 5 workers.
    enc = Encoder.from_pretrained(tiny_text_model, backend="cpu", dtype=dtype)
    for kwargs in (dict(batch_size=7), dict(batch_tokens=64), dict(batch_tokens=2048)):
        want = enc.encode(TEXTS, workers=1, **kwargs)
        for workers in (2, 5):
            got = enc.encode(TEXTS, workers=workers, **kwargs)
            assert torch.equal(got, want), f"{isa}, {dtype}, {kwargs}, {workers} workers"
    assert torch.equal(enc.encode(TEXTS[:50]), enc.encode(TEXTS[:50], workers=1))  # the default (auto)


def test_encode_batches_in_order_with_workers(tiny_text_model):
    enc = Encoder.from_pretrained(tiny_text_model, backend="cpu")
    one = list(enc.encode_batches(TEXTS, batch_size=9, workers=1))
    many = list(enc.encode_batches(TEXTS, batch_size=9, workers=3))
    assert [rows for rows, _, _ in one] == [rows for rows, _, _ in many]
    assert all(torch.equal(a[2], b[2]) and a[1] == b[1] for a, b in zip(one, many))
    with pytest.raises(ValueError, match="workers must be"):
        enc.encode_batches(TEXTS, workers=0)  # at the call, not at the first batch


def test_embed_is_bitwise_whatever_the_workers(tmp_path, tiny_text_model):
    # 600 texts: more than two worker chunks (WORKER_CHUNK), each worker tokenizing and batching its own.
    from bertfast.tools.cli import main
    from bertfast.tools.embed.cli import WORKER_CHUNK

    texts = corpus(600, seed=5)
    assert len(texts) > 2 * WORKER_CHUNK
    src = tmp_path / "c.txt"
    src.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    want = Encoder.from_pretrained(tiny_text_model, backend="cpu", dtype="int8").encode(texts, workers=1)
    for workers in (1, 3):
        out = tmp_path / f"out{workers}.npy"
        assert main(["embed", str(src), str(out), "--model", tiny_text_model, "--dtype", "int8", "--backend", "cpu",
                     "--workers", str(workers), "--no-progress"]) == 0
        assert np.array_equal(np.load(out), want.numpy()), f"{workers} workers"


@pytest.mark.parametrize("dtype,tokens", [("int8", 1024), (None, 1024), ("bf16", 512)])
def test_embed_workers_take_their_dtypes_token_budget(tiny_text_model, dtype, tokens):
    from bertfast.ray import worker_batch_tokens

    assert worker_batch_tokens(Encoder.from_pretrained(tiny_text_model, backend="cpu", dtype=dtype)) == tokens


def test_profile_shares_thread_seconds(tiny_text_model):
    enc = Encoder.from_pretrained(tiny_text_model, backend="cpu", dtype="int8")
    with bertfast.profile(enc) as one:
        enc.encode(TEXTS, batch_size=10, workers=1)
    with bertfast.profile(enc) as two:
        enc.encode(TEXTS, batch_size=10, workers=2)
    assert (one.workers, two.workers) == (1, 2)
    for prof in (one, two):
        rows = {r["stage"]: r for r in prof.rows()}
        assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0, abs=1e-9) or rows["rest"]["seconds"] == 0
        assert all(r["share"] >= 0 for r in rows.values())
    calls = lambda p: {r["stage"]: r["calls"] for r in p.rows() if r["stage"] not in ("rest", "forward: rest")}  # noqa
    assert calls(one) == calls(two)  # the same ops, counted once each whichever thread ran them
    assert "x 2 workers" in two.table() and "x 2 workers" not in one.table()


def test_embed_job_streams_chunks_across_shards():
    """job.run hands the chunks of every shard to embed_chunks as one stream: a pool reading ahead gets the next
    shard's chunks before this thread commits the last shard (its workers never wait for a write); each chunk's rows
    are appended to their shard as they come back, in order, and each shard committed after its last chunk."""
    from bertfast.tools.embed import job
    from bertfast.tools.embed.readers import Row

    events = []

    class Shard:
        def __init__(self, index):
            self.index, self.ids, self.values = index, [], []

        def append(self, ids, emb, texts):
            events.append(("append", self.index, list(ids)))
            self.ids += list(ids)
            self.values += emb[:, 0].tolist()

        def commit(self):
            events.append(("commit", self.index, self.ids, self.values))

        def discard(self):
            events.append(("discard", self.index))

    class Writer:
        def done(self, index):
            return False

        def open(self, index):
            return Shard(index)

    def embed_chunks(chunks):  # reads ahead 3 chunks, as ordered_map with workers does
        it = iter(chunks)
        ahead = []
        for chunk in it:
            events.append(("take", chunk[0]))
            ahead.append(chunk)
            if len(ahead) > 3:
                c = ahead.pop(0)
                yield np.array([[float(t)] for t in c], dtype=np.float32), len(c)
        for c in ahead:
            yield np.array([[float(t)] for t in c], dtype=np.float32), len(c)

    rows = [Row(file="x.txt", line=i + 1, text=str(i), id=i) for i in range(23)]
    report = job.run(iter(rows), Writer(), embed_chunks, shard_rows=10, chunk_size=4, progress=False)
    commits = [e for e in events if e[0] == "commit"]
    assert [c[1] for c in commits] == [0, 1, 2] and report.embedded == 23
    for index, ids, values in (c[1:] for c in commits):
        assert ids == list(range(10 * index, min(23, 10 * index + 10))) == [int(v) for v in values]
    appends = [e[1:] for e in events if e[0] == "append"]
    assert appends[:3] == [(0, [0, 1, 2, 3]), (0, [4, 5, 6, 7]), (0, [8, 9])]  # one a chunk, as it comes back
    assert events.index(("append", 0, [8, 9])) < events.index(commits[0])
    first_of_shard_1 = events.index(("take", "10"))  # shard 1 is chunked 10-13, 14-17, 18-19
    assert first_of_shard_1 < events.index(commits[0])
    assert not [e for e in events if e[0] == "discard"]


def test_embed_job_splits_the_tail_across_workers():
    """With workers > 1 and a known total, the stream's last texts go out in smaller chunks (a 2 x workers-th of what
    is left, at least job.TAIL_PIECE), so no worker embeds a whole last chunk alone; every row still lands in its
    shard at its place (chunks of several sizes), and one worker, or an unknown total, keeps whole chunks."""
    from bertfast.tools.embed import job
    from bertfast.tools.embed.readers import Row

    assert job.piece_size(256, 200, 2) == 50 and job.piece_size(256, 5000, 2) == 256
    assert job.piece_size(256, 20, 2) == job.TAIL_PIECE and job.piece_size(256, 7, 2) == 7
    assert job.piece_size(256, 200, 1) == job.piece_size(256, None, 2) == 256

    class Shard:
        def __init__(self, index, out):
            self.index, self.out = index, out

        def append(self, ids, emb, texts):
            self.out.append((self.index, list(ids), [int(v) for v in emb[:, 0]]))

        def commit(self):
            pass

    class Writer:
        def __init__(self):
            self.appended = []

        def done(self, index):
            return False

        def open(self, index):
            return Shard(index, self.appended)

    def embed_chunks(chunks):
        for c in chunks:
            sizes.append(len(c))
            yield np.array([[float(t)] for t in c], dtype=np.float32), len(c)

    rows = [Row(file="x.txt", line=i + 1, text=str(i), id=i) for i in range(700)]
    whole = [64, 64, 64, 64, 44] * 2 + [64, 36]  # shards of 300, 300 and 100 texts in chunks of 64
    # whole chunks while more than 2 x 2 x 64 texts are left, then a quarter of what is left (the shard's end cuts
    # one), never under TAIL_PIECE but for the last
    tail = [64, 64, 64, 64, 44, 64, 64, 64, 52, 39, 17, 25, 19, 16, 16, 16, 8]
    for workers, total, expected in ((2, 700, tail), (1, 700, whole), (2, None, whole)):
        sizes, writer = [], Writer()
        report = job.run(iter(rows), writer, embed_chunks, shard_rows=300, total=total, chunk_size=64,
                         progress=False, workers=workers)
        assert report.embedded == 700 and sizes == expected, sizes
        assert [i for _, ids, _ in writer.appended for i in ids] == list(range(700))
        assert all(ids == values and all(i // 300 == shard for i in ids) for shard, ids, values in writer.appended)


def test_embed_strict_writes_the_shards_before_the_bad_row(tmp_path, tiny_text_model):
    import json

    from bertfast.tools.cli import main

    texts = corpus(250, seed=7)
    lines = [json.dumps({"text": t}) for t in texts[:230]] + [json.dumps({"nope": 1})] + [
        json.dumps({"text": t}) for t in texts[230:]]
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["embed", str(src), str(out), "--model", tiny_text_model, "--backend", "cpu", "--shard-rows", "70",
                 "--workers", "2", "--strict", "--no-progress"]) == 1
    manifest = json.loads((out / "_manifest.json").read_text())
    assert sorted(map(int, manifest["shards"])) == [0, 1, 2]  # rows 0-209: every shard completed before row 230
    import pyarrow.parquet as pq

    got = np.concatenate([np.stack(pq.read_table(out / manifest["shards"][str(k)]["file"]).column("embedding")
                                   .to_numpy(zero_copy_only=False)) for k in range(3)])
    want = Encoder.from_pretrained(tiny_text_model, backend="cpu").encode(texts[:210], workers=1).numpy()
    assert np.array_equal(got, want)
