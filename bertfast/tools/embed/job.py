"""The streaming loop of `bertfast embed`: rows -> shards of valid rows -> embeddings -> writer.

Rows stream in from the readers; valid ones collect into shards of `shard_rows` (the only rows held in
memory: the shards with chunks in flight), each shard is embedded in chunks of `CHUNK` texts (the window within
which texts are sorted by length for token-budget batches, and the unit of work of a worker thread or a Ray actor),
the chunks of one shard after another's as one stream, and handed to the writer. Shards
the writer already holds (--resume) are read but not embedded. Bad rows never stop the job: they are
counted and reported at the end, unless `strict`, where the first one raises `BadRow`.
"""

from __future__ import annotations

import collections
import resource
import time
from dataclasses import dataclass, field

from bertfast.profiling import stage

CHUNK = 1024  # texts per embed call: sort window for token batching, bounded tokenizer memory
TAIL_PIECE = 16  # the smallest chunk of a stream's tail (see piece_size)
EXAMPLES = 10  # bad rows listed in the report
# Tests only: called with a shard's index on the job's thread right after the shard is committed (a test stops the
# job there, between two commits, on every run alike).
_test_hook = None


class BadRow(ValueError):
    """--strict: the first row that cannot be embedded."""


@dataclass
class Report:
    rows: int = 0  # input rows seen, good and bad
    embedded: int = 0  # rows embedded in this run
    skipped: int = 0  # rows in shards an earlier run finished
    tokens: int = 0
    seconds: float = 0.0
    bad: int = 0
    bad_files: int = 0
    examples: list = field(default_factory=list)

    def add_bad(self, row) -> None:
        if row.line == 0:
            self.bad_files += 1
        else:
            self.bad += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(f"{row.where()}: {row.problem}")

    def summary(self) -> str:
        rate = self.embedded / self.seconds if self.seconds else 0.0
        lines = [f"embedded {self.embedded} texts ({self.tokens} tokens) in {self.seconds:.1f} s "
                 f"({rate:.1f} texts/s, {self.tokens / max(self.seconds, 1e-9):.0f} tokens/s); "
                 f"peak RSS of this process {peak_rss_mib():.0f} MiB"]
        if self.skipped:
            lines.append(f"resumed: {self.skipped} texts were already embedded by an earlier run")
        if self.bad or self.bad_files:
            lines.append(f"skipped {self.bad} bad rows and {self.bad_files} unreadable or empty files"
                         + (f"; the first {len(self.examples)}:" if self.examples else ""))
            lines.extend(f"  {e}" for e in self.examples)
        return "\n".join(lines)


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _id_problem(value, kind: type | None) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return f"id is {type(value).__name__}, not an integer or a string"
    if kind is not None and not isinstance(value, kind):
        return f"id is {type(value).__name__}, but earlier ids are {kind.__name__}"
    return None


def shards(rows, shard_rows: int, report: Report, strict: bool = False, use_row_ids: bool = True):
    """rows -> (index, ids, texts) per shard of up to shard_rows valid rows, in input order.

    use_row_ids: the id is the row's 0-based position among all input rows (bad ones included, so a
    gap in the ids marks a skipped row); else the row's own id (one kind: int or str)."""
    ids, texts, index, kind = [], [], 0, None
    for row in rows:
        if row.line:
            report.rows += 1
        if row.problem is None and not use_row_ids:
            row.problem = _id_problem(row.id, kind)
            kind = kind or (type(row.id) if row.problem is None else None)
        if row.problem is not None:
            if strict:
                raise BadRow(f"{row.where()}: {row.problem}")
            report.add_bad(row)
            continue
        ids.append(report.rows - 1 if use_row_ids else row.id)
        texts.append(row.text)
        if len(texts) == shard_rows:
            yield index, ids, texts
            ids, texts, index = [], [], index + 1
    if texts:
        yield index, ids, texts


