"""Input formats of `bertfast embed`: .txt (one text per line), .jsonl, .csv, .parquet, a directory or glob.

`read_rows(files, column, id_column)` streams `Row`s file after file in bounded memory (lines one at a
time, CSV rows one at a time, Parquet in record batches): every input row yields exactly one Row, in
order, valid or with a `problem` saying why it cannot be embedded; a file that cannot yield rows at all
(empty, no such column, unreadable) yields one Row with `line` 0 and its problem.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import sys
from dataclasses import dataclass

FORMATS = (".txt", ".jsonl", ".csv", ".parquet")
PARQUET_BATCH = 1024  # rows per Parquet record batch read


class InputError(ValueError):
    """The input cannot be read at all (nothing matches, an unsupported format)."""


@dataclass
class Row:
    file: str
    line: int  # 1-based line (txt, jsonl) or data row (csv, parquet) in its file; 0 for the whole file
    text: object = None
    id: object = None
    problem: str | None = None

    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


def find_inputs(spec: str) -> list[str]:
    """A file, a directory (its files with a known suffix, recursively) or a glob -> sorted file paths."""
    if os.path.isdir(spec):
        files = sorted(os.path.join(root, name) for root, _, names in os.walk(spec)
                       for name in names if name.endswith(FORMATS) and not name.startswith("."))
        if not files:
            raise InputError(f"input directory {spec} holds no {', '.join(FORMATS)} files")
        return files
    if glob.has_magic(spec):
        files = sorted(f for f in glob.glob(spec, recursive=True) if os.path.isfile(f))
        if not files:
            raise InputError(f"input pattern {spec!r} matches no files")
    elif os.path.isfile(spec):
        files = [spec]
    else:
        raise InputError(f"input {spec} does not exist")
    for f in files:
        if not f.endswith(FORMATS):
            raise InputError(f"input {f}: unsupported format (use {', '.join(FORMATS)})")
    return files


def count_rows(path: str) -> int:
    """Rows a file holds, cheaply (Parquet metadata; line count otherwise): the progress bar's total.
    An unreadable file counts 0 (the readers report it)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception:  # noqa: BLE001 -- a damaged file: only the bar's total, the reader reports it
            return 0
    lines, last = 0, b"\n"
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                lines += block.count(b"\n")
                last = block[-1:]
    except OSError:
        return 0
    lines += last != b"\n"
    return max(lines - path.endswith(".csv"), 0)


def _not_unicode(value) -> bool:
    """A str that cannot be encoded as UTF-8 (a lone surrogate, e.g. JSON's "\\ud800"): no tokenizer or
    Parquet column takes it."""
    if value.isascii():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check(row: Row, record: dict | None, column: str, id_column: str | None) -> Row:
    """Fill row.text / row.id from a record (dict) or say what is wrong with it."""
    if record is None:
        return row
    if column not in record:
        row.problem = f"missing column {column!r}"
    elif record[column] is None:
        row.problem = f"column {column!r} is null"
    elif not isinstance(record[column], str):
        row.problem = f"column {column!r} is {type(record[column]).__name__}, not a string"
    elif not record[column].strip():
        row.problem = f"column {column!r} is empty"
    elif _not_unicode(record[column]):
        row.problem = f"column {column!r} is not valid Unicode (a lone surrogate)"
    elif id_column is not None and record.get(id_column) is None:
        row.problem = f"missing id column {id_column!r}"
    elif id_column is not None and isinstance(record[id_column], str) and _not_unicode(record[id_column]):
        row.problem = f"id column {id_column!r} is not valid Unicode (a lone surrogate)"
    else:
        row.text = record[column]
        row.id = record[id_column] if id_column is not None else None
    return row


def _lines(path: str):
    """(line number, decoded line without its terminator or a problem) for each line of a text file."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8").rstrip("\r\n"), None
            except UnicodeDecodeError as e:
                yield number, None, f"not valid UTF-8 ({e.reason} at byte {e.start})"


def _read_txt(path, column, id_column):
    for number, line, problem in _lines(path):
        if problem is None and not line.strip():
            problem = "empty line"
        yield Row(path, number, text=None if problem else line, problem=problem)


def _read_jsonl(path, column, id_column):
    for number, line, problem in _lines(path):
        row = Row(path, number, problem=problem)
        if problem:
            yield row
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            row.problem = f"invalid JSON ({e.msg})"
            yield row
            continue
        if not isinstance(record, dict):
            row.problem = f"not a JSON object ({type(record).__name__})"
            yield row
            continue
        yield _check(row, record, column, id_column)


def _missing_columns(path, found, column, id_column):
    wanted = [column] + ([id_column] if id_column else [])
    missing = [c for c in wanted if c not in found]
    if missing:
        return Row(path, 0, problem=f"no column {missing[0]!r} (columns: {', '.join(map(str, found))})")
    return None


def _read_csv(path, column, id_column):
    csv.field_size_limit(sys.maxsize)  # long documents are long fields
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            yield Row(path, 0, problem="empty file")
            return
        bad = _missing_columns(path, reader.fieldnames, column, id_column)
        if bad:
            yield bad
            return
        for number, record in enumerate(reader, 1):
            yield _check(Row(path, number), record, column, id_column)


def _read_parquet(path, column, id_column):
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    bad = _missing_columns(path, pf.schema_arrow.names, column, id_column)
    if bad:
        yield bad
        return
    columns = [column] + ([id_column] if id_column and id_column != column else [])
    number = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH, columns=columns):
        data = batch.to_pydict()
        for i in range(batch.num_rows):
            number += 1
            yield _check(Row(path, number), {c: data[c][i] for c in columns}, column, id_column)


_READERS = {".txt": _read_txt, ".jsonl": _read_jsonl, ".csv": _read_csv, ".parquet": _read_parquet}


def read_rows(files: list[str], column: str = "text", id_column: str | None = None):
    """Every row of every file, in order (see the module docstring); an empty file yields one problem row."""
    for path in files:
        reader = _READERS[os.path.splitext(path)[1]]
        empty = True
        try:
            for row in reader(path, column, id_column):
                empty = False
                yield row
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            yield Row(path, 0, problem=f"unreadable ({e})")
            continue
        except Exception as e:  # pyarrow's errors on a damaged Parquet file
            if type(e).__module__.startswith("pyarrow"):
                yield Row(path, 0, problem=f"unreadable ({e})")
                continue
            raise
        if empty:
            yield Row(path, 0, problem="empty file")
