"""Ray: `bertfast.ray.Embedder` on Ray Data and `bertfast embed --ray` on a local 2-CPU cluster give the
single-process `bertfast embed` output bit for bit (cpu backend, fp32), row ids aligned; with `--adapter` every
actor loads the adapter, and one the actors cannot load stops the command before OUTPUT exists."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import pyarrow as pa
import ray
import ray.data  # noqa: F401

from conftest import corpus
from helpers.embed import lora_dir

from bertfast import Encoder  # noqa: E402
from bertfast.ray import Embedder  # noqa: E402
from bertfast.tools.cli import main  # noqa: E402

TEXTS = corpus(2000, seed=3)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, tiny_text_model):
    """The corpus as JSONL (ids "t0".."t1999") and the single-process embed output read back."""
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("embed_ray")
    src = root / "corpus.jsonl"
    src.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    out = root / "single"
    assert main(["embed", str(src), str(out), "--model", tiny_text_model, "--backend", "cpu",
                 "--id-column", "id", "--shard-rows", "700"]) == 0
    table = pq.read_table(out)  # the directory's shards, in name order
    return src, table


def _rows(table):
    emb = table.column("embedding").combine_chunks()
    return table.column("id").to_pylist(), emb.values.to_numpy().reshape(len(table), -1)


def test_ray_data_map_batches(cluster, single_process, tiny_text_model):
    _, table = single_process
    ids, want = _rows(table)
    ds = ray.data.from_items([{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS)], override_num_blocks=8)
    ds = ds.map_batches(Embedder, fn_constructor_kwargs=dict(model=tiny_text_model, backend="cpu"),
                        concurrency=2, batch_size=300)
    rows = ds.take_all()
    assert len(rows) == len(TEXTS)
    got = {r["id"]: (r["text"], np.asarray(r["embedding"], dtype=np.float32)) for r in rows}
    assert sorted(got) == sorted(ids)
    for i, row_id in enumerate(ids):
        text, vector = got[row_id]
        assert text == TEXTS[i] and vector.dtype == np.float32
        assert np.array_equal(vector, want[i]), row_id


def test_embed_cli_on_ray(cluster, single_process, tiny_text_model, tmp_path, capsys):
    import pyarrow.parquet as pq

    src, table = single_process
    assert main(["embed", str(src), str(tmp_path / "ray"), "--model", tiny_text_model, "--backend", "cpu",
                 "--id-column", "id", "--shard-rows", "700", "--ray", "--ray-actors", "2", "--progress"]) == 0
    got = pq.read_table(tmp_path / "ray")
    assert got.column("id").to_pylist() == table.column("id").to_pylist()
    assert got.equals(table)
    # the job's bar: texts/s (tqdm's rate), tokens/s, and the ETA (elapsed<remaining)
    bar = capsys.readouterr().err
    assert re.search(rf"{len(TEXTS)}/{len(TEXTS)} \[\d\d:\d\d<\d\d:\d\d, +[\d.]+text/s, \d+ tok/s, 0 bad\]", bar), bar
    assert "Running Dataset" not in bar and "Starting execution" not in bar  # Ray Data's own output stays out


def test_embed_cli_on_ray_with_adapter(cluster, single_process, tiny_text_model, tmp_path, capsys):
    import pyarrow.parquet as pq

    src, _ = single_process
    adapter = lora_dir(tiny_text_model, tmp_path / "lora", seed=1)
    common = [str(src), "--model", tiny_text_model, "--backend", "cpu", "--id-column", "id", "--shard-rows", "700",
              "--ray", "--ray-actors", "2"]
    assert main(["embed", *common[:1], str(tmp_path / "ray"), *common[1:], "--adapter", adapter]) == 0
    enc = Encoder.from_pretrained(tiny_text_model, backend="cpu")
    enc.load_adapter("a", adapter)
    _, got = _rows(pq.read_table(tmp_path / "ray"))
    assert np.array_equal(got, enc.encode(TEXTS, adapter="a", convert_to_numpy=True))
    capsys.readouterr()
    os.remove(os.path.join(adapter, "adapter_model.safetensors"))  # now a config without weights
    assert main(["embed", *common[:1], str(tmp_path / "bad"), *common[1:], "--adapter", adapter]) == 2
    err = capsys.readouterr().err
    assert f"an embedding actor did not start: bertfast.loading.LoadError: adapter directory {adapter} has no " \
           "adapter_model.safetensors" in err, err
    assert not (tmp_path / "bad").exists()


def write_mixed(directory):
    """Every input format, with the bad rows and files the readers count, in one directory: the rows a
    distributed read must reproduce exactly (positions as ids, so one row off shows)."""
    import pyarrow.parquet as pq

    directory.mkdir()
    texts = corpus(400, seed=9)
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in texts[:150]]
    # a raw U+2028 (valid JSON, a line break to str.splitlines) and escaped form feed and lone surrogate
    lines[10:10] = ['{"text": 17}', "not json {", '{"text": "a line\u2028separator, a \\u000c form feed"}',
                    '{"text": "a lone \\ud800 surrogate"}', '{"body": "no text column"}']
    (directory / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (directory / "b.csv").write_text("text\n42\n\"a quoted\nnewline\"\n\n" + "".join(
        f'"{t}"\n' for t in texts[150:250]), encoding="utf-8")
    for k in range(2):  # several files and row groups: rows must keep their files' order
        pq.write_table(pa.table({"text": texts[250 + 60 * k:310 + 60 * k]}), directory / f"c{k}.parquet",
                       row_group_size=17)
    pq.write_table(pa.table({"text": ["fine", None, "   "]}), directory / "c2.parquet")
    pq.write_table(pa.table({"body": ["no text column"]}), directory / "c3.parquet")
    (directory / "d.csv").write_text("")
    (directory / "e.parquet").write_bytes(b"PAR1 not a parquet file")
    (directory / "f.txt").write_bytes(b"one\n\ntwo \xff\xfe invalid utf-8\nthree\x0cwith a form feed\n"
                                      + "\n".join(texts[370:]).encode() + b"\n")
    return directory


def test_ray_reads_like_the_single_process_job(cluster, tiny_text_model, tmp_path, capsys):
    """The same rows from Ray Data's read tasks as from the local readers: ids (row positions, bad rows
    included), texts, vectors, and the bad-row report, line numbers included."""
    import pyarrow.parquet as pq

    src = write_mixed(tmp_path / "in")
    common = ["--model", tiny_text_model, "--backend", "cpu", "--keep-text", "--shard-rows", "64"]
    assert main(["embed", str(src), str(tmp_path / "local"), *common]) == 0
    local = capsys.readouterr().out
    assert main(["embed", str(src), str(tmp_path / "ray"), *common, "--ray", "--ray-actors", "2"]) == 0
    remote = capsys.readouterr().out
    report = [line for line in local.splitlines() if not line.startswith(("embedded ", "wrote "))]
    assert "skipped 8 bad rows and 3 unreadable or empty files; the first 10:" in report
    assert report == [line for line in remote.splitlines() if not line.startswith(("embedded ", "wrote "))]
    want, got = pq.read_table(tmp_path / "local"), pq.read_table(tmp_path / "ray")
    # the 400 corpus texts and 6 more: "42", the quoted newline, the U+2028 line, "fine", "one", "three\f..."
    assert want.num_rows == 406 and "a line\u2028separator, a \x0c form feed" in want.column("text").to_pylist()
    assert got.equals(want)


def test_embedder_errors(tiny_text_model):
    embedder = Embedder(tiny_text_model, backend="cpu", column="body")
    with pytest.raises(ValueError, match="no column 'body'"):
        embedder({"text": np.array(["a"])})
    with pytest.raises(ValueError, match="text 1 is int"):
        embedder.embed(["a", 3])