def piece_size(chunk_size: int, left: int | None, workers: int) -> int:
    """Texts in the next chunk when about `left` texts remain to be handed out (None: unknown) to `workers` that
    take chunks as they free up: `chunk_size`, until the tail, where each chunk is a 2 x workers-th of what is
    left (at least TAIL_PIECE), so the workers finish together instead of one embedding a whole last chunk while
    the others wait (200 texts, 2 workers, 256-text chunks: one worker did all of it)."""
    if workers <= 1 or left is None:
        return chunk_size
    return max(1, min(chunk_size, max(TAIL_PIECE, -(-left // (2 * workers))), left))


def run(rows, writer, embed_chunks, *, shard_rows: int, total: int | None = None, keep_text: bool = False,
        strict: bool = False, use_row_ids: bool = True, progress: bool | None = None,
        chunk_size: int = CHUNK, workers: int = 1) -> Report:
    """Embed every valid row into `writer`; embed_chunks(iterable of text lists) yields (embeddings, tokens) per
    list, in order, taking the lists as it needs them. progress: None shows the bar (texts/s, tokens/s, ETA) on a
    terminal. chunk_size: texts per list, smaller in the stream's tail where `workers` > 1 take the lists
    (piece_size; `total` tells where the tail begins).

    The chunks of every shard go to embed_chunks as one stream, so it can embed the next shard's first chunks while
    this thread writes (worker threads or Ray actors stay busy across shards); each chunk's rows are appended to its
    shard's file as they come back, and the shard is committed after its last chunk. At most the texts of the shards
    with chunks in flight are held (two, with 2 x workers chunks ahead and shards of more texts than that); no
    shard's vectors."""
    from tqdm.auto import tqdm

    report = Report()
    bar = tqdm(total=total, unit="text", desc="embed", dynamic_ncols=True, smoothing=0.1,
               disable=None if progress is None else not progress)
    in_flight = collections.deque()  # (index, ids, texts, chunk count) of each shard whose chunks were handed out
    failed = []  # --strict: the bad row, raised once the shards before it are written
    handed = 0  # texts handed out in chunks so far: the total less these and the bad rows is what is left

    def chunks():
        nonlocal handed
        try:
            for index, ids, texts in shards(rows, shard_rows, report, strict, use_row_ids):
                if writer.done(index):  # out of the bar's total, so its rate and ETA are this run's
                    report.skipped += len(texts)
                    if bar.total is not None:
                        bar.total -= len(texts)
                    bar.update(report.embedded + report.bad - bar.n)
                    continue
                parts, lo = [], 0
                while lo < len(texts):
                    left = None if bar.total is None else max(bar.total - report.bad - handed, 1)
                    parts.append(texts[lo:lo + piece_size(chunk_size, left, workers)])
                    lo += len(parts[-1])
                    handed += len(parts[-1])
                in_flight.append((index, ids, texts, len(parts)))
                yield from parts
        except BadRow as e:
            failed.append(e)

    start = time.perf_counter()
    results = embed_chunks(chunks())
    shard, parts, lo = None, 0, 0  # the shard in_flight[0] being written, its chunks and rows appended so far
    try:
        for emb, tokens in results:
            index, ids, texts, count = in_flight[0]
            with stage("write"):  # each chunk as it comes: the last one leaves only the shard's footer to write
                shard = shard or writer.open(index)
                shard.append(ids[lo:lo + len(emb)], emb, texts[lo:lo + len(emb)] if keep_text else None)
            parts, lo = parts + 1, lo + len(emb)
            report.embedded += len(emb)
            report.tokens += tokens
            elapsed = time.perf_counter() - start
            bar.set_postfix_str(f"{report.tokens / elapsed:.0f} tok/s, {report.bad} bad", refresh=False)
            bar.update(report.embedded + report.bad - bar.n)
            if parts == count:
                in_flight.popleft()
                with stage("write"):
                    shard.commit()
                shard, parts, lo = None, 0, 0
                if _test_hook is not None:
                    _test_hook(index)
        if failed:
            raise failed[0]
    finally:
        if shard is not None:  # interrupted or failed mid-shard: none of it is recorded
            shard.discard()
        # Here, not when the generator is collected: a worker pool it holds shuts down now (and a signal arriving
        # meanwhile is raised, not ignored).
        close = getattr(results, "close", None)
        if close is not None:
            close()
        bar.close()
        report.seconds = time.perf_counter() - start
    return report
