"""One engine thread that owns the model, fed by a token-budget queue.

Request threads hand in `Job`s (already tokenized rows, their token type ids for text pairs, the LoRA adapter they
run with, plus a hashable key of the parameters that must be equal within one model call); the engine thread takes rows
first-come first-served from the jobs that share the oldest job's key until the next row would pass
`max_batch_tokens` (a row longer than the budget runs alone), runs them as one batch and writes each
row's result into its job. A job's future completes when all its rows are done, so a request larger than
the budget is split across batches and results keep the request's order. The adapter is not part of the key: it is
carried per row, so one model call mixes adapters and base rows (a row's result depends on its own adapter alone).
Admission is bounded: `admit()`
raises `Busy` at once when `max_requests` are accepted and not yet answered. `close()` stops admission,
finishes every job already queued, then ends the thread: every accepted request is answered. `call(fn)` runs fn on
the engine thread between two batches (loading or unloading an adapter: the model is only touched there).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


class Busy(Exception):
    """The server holds its maximum of accepted requests (answer 429)."""


class Closed(Exception):
    """The server is shutting down or the engine is gone (answer 503)."""


@dataclass
class Job:
    """rows: token id lists; key: parameters shared by every row of one model call; types: each row's
    token type ids (text pairs), or None (all 0); min_tokens: the tokens a row costs the budget at least (a ColBERT
    query runs expanded to its query_length); adapter: the name of the LoRA adapter every row runs with, or None (the
    base model)."""

    rows: list[list[int]]
    key: tuple
    types: list[list[int]] | None = None
    min_tokens: int = 0
    adapter: str | None = None
    future: Future = field(default_factory=Future)
    taken: int = 0  # rows handed to the engine
    done: int = 0  # rows written to out
    out: np.ndarray | list | None = None  # (len(rows), D), or a list of per-row arrays, once the first batch returns

    @property
    def tokens(self) -> int:
        return sum(self.cost(r) for r in self.rows)

    def cost(self, row: list[int]) -> int:
        """The tokens `row` takes of a batch's budget."""
        return max(len(row), self.min_tokens)


# run(key, rows, types, adapters) -> (len(rows), D) float32 array, or a list of len(rows) arrays (per-token results:
# one (len(row), H) array per row); types[i] None for all-0 token types; adapters[i] the row's adapter name or None
# (the base model); called on the engine thread only.
RunBatch = Callable[[tuple, list[list[int]], list[list[int] | None], list[str | None]], np.ndarray]
# on_batch(rows, tokens, seconds): statistics hook, called on the engine thread after each batch.
OnBatch = Callable[[int, int, float], None]
# Tests only: called with no argument on the engine thread before each batch runs (no lock held), so a test can
# hold the engine there and fill the queue deterministically.
_test_hook: Callable[[], None] | None = None


