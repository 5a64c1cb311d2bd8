"""`bertfast embed --ray`: the input read by Ray Data tasks on the cluster, the chunks embedded by Ray actors.

Reading: a Ray Data dataset of the input files, each read by a task on some node (SPREAD, Ray Data's
default) with this package's readers, streamed in Arrow blocks of `BLOCK_ROWS` rows. Ray's own readers
would change the rows: `read_text` splits lines at every Unicode line break (U+2028 inside a JSON string
too) and fails a whole file on one invalid UTF-8 byte; `read_json` / `read_csv` (pyarrow's parsers) fail
a whole file on one bad line and infer types (a CSV text "42" becomes an int); and Ray 2.60's
`read_parquet` lists paths in threads that race on `import fsspec.implementations.http` where aiohttp is
missing (an ImportError, now and then). The blocks come back to the driver in input order
(`preserve_order`) as the same `Row`s the single-process job reads, so ids, shards, bad-row counts,
resume and the output bytes are the single-process job's: the driver cuts and writes shards, the actors
embed. Read tasks ask for no CPU (the actors hold the cluster's CPUs; reading is a small share of the
work), at most `READERS_PER_NODE` at a time per node.
"""

from __future__ import annotations

import logging
import pickle
import re
from collections import deque
from contextlib import contextmanager

from .readers import Row, count_rows, read_rows

IN_FLIGHT = 2  # chunks queued per actor: one running, one waiting
READERS_PER_NODE = 2  # concurrent read tasks per node
BLOCK_ROWS = 4096  # rows per block a text-file read task yields: bounded memory within a file


def connect(address: str):
    """Ray, connected to the cluster at `address` ('auto', an address; 'local': start one here)."""
    try:
        import ray
        import ray.data  # noqa: F401  (the ray[data] extra)
    except ImportError:
        raise RuntimeError("--ray needs the package ray with Ray Data (pip install 'bertfast[ray]')") from None
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, log_to_driver=False)
    return ray


def count_all_rows(ray, files: list[str]):
    """`readers.count_rows` of every file (the progress bar's total), run on the cluster: returns a callable that
    waits for the sum, so the counting runs while the driver goes on (the actors loading their model)."""
    task = ray.remote(num_cpus=0)(count_rows)
    refs = [task.remote(f) for f in files]
    return lambda: sum(ray.get(refs))


def _readers(ray) -> int:
    return READERS_PER_NODE * max(1, sum(1 for node in ray.nodes() if node.get("Alive")))


# Ray Data's per-dataset INFO lines, and its note that its progress bars are off, would break up the job's bar.
_QUIET = {"ray.data": logging.WARNING, "ray.data._internal.progress": logging.ERROR}


@contextmanager
def _ordered(ray):
    """Ray Data in input order and without its own progress output (the job's bar is the one), restored after."""
    ctx = ray.data.DataContext.get_current()
    before = ctx.execution_options.preserve_order, ctx.enable_progress_bars
    levels = {name: logging.getLogger(name).level for name in _QUIET}
    ctx.execution_options.preserve_order, ctx.enable_progress_bars = True, False
    for name, level in _QUIET.items():
        logging.getLogger(name).setLevel(max(level, logging.getLogger(name).getEffectiveLevel()))
    try:
        yield
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = before
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def read_rows_on(ray, files: list[str], column: str = "text", id_column: str | None = None):
    """Every row of every file, in order, exactly as `readers.read_rows` yields them; read on the cluster."""
    with _ordered(ray):
        ds = ray.data.from_items([{"file": i, "path": p} for i, p in enumerate(files)],
                                 override_num_blocks=len(files))
        ds = ds.map_batches(_read_files, fn_kwargs=dict(column=column, id_column=id_column), batch_size=1,
                            batch_format="numpy", num_cpus=0,
                            compute=ray.data.TaskPoolStrategy(size=min(_readers(ray), len(files))))
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            data = batch.to_pydict()
            for index, line, text, row_id, problem in zip(data["file"], data["line"], data["text"], data["id"],
                                                          data["problem"]):
                yield Row(files[index], line, text=text, id=None if row_id is None else pickle.loads(row_id),
                          problem=problem)


def _read_files(batch, column: str, id_column: str | None):
    """A Ray Data task: the rows of each file in `batch` (columns file, path) in blocks of BLOCK_ROWS."""
    for index, path in zip(batch["file"], batch["path"]):
        rows = []
        for row in read_rows([str(path)], column, id_column):
            rows.append(row)
            if len(rows) == BLOCK_ROWS:
                yield _block(int(index), rows)
                rows = []
        if rows:
            yield _block(int(index), rows)


def _block(index: int, rows: list[Row]):
    """Rows of file `index` as an Arrow table. Ids are pickled: an id of any type (a JSON list, a Parquet
    timestamp) must reach the driver as itself, for the job to judge it with the ids before it."""
    import pyarrow as pa

    return pa.table({"file": pa.array([index] * len(rows), pa.int32()),
                     "line": pa.array([r.line for r in rows], pa.int64()),
                     "text": pa.array([r.text for r in rows], pa.string()),
                     "id": pa.array([None if r.id is None else pickle.dumps(r.id) for r in rows], pa.binary()),
                     "problem": pa.array([r.problem for r in rows], pa.string())})


def _last_line(message: str) -> str:
    """The exception line that ends a Ray error's remote traceback (its colour codes removed)."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", message).splitlines() if line.strip()]
    return lines[-1] if lines else message


class ActorPool:
    """`actors` Embedder actors of `cpus` CPUs each (default: as many as the cluster's CPUs allow)."""

    def __init__(self, ray, embedder_kwargs: dict, actors: int | None = None, cpus: int = 1):
        from bertfast.ray import Embedder

        self.ray = ray
        if actors is None:
            actors = max(1, int(ray.cluster_resources().get("CPU", 1) // cpus))
        remote = ray.remote(num_cpus=cpus)(Embedder)
        self.actors = [remote.remote(**embedder_kwargs) for _ in range(actors)]

    def ready(self) -> None:
        """Wait until every actor holds its engine; RuntimeError with the error of one that could not load its model
        or adapter."""
        try:
            self.ray.get([actor.__ray_ready__.remote() for actor in self.actors])
        except self.ray.exceptions.RayActorError as e:
            raise RuntimeError(f"an embedding actor did not start: {_last_line(str(e))}") from None

    def __call__(self, chunks):
        """Yields (embeddings, tokens) per chunk, in the chunks' order."""
        pending = deque()
        limit = IN_FLIGHT * len(self.actors)
        for i, chunk in enumerate(chunks):
            pending.append(self.actors[i % len(self.actors)].embed.remote(chunk))
            if len(pending) >= limit:
                yield self.ray.get(pending.popleft())
        while pending:
            yield self.ray.get(pending.popleft())

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
