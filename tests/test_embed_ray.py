"""Ray: `bertfast.ray.Embedder` on Ray Data and `bertfast embed --ray` on a local 2-CPU cluster give the
single-process `bertfast embed` output bit for bit (cpu backend, fp32), row ids aligned."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import corpus

ray = pytest.importorskip("ray", reason="the Ray tests need the package ray (the ray extra)")
pytest.importorskip("ray.data", reason="the Ray tests need ray[data]")
pa = pytest.importorskip("pyarrow", reason="bertfast embed needs pyarrow (the embed extra)")

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


def test_embed_cli_on_ray(cluster, single_process, tiny_text_model, tmp_path):
    import pyarrow.parquet as pq

    src, table = single_process
    assert main(["embed", str(src), str(tmp_path / "ray"), "--model", tiny_text_model, "--backend", "cpu",
                 "--id-column", "id", "--shard-rows", "700", "--ray", "--ray-actors", "2"]) == 0
    got = pq.read_table(tmp_path / "ray")
    assert got.column("id").to_pylist() == table.column("id").to_pylist()
    assert got.equals(table)


def test_embedder_errors(tiny_text_model):
    embedder = Embedder(tiny_text_model, backend="cpu", column="body")
    with pytest.raises(ValueError, match="no column 'body'"):
        embedder({"text": np.array(["a"])})
    with pytest.raises(ValueError, match="text 1 is int"):
        embedder.embed(["a", 3])
