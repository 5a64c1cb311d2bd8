"""Many batches on worker threads, each running whole forwards on its own share of the CPU's cores.

One forward on every core spends part of its time where the cores cannot all help: the Python between the ops,
tokenizing and pooling a batch, the threads waiting for each other at the end of each parallel op, and the data
one core wrote moving to the other's cache. Given many batches (`Encoder.encode` on a list, `bertfast embed`,
a Ray actor's `Embedder`), `workers` threads instead each run their own batches on `threads / workers` cores
(one each by default), so that one worker's serial parts overlap another's forward and each batch stays in one
core's caches. A vector is the same bits either way: the engine is batch-invariant and no kernel's arithmetic
depends on how many threads run it (tests/test_workers.py). The gain: docs/embed.md#worker-threads.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

import torch

from .backends.cpu.ext import _C
from .profiling import note_workers

# Auto never starts more: every worker holds the GIL for its batches' Python, which more workers would queue for
# (measured on 2 cores only).
MAX_WORKERS = 8


def plan(device: torch.device, batches: int, workers: int | None = None, backend: str = "cpu") -> tuple[int, int]:
    """(workers, threads of each) for `batches` batches on `device` with `backend`. workers None: one per torch
    thread (at most MAX_WORKERS); never more than the batches. Only the native `cpu` backend runs workers (its
    kernels' bits do not depend on their thread count; a library's GEMM under the `torch` backend may): a GPU or
    another backend gets one whatever `workers` says. Raises ValueError for workers < 1."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be an integer >= 1 or None (auto), got {workers!r}")
    threads = torch.get_num_threads()
    if device.type != "cpu" or backend != "cpu" or _C is None:
        return 1, threads
    n = min(threads, MAX_WORKERS) if workers is None else workers
    n = max(1, min(n, batches))
    return n, max(1, threads // n)


def ordered_map(fn, items, workers: int, threads: int):
    """fn(item) for each of `items`, in order, on `workers` threads of `threads` OpenMP threads each (workers == 1:
    in the calling thread, its threads unchanged). `items` is consumed in the calling thread, at most 2 x workers
    ahead of the results it has yielded; an exception in fn is raised here; closing the generator cancels what has
    not started and waits for what has."""
    if workers <= 1:
        yield from map(fn, items)
        return
    note_workers(workers)

    def start():
        torch.get_num_threads()  # torch's own per-thread setup first: it would undo the setting on its first op
        _C.set_num_threads(threads)

    pending = collections.deque()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="bertfast-worker", initializer=start)
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)
