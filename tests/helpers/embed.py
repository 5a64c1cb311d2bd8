"""`bertfast embed` in the tests: the command run in-process, its inputs written and its Parquet output read back,
and a LoRA adapter drawn for a model directory."""

from __future__ import annotations

import csv
import json

import pyarrow as pa
from pyarrow import parquet as pq

from bertfast.tools.cli import main


def embed(*argv) -> int:
    """`bertfast embed ARGV` in this process: its exit status."""
    return main(["embed", *map(str, argv)])


def read_output(directory) -> dict:
    """Shards in order -> {'id': list, 'embedding': (N, D) float32, 'text': list or None}."""
    manifest = json.loads((directory / "_manifest.json").read_text())
    assert manifest["complete"]
    files = [manifest["shards"][k]["file"] for k in sorted(manifest["shards"], key=int)]
    assert files == sorted(p.name for p in directory.glob("part-*.parquet"))
    table = pa.concat_tables([pq.read_table(directory / f) for f in files])
    dim = table.schema.field("embedding").type.list_size
    emb = table.column("embedding").combine_chunks().values.to_numpy().reshape(-1, dim)
    return {"id": table.column("id").to_pylist(), "embedding": emb,
            "text": table.column("text").to_pylist() if "text" in table.column_names else None}


def write_input(path, texts, ids=None):
    """texts (and ids) as a .txt/.jsonl/.csv/.parquet file, by path's suffix."""
    ids = list(range(len(texts))) if ids is None else ids
    suffix = path.suffix
    if suffix == ".txt":
        path.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps({"doc": i, "text": t}) + "\n" for i, t in zip(ids, texts)),
                        encoding="utf-8")
    elif suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["doc", "text"])
            w.writerows(zip(ids, texts))
    else:
        pq.write_table(pa.table({"doc": ids, "text": texts}), path, row_group_size=37)
    return path


def lora_dir(model_dir: str, path, seed: int = 0) -> str:
    """A rank-4 LoRA on every linear of the BERT in `model_dir` (both factors random), saved by PEFT to `path`."""
    import transformers

    from helpers.adapters import ALL_BERT, save_lora

    save_lora(transformers.BertModel.from_pretrained(model_dir), path, seed, r=4, lora_alpha=8,
              target_modules=ALL_BERT)
    return str(path)


__all__ = ["embed", "read_output", "write_input", "lora_dir"]


def interrupt_at_commit(monkeypatch, call: int = 2) -> None:
    """Make the `call`-th shard commit of the next run raise KeyboardInterrupt (as a Ctrl-C there would); the run
    before it commits what it has. `monkeypatch.undo()` restores the writer."""
    from bertfast.tools.embed import writer

    original, calls = writer.ShardFile.commit, {"n": 0}

    def dying(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt("killed")
        return original(self, *a, **k)

    monkeypatch.setattr(writer.ShardFile, "commit", dying)