class Batcher:
    def __init__(self, max_batch_tokens: int, max_requests: int, on_batch: OnBatch | None = None):
        if max_batch_tokens < 1 or max_requests < 1:
            raise ValueError(f"max_batch_tokens and max_requests must be >= 1, got {max_batch_tokens}, {max_requests}")
        self.max_batch_tokens, self.max_requests = max_batch_tokens, max_requests
        self.on_batch = on_batch
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()  # `call`s not yet run
        self._accepted = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self._run: RunBatch | None = None

    # --- lifecycle ---
    def start(self, load: Callable[[], RunBatch]) -> Future:
        """Start the engine thread: it calls `load()` (load and warm the model there, so the model's
        threads belong to the engine thread), then serves. The returned future completes once ready."""
        ready: Future = Future()

        def main():
            try:
                self._run = load()
            except BaseException as e:  # noqa: BLE001  the starter re-raises it
                ready.set_exception(e)
                return
            ready.set_result(True)
            self._serve()

        self._thread = threading.Thread(target=main, name="bertfast-engine", daemon=True)
        self._thread.start()
        return ready

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._run is not None

    def close(self, timeout: float | None = None, wait: bool = True) -> None:
        """Refuse new requests, finish every admitted one, stop the engine thread (wait=False: return at once, the
        thread finishes on its own; call again to wait)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if wait and self._thread is not None:
            self._thread.join(timeout)

    # --- request side ---
    @contextmanager
    def admit(self):
        """Hold one of `max_requests` places for the duration of a request; Busy when none is free."""
        with self._cond:
            if self._closing:
                raise Closed("the server is shutting down")
            if self._accepted >= self.max_requests:
                raise Busy(f"the server holds its maximum of {self.max_requests} requests")
            self._accepted += 1
        try:
            yield
        finally:
            with self._cond:
                self._accepted -= 1
                self._cond.notify_all()

    def submit(self, job: Job) -> Future:
        """Queue a job (of an admitted request); its future gets the (rows, D) float32 result (or the list of per-row
        results)."""
        if not job.rows:
            job.future.set_result(np.zeros((0, 0), np.float32))
            return job.future
        with self._cond:
            if not self.alive and self._thread is not None:
                raise Closed("the engine thread has stopped")
            self._pending.append(job)
            self._cond.notify()
        return job.future

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn() on the engine thread before the next batch; the future gets its result or its exception. Call it
        from an admitted request (the engine thread ends only once none is left)."""
        future: Future = Future()
        with self._cond:
            if not self.alive and self._thread is not None:
                raise Closed("the engine thread has stopped")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    @property
    def depth(self) -> int:
        """Rows queued and not yet handed to the engine."""
        with self._cond:
            return sum(len(j.rows) - j.taken for j in self._pending)

    @property
    def accepted(self) -> int:
        with self._cond:
            return self._accepted

    # --- engine side ---
    def _take(self) -> tuple[tuple, list[tuple[Job, int]]]:
        """The next batch: (key, [(job, row index)]) within the token budget. Called holding the lock."""
        key = self._pending[0].key
        picked, tokens = [], 0
        for job in list(self._pending):
            if job.key != key:
                continue
            while job.taken < len(job.rows):
                n = job.cost(job.rows[job.taken])
                if picked and tokens + n > self.max_batch_tokens:
                    return key, picked
                picked.append((job, job.taken))
                tokens += n
                job.taken += 1
            self._pending.remove(job)
        return key, picked

    def _serve(self) -> None:
        while True:
            with self._cond:
                # At shutdown, wait for admitted requests still tokenizing: they will submit.
                while not self._pending and not self._calls and not (self._closing and self._accepted == 0):
                    self._cond.wait()
                call = self._calls.popleft() if self._calls else None
                if call is None and not self._pending:
                    return
                if call is None:
                    key, picked = self._take()
            if call is not None:
                fn, future = call
                try:
                    future.set_result(fn())
                except Exception as e:  # noqa: BLE001  the caller gets it; the engine goes on
                    future.set_exception(e)
                continue
            rows = [job.rows[i] for job, i in picked]
            types = [None if job.types is None else job.types[i] for job, i in picked]
            adapters = [job.adapter for job, _ in picked]
            if _test_hook is not None:
                _test_hook()
            start = time.perf_counter()
            try:
                out = self._run(key, rows, types, adapters)
            except Exception as e:  # noqa: BLE001  the request gets it; the engine goes on
                for job in {id(j): j for j, _ in picked}.values():
                    if not job.future.done():
                        job.future.set_exception(e)
                continue
            if self.on_batch is not None:
                self.on_batch(len(rows), sum(len(r) for r in rows), time.perf_counter() - start)
            for (job, i), vec in zip(picked, out):
                if job.future.done():  # failed in an earlier batch
                    continue
                if job.out is None:
                    job.out = (np.empty((len(job.rows), out.shape[1]), dtype=out.dtype) if isinstance(out, np.ndarray)
                               else [None] * len(job.rows))
                job.out[i] = vec
                job.done += 1
                if job.done == len(job.rows):
                    job.future.set_result(job.out)
