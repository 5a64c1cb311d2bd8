"""Output of `bertfast embed`: Parquet shards written atomically, a manifest that makes `--resume` exact.

A Parquet OUTPUT is a directory of `part-NNNNN.parquet` shards (columns `id`, `embedding` as a
fixed-size list of float32, or of int8/uint8 with --precision, `text` with --keep-text) and `_manifest.json`. Shard k holds the k-th run of
`shard_rows` embedded rows in input order, so shard boundaries depend only on the input and the settings.
Each shard is written to a hidden temporary file and renamed into place, and only then recorded in the
manifest (itself replaced atomically): a killed run leaves whole shards or nothing, and `--resume`
recomputes exactly the shards the manifest lacks. A SIGINT/SIGTERM that arrives during a shard's
commit waits until the manifest records it (`signals.commit`). A `.npy` OUTPUT keeps its shards in `OUTPUT.shards/`
and is assembled from them (through a temporary file, then renamed) when every shard is done.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from .signals import commit

MANIFEST = "_manifest.json"  # "_": Parquet readers of the directory skip it
VERSION = 1


# The columns are built from their buffers, not with `pa.array`: its first call imports pandas (~0.15 s, once a
# process, a few percent of embedding a few thousand texts) to ask whether the values are pandas objects.
def _numbers(values: np.ndarray):
    """A 1-D numpy array (no nulls) as an Arrow array of its type, sharing its memory."""
    import pyarrow as pa

    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def _strings(values: list[str]):
    """Python strings as an Arrow `string` array (int32 offsets: a shard holds far less than 2 GiB of text)."""
    import pyarrow as pa

    data = [v.encode("utf-8") for v in values]
    offsets = np.zeros(len(data) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in data], out=offsets[1:])
    if offsets[-1] >= 2**31:
        return pa.array(values, type=pa.string())
    return pa.StringArray.from_buffers(len(data), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(data)))


class OutputError(ValueError):
    """The output location cannot be used as asked (exists without --resume, other settings)."""


def _tmp_name(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.tmp")


def _write_tmp(path: str, write) -> str:
    """write(tmp_path) for `path`'s temporary file, removed again if writing fails or is interrupted."""
    tmp = _tmp_name(path)
    try:
        write(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return tmp


# Snappy saves float vectors almost no bytes for much more write time; ids and texts keep it. Nor a dictionary for the
# vectors: Parquet's writer would build one per column chunk until it outgrows its page (a float vector repeats no
# value) and then write them plain anyway.
COMPRESSION = {"id": "snappy", "embedding": "none", "text": "snappy"}
DICTIONARY = ["id", "text"]


def _atomic_write(path: str, write) -> None:
    """write(tmp_path) then rename over `path`: readers see the old file or the whole new one."""
    os.replace(_write_tmp(path, write), path)


def _shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


class ShardWriter:
    """Shards of one job in `directory`; settings (a JSON-able dict) must match on --resume."""

    def __init__(self, output: str, settings: dict, resume: bool = False):
        try:  # here, not at the first shard: without the extra a run fails before it embeds anything
            import pyarrow.parquet  # noqa: F401
        except ImportError as e:
            raise OutputError(f"bertfast embed writes Parquet shards, which needs pyarrow ({e}): "
                              "pip install 'bertfast[embed]'") from None
        self.npy = output.endswith(".npy")
        self.output = output
        self.directory = output + ".shards" if self.npy else output
        self.settings = settings
        self.shards: dict[int, dict] = {}
        self.complete = False
        manifest = os.path.join(self.directory, MANIFEST)
        if self.npy and os.path.exists(output):
            if not resume:
                raise OutputError(f"{output} exists: remove it, or pass --resume to keep it")
            self.complete = True
            return
        if os.path.isfile(manifest):
            if not resume:
                raise OutputError(f"{self.directory} holds an earlier embed run ({MANIFEST}): pass --resume "
                                  "to finish it, or choose another OUTPUT")
            self._load(manifest)
        elif os.path.isdir(self.directory) and os.listdir(self.directory):
            raise OutputError(f"{self.directory} exists and is not an embed output (no {MANIFEST}): "
                              "choose an empty or new directory")
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):  # leftovers of a killed write
            if name.startswith(".") and name.endswith(".tmp"):
                os.remove(os.path.join(self.directory, name))
        if not self.shards:
            self._save()

    def _load(self, path: str) -> None:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        before = manifest.get("settings", {})
        differ = sorted(k for k in set(before) | set(self.settings) if before.get(k) != self.settings.get(k))
        if differ:
            details = "; ".join(f"{k}: {before.get(k)!r} then, {self.settings.get(k)!r} now" for k in differ)
            raise OutputError(f"cannot resume {self.directory}: it was written with other settings ({details})")
        self.shards = {int(k): v for k, v in manifest.get("shards", {}).items()
                       if os.path.isfile(os.path.join(self.directory, v["file"]))}
        self.complete = bool(manifest.get("complete")) and not self.npy

    def _save(self, shards: dict | None = None) -> None:
        shards = self.shards if shards is None else shards
        manifest = {"version": VERSION, "settings": self.settings, "complete": self.complete,
                    "shards": {str(k): v for k, v in sorted(shards.items())}}

        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1)

        _atomic_write(os.path.join(self.directory, MANIFEST), write)

    def done(self, index: int) -> bool:
        return self.complete or index in self.shards

    def open(self, index: int) -> ShardFile:
        """Shard `index`, to be written a part at a time (`ShardFile`)."""
        return ShardFile(self, index)

    def finish(self) -> str:
        """Mark the job complete (a .npy OUTPUT: assemble it, then drop the shards); returns OUTPUT."""
        if self.complete:
            return self.output
        if self.npy:
            tmp = self._assemble()  # interruptible: a stop here leaves the shards, not a partial .npy
            with commit():
                os.replace(tmp, self.output)
                shutil.rmtree(self.directory)
        else:
            self.complete = True
            self._save()
        return self.output

    def _assemble(self) -> str:
        """The shards, in order, into OUTPUT's temporary file; returns its path."""
        import pyarrow.parquet as pq

        order = sorted(self.shards)
        if order != list(range(len(order))):
            raise OutputError(f"{self.directory}: shards {order} are not contiguous from 0")
        files = [os.path.join(self.directory, self.shards[k]["file"]) for k in order]
        rows = sum(self.shards[k]["rows"] for k in order)
        field = pq.ParquetFile(files[0]).schema_arrow.field("embedding").type if files else None
        dim = field.list_size if files else 0
        dtype = field.value_type.to_pandas_dtype() if files else np.float32

        def write(tmp):
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(rows, dim))
            start = 0
            for path in files:  # one shard in memory at a time
                column = pq.read_table(path, columns=["embedding"]).column("embedding").combine_chunks()
                block = column.values.to_numpy().reshape(-1, dim)
                out[start:start + len(block)] = block
                start += len(block)
            out.flush()
            del out

        return _write_tmp(self.output, write)


def _table(ids: list, embeddings: np.ndarray, texts: list[str] | None):
    import pyarrow as pa

    dim = embeddings.shape[1]
    ids_int = bool(ids) and isinstance(ids[0], int)
    columns = {"id": _numbers(np.asarray(ids, dtype=np.int64)) if ids_int else _strings(ids),
               "embedding": pa.FixedSizeListArray.from_arrays(
                   _numbers(np.ascontiguousarray(embeddings).reshape(-1)), dim)}
    if texts is not None:
        columns["text"] = _strings(texts)
    return pa.table(columns)


class ShardFile:
    """One shard written as its parts come back (a Parquet row group each: the job appends each chunk's rows, so a
    finished shard costs only its footer and rename, and the job holds no shard's vectors): appended to a hidden
    temporary file, which `commit` renames into place and records in the manifest; `discard` (or a failed append)
    removes it. Every part has the same columns (ids of one kind, one embedding dtype and width)."""

    def __init__(self, writer: ShardWriter, index: int):
        self.writer, self.index = writer, index
        self.name = _shard_name(index)
        self.path = os.path.join(writer.directory, self.name)
        self.tmp = _tmp_name(self.path)
        self.rows = 0
        self._out = None

    def append(self, ids: list, embeddings: np.ndarray, texts: list[str] | None = None) -> None:
        """The next rows: ids (int or str, one kind), embeddings (N, D) float32 (or int8/uint8: quantized), texts
        or None."""
        import pyarrow.parquet as pq

        table = _table(ids, embeddings, texts)
        try:
            if self._out is None:
                self._out = pq.ParquetWriter(self.tmp, table.schema, compression=COMPRESSION,
                                             use_dictionary=[c for c in DICTIONARY if c in table.column_names])
            self._out.write_table(table)
        except BaseException:
            self.discard()
            raise
        self.rows += len(embeddings)

    def commit(self) -> None:
        """Close the file, rename it into place, record it in the manifest."""
        try:
            self._out.close()
        except BaseException:
            self.discard()
            raise
        self._out = None
        writer = self.writer
        with commit():  # a SIGINT/SIGTERM waits until the shard is in place and recorded
            os.replace(self.tmp, self.path)
            shards = {**writer.shards, self.index: {"file": self.name, "rows": self.rows}}
            writer._save(shards)
            writer.shards = shards  # what the manifest on disk records, also when saving it failed

    def discard(self) -> None:
        """Drop the temporary file (an interrupted or failed shard): nothing of it is recorded."""
        out, self._out = self._out, None
        if out is not None:
            try:
                out.close()
            except Exception:  # noqa: BLE001 - the file goes either way
                pass
        if os.path.exists(self.tmp):
            os.remove(self.tmp)
