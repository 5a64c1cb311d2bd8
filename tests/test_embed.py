"""`bertfast embed`: every input format, ids, bad rows, resume after a failure, .npy, clear errors.

The output must equal `Encoder.encode` on the same texts bit for bit (cpu backend: the engine is
batch-invariant), whatever the shards, chunks and token budgets. A random 2-layer model with the default
model's tokenizer keeps the file fast; one test runs the default model itself.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from pyarrow import parquet as pq

from conftest import corpus
from helpers.embed import embed, interrupt_at_commit, read_output, write_input


from bertfast import Encoder  # noqa: E402
from bertfast.tokenization import token_budget_batches  # noqa: E402
from bertfast.tools.embed import writer as writer_module  # noqa: E402

TEXTS = corpus(150)


@pytest.fixture(scope="module")
def encoder(tiny_text_model):
    return Encoder.from_pretrained(tiny_text_model, backend="cpu")


@pytest.fixture(scope="module")
def expected(encoder):
    return encoder.encode(TEXTS, convert_to_numpy=True)


def test_token_budget_batches():
    lengths = [3, 9, 1, 5, 5, 2, 9]
    batches = token_budget_batches(lengths, 10)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 10
    assert [lengths[b[0]] for b in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)
    assert token_budget_batches([50, 4], 10) == [[0], [1]]  # over budget: alone
    with pytest.raises(ValueError, match="batch_tokens"):
        token_budget_batches([1], 0)


def test_encode_batch_tokens_is_bitwise(encoder, expected):
    for budget in (64, 700, 100000):
        assert np.array_equal(encoder.encode(TEXTS, batch_tokens=budget, convert_to_numpy=True), expected)
    seen = []
    for rows, tokens, vectors in encoder.encode_batches(TEXTS[:20], batch_tokens=128):
        assert tokens > 0 and vectors.shape == (len(rows), encoder.embedding_dim())
        seen += rows
    assert sorted(seen) == list(range(20))


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".csv", ".parquet"])
def test_formats(tmp_path, tiny_text_model, expected, suffix):
    ids = [f"doc-{i}" for i in range(len(TEXTS))] if suffix != ".parquet" else [10 * i for i in range(len(TEXTS))]
    src = write_input(tmp_path / f"corpus{suffix}", TEXTS, ids)
    extra = [] if suffix == ".txt" else ["--id-column", "doc"]
    assert embed(src, tmp_path / "out", "--model", tiny_text_model, "--keep-text", "--shard-rows", 40,
                 "--batch-tokens", 300, *extra) == 0
    out = read_output(tmp_path / "out")
    assert len(list((tmp_path / "out").glob("part-*.parquet"))) == 4
    assert out["id"] == (list(range(len(TEXTS))) if suffix == ".txt" else ids)
    assert out["text"] == TEXTS
    assert out["embedding"].dtype == np.float32
    assert np.array_equal(out["embedding"], expected)


def test_directory_and_glob(tmp_path, tiny_text_model, expected):
    (tmp_path / "in").mkdir()
    write_input(tmp_path / "in" / "a.jsonl", TEXTS[:60])
    write_input(tmp_path / "in" / "b.csv", TEXTS[60:100])
    write_input(tmp_path / "in" / "c.parquet", TEXTS[100:])
    (tmp_path / "in" / "notes.md").write_text("not an input")
    assert embed(tmp_path / "in", tmp_path / "dir", "--model", tiny_text_model) == 0
    out = read_output(tmp_path / "dir")
    assert out["id"] == list(range(len(TEXTS))) and out["text"] is None
    assert np.array_equal(out["embedding"], expected)
    assert embed(tmp_path / "in" / "*.jsonl", tmp_path / "glob", "--model", tiny_text_model) == 0
    assert np.array_equal(read_output(tmp_path / "glob")["embedding"], expected[:60])


def test_overrides_match_encode(tmp_path, tiny_text_model, encoder):
    src = write_input(tmp_path / "c.txt", TEXTS[:30])
    assert embed(src, tmp_path / "out", "--model", tiny_text_model, "--pooling", "cls,max", "--normalize",
                 "--prompt", "query: ", "--truncate-dim", 100) == 0
    want = encoder.encode(TEXTS[:30], pooling=("cls", "max"), normalize=True, prompt="query: ",
                          truncate_dim=100, convert_to_numpy=True)
    assert want.shape == (30, 100)
    assert np.array_equal(read_output(tmp_path / "out")["embedding"], want)


def test_int8(tmp_path, tiny_text_model):
    src = write_input(tmp_path / "c.txt", TEXTS[:40])
    assert embed(src, tmp_path / "out", "--model", tiny_text_model, "--dtype", "int8", "--backend", "cpu") == 0
    want = Encoder.from_pretrained(tiny_text_model, backend="cpu", dtype="int8").encode(
        TEXTS[:40], convert_to_numpy=True)
    assert np.array_equal(read_output(tmp_path / "out")["embedding"], want)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_each_tier_and_dtype_equals_encode(isa, tmp_path, tiny_text_model, dtype):
    # Batches of up to 2048 tokens against 64: each text's vector is computed inside batches of other sizes and
    # neighbours than encode gives it, past every row count where a GEMM once left the extension.
    src = write_input(tmp_path / "c.txt", TEXTS[:60])
    for budget in (2048, 64):
        out = tmp_path / f"out{budget}"
        assert embed(src, out, "--model", tiny_text_model, "--dtype", dtype, "--backend", "cpu",
                     "--batch-tokens", budget, "--no-progress") == 0
        want = Encoder.from_pretrained(tiny_text_model, backend="cpu", dtype=dtype).encode(
            TEXTS[:60], convert_to_numpy=True)
        assert np.array_equal(read_output(out)["embedding"], want), f"{dtype}, --batch-tokens {budget}"


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
def test_precision_equals_quantized_encode(tmp_path, tiny_text_model, expected, precision):
    from bertfast import quantization_ranges, quantize_embeddings

    src = write_input(tmp_path / "c.txt", TEXTS[:50])
    extra = []
    ranges = None
    if precision.endswith("int8"):
        ranges = quantization_ranges(expected[:20])  # from a sample: the rest falls outside now and then (clips)
        np.save(tmp_path / "ranges.npy", ranges)
        extra = ["--ranges", tmp_path / "ranges.npy"]
    want = quantize_embeddings(expected[:50], precision, ranges)
    for out in (tmp_path / "out", tmp_path / "out.npy"):
        assert embed(src, out, "--model", tiny_text_model, "--precision", precision, "--shard-rows", 16,
                     "--batch-tokens", 256, "--no-progress", *extra) == 0
        got = np.load(out) if out.suffix == ".npy" else read_output(out)["embedding"]
        assert got.dtype == want.dtype and np.array_equal(got, want), out.name


def test_precision_errors(tmp_path, tiny_text_model, capsys):
    src = write_input(tmp_path / "c.txt", TEXTS[:5])
    assert embed(src, tmp_path / "a", "--model", tiny_text_model, "--precision", "int8") == 2
    assert "--precision int8 needs --ranges FILE.npy" in capsys.readouterr().err
    np.save(tmp_path / "r.npy", np.zeros((2, 64), dtype=np.float32))
    assert embed(src, tmp_path / "b", "--model", tiny_text_model, "--ranges", tmp_path / "r.npy") == 2
    assert "--ranges applies to --precision int8 or uint8, not float32" in capsys.readouterr().err
    np.save(tmp_path / "bad.npy", np.zeros((3, 64), dtype=np.float32))
    assert embed(src, tmp_path / "c", "--model", tiny_text_model, "--precision", "uint8", "--ranges",
                 tmp_path / "bad.npy") == 2
    assert "need a (2, D) float array" in capsys.readouterr().err
    assert embed(src, tmp_path / "d", "--model", tiny_text_model, "--precision", "binary", "--no-progress") == 0
    capsys.readouterr()
    assert embed(src, tmp_path / "d", "--model", tiny_text_model, "--resume", "--no-progress") == 2
    assert "precision: 'binary' then, 'float32' now" in capsys.readouterr().err


def test_default_model(tmp_path, minilm_path):
    src = write_input(tmp_path / "c.txt", TEXTS[:12])
    assert embed(src, tmp_path / "out.npy") == 0
    want = Encoder.from_pretrained(minilm_path).encode(TEXTS[:12], convert_to_numpy=True)
    assert np.array_equal(np.load(tmp_path / "out.npy"), want)


BAD_JSONL = [
    {"doc": "a", "text": TEXTS[0]},
    {"doc": "b", "body": "no text column"},
    {"doc": "c", "text": 17},
    {"doc": "d", "text": "   "},
    "not json {",
    {"doc": "e", "text": None},
    [1, 2],
    {"text": "no id"},
    {"doc": 5, "text": "an int id after string ids"},
    {"doc": "f", "text": TEXTS[1]},
    {"doc": "g", "text": "a lone \ud800 surrogate"},  # json.dumps escapes it; json.loads gives it back
]


def write_bad(directory):
    directory.mkdir()
    lines = [r if isinstance(r, str) else json.dumps(r) for r in BAD_JSONL]
    (directory / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (directory / "b.csv").write_text("")  # an empty file
    return directory


def test_bad_rows_counted(tmp_path, tiny_text_model, encoder, capsys):
    src = write_bad(tmp_path / "in")
    assert embed(src, tmp_path / "out", "--model", tiny_text_model, "--id-column", "doc", "--keep-text") == 0
    report = capsys.readouterr().out
    assert "skipped 9 bad rows and 1 unreadable or empty files" in report
    assert re.search(r"embedded 2 texts .*; peak RSS of this process [1-9][0-9]* MiB", report), report
    for reason in ("a.jsonl:2: missing column 'text'", "a.jsonl:3: column 'text' is int, not a string",
                   "a.jsonl:4: column 'text' is empty", "a.jsonl:5: invalid JSON", "column 'text' is null",
                   "a.jsonl:7: not a JSON object", "a.jsonl:8: missing id column 'doc'",
                   "a.jsonl:9: id is int, but earlier ids are str", "b.csv: empty file",
                   "a.jsonl:11: column 'text' is not valid Unicode (a lone surrogate)"):
        assert reason in report, reason
    out = read_output(tmp_path / "out")
    assert out["id"] == ["a", "f"] and out["text"] == TEXTS[:2]
    assert np.array_equal(out["embedding"], encoder.encode(TEXTS[:2], convert_to_numpy=True))
    # default ids are positions among all input rows: the gaps are the bad rows
    assert embed(src / "a.jsonl", tmp_path / "rows", "--model", tiny_text_model) == 0
    assert read_output(tmp_path / "rows")["id"] == [0, 7, 8, 9]


def test_strict_stops_at_first_bad_row(tmp_path, tiny_text_model, capsys):
    src = write_bad(tmp_path / "in")
    assert embed(src, tmp_path / "out", "--model", tiny_text_model, "--strict") == 1
    err = capsys.readouterr().err
    assert "bad row (--strict)" in err and "a.jsonl:2: missing column 'text'" in err


@pytest.mark.parametrize("where", ["shard", "manifest"])
def test_resume_after_failure(tmp_path, tiny_text_model, expected, monkeypatch, capsys, where):
    """A run dies after two shards (writing the third shard, or after renaming it but before the manifest
    records it); --resume finishes with the output of an uninterrupted run and embeds only what is left."""
    src = write_input(tmp_path / "c.jsonl", TEXTS)
    args = [src, tmp_path / "out", "--model", tiny_text_model, "--shard-rows", 30, "--keep-text"]
    target = "write_table" if where == "shard" else "_save"
    owner = pq.ParquetWriter if where == "shard" else writer_module.ShardWriter
    calls = {"n": 0}
    original = getattr(owner, target)
    fatal_call = 3 if where == "shard" else 4  # a shard's rows come in one part here; _save runs once at the start

    def dying(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == fatal_call:
            if where == "shard":  # die half-way through the temporary file
                open(self.where, "ab").write(b"PAR1 torn")
            raise KeyboardInterrupt("killed")
        return original(self, *a, **k)

    monkeypatch.setattr(owner, target, dying)
    assert embed(*args) == 130  # a KeyboardInterrupt: reported as Ctrl-C, with what is committed
    assert "interrupted by SIGINT: 2 shard(s) (60 texts) are committed" in capsys.readouterr().err
    monkeypatch.undo()
    done = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert sorted(done["shards"]) == ["0", "1"] and not done["complete"]
    assert embed(*args) == 2  # OUTPUT exists: --resume or another OUTPUT
    assert "--resume" in capsys.readouterr().err
    assert embed(*args, "--resume") == 0
    assert "resumed: 60 texts were already embedded" in capsys.readouterr().out
    out = read_output(tmp_path / "out")
    assert out["id"] == list(range(len(TEXTS))) and out["text"] == TEXTS
    assert np.array_equal(out["embedding"], expected)
    assert not [p for p in os.listdir(tmp_path / "out") if p.endswith(".tmp")]
    assert embed(*args, "--resume") == 0  # complete: nothing to do
    assert "already complete" in capsys.readouterr().out


def test_resume_with_other_settings_fails(tmp_path, tiny_text_model, capsys):
    src = write_input(tmp_path / "c.txt", TEXTS[:20])
    assert embed(src, tmp_path / "out", "--model", tiny_text_model) == 0
    capsys.readouterr()
    assert embed(src, tmp_path / "out", "--model", tiny_text_model, "--resume", "--pooling", "cls") == 2
    assert "other settings (pooling: None then, ['cls'] now)" in capsys.readouterr().err


def test_npy_output_and_resume(tmp_path, tiny_text_model, expected, monkeypatch):
    src = write_input(tmp_path / "c.csv", TEXTS)
    out = tmp_path / "emb.npy"
    args = [src, out, "--model", tiny_text_model, "--shard-rows", 50]
    interrupt_at_commit(monkeypatch)
    assert embed(*args) == 130
    monkeypatch.undo()
    assert not out.exists() and (tmp_path / "emb.npy.shards" / "part-00000.parquet").exists()
    assert embed(*args, "--resume") == 0
    emb = np.load(out)
    assert emb.dtype == np.float32 and np.array_equal(emb, expected)
    assert not (tmp_path / "emb.npy.shards").exists()
    assert embed(*args) == 2  # exists
    assert embed(*args, "--resume") == 0


@pytest.mark.parametrize("argv, message", [
    (["{missing}", "{out}"], "does not exist"),
    (["{bad_suffix}", "{out}"], "unsupported format"),
    (["{empty_dir}", "{out}"], "holds no .txt"),
    (["{txt}", "{out}", "--id-column", "doc"], ".txt inputs have no columns"),
    (["{jsonl}", "{out}.npy", "--id-column", "doc"], "need Parquet output"),
    (["{txt}", "{out}", "--batch-tokens", "0"], "--batch-tokens must be >= 1"),
    (["{txt}", "{out}", "--shard-rows", "-3"], "--shard-rows must be >= 1"),
    (["{txt}", "{out}", "--pooling", "mean,median"], "unknown pooling mode 'median'"),
    (["{txt}", "{out}", "--dtype", "fp4"], "dtype 'fp4' is not supported"),
    (["{txt}", "{out}", "--dtype", "fp8"], "no backend is available for device 'cpu' with 'fp8' quantization"),
    (["{txt}", "{bad_suffix}"], "is a file"),
    (["{txt}", "{not_empty}"], "is not an embed output"),
    (["{txt}", "{out}", "--prompt-name", "nope"], "prompt name 'nope'"),
], ids=["missing", "suffix", "empty-dir", "txt-id", "npy-id", "batch-tokens", "shard-rows", "pooling",
        "dtype", "dtype-fp8-cpu", "output-file", "output-not-empty", "prompt-name"])
def test_clear_errors(tmp_path, tiny_text_model, capsys, argv, message):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "not_empty").mkdir()
    (tmp_path / "not_empty" / "x").write_text("x")
    (tmp_path / "bad.xml").write_text("<a/>")
    paths = dict(missing=tmp_path / "nope.txt", bad_suffix=tmp_path / "bad.xml", empty_dir=tmp_path / "empty_dir",
                 txt=write_input(tmp_path / "c.txt", TEXTS[:3]), jsonl=write_input(tmp_path / "c.jsonl", TEXTS[:3]),
                 out=tmp_path / "out", not_empty=tmp_path / "not_empty")
    code = embed(*[a.format(**paths) for a in argv], "--model", tiny_text_model)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("bertfast embed: error:"), err


def test_without_pyarrow_fails_before_embedding(tmp_path, tiny_text_model, capsys, monkeypatch):
    """Without the embed extra (pyarrow) the run stops at the start with the install command, not after a shard's
    worth of embedding."""
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # `import pyarrow.parquet` raises ImportError
    code = embed(write_input(tmp_path / "c.txt", TEXTS[:3]), tmp_path / "out", "--model", tiny_text_model)
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'bertfast[embed]'" in err and "embedding" not in err, err
    assert not (tmp_path / "out").exists()


def test_nothing_to_embed(tmp_path, tiny_text_model, capsys):
    src = write_input(tmp_path / "c.csv", TEXTS[:5])
    assert embed(src, tmp_path / "out", "--model", tiny_text_model, "--column", "body") == 1
    captured = capsys.readouterr()
    assert "no column 'body' (columns: doc, text)" in captured.out and "no texts to embed" in captured.err


def test_bad_arguments_exit_nonzero():
    with pytest.raises(SystemExit) as e:
        embed("--no-such-flag")
    assert e.value.code == 2


@pytest.mark.parametrize("ids", [["ä-1", "", "中文 id"], [3, -1, 2**40]])
def test_shard_columns_round_trip_without_pandas(tmp_path, ids):
    """The writer builds its columns from their buffers: what a shard holds reads back the same (any Unicode, empty
    strings, int8 codes), and writing one does not import pandas (pyarrow's `pa.array` does, ~0.15 s)."""
    import subprocess
    import sys

    script = f"""
import sys, numpy as np, pyarrow.parquet as pq
from bertfast.tools.embed.writer import ShardWriter
vectors = np.arange(-6, 6, dtype=np.int8).reshape(3, 4)
w = ShardWriter({str(tmp_path / "out")!r}, {{}})
shard = w.open(0)
shard.append({ids!r}, vectors, ["naïve ☃", "", "x" * 1000])
shard.commit()
assert "pandas" not in sys.modules, "writing a shard imported pandas"
t = pq.read_table({str(tmp_path / "out" / "part-00000.parquet")!r}).to_pydict()
assert t["id"] == {ids!r}, t["id"]
assert t["text"] == ["naïve ☃", "", "x" * 1000], t["text"]
assert np.array_equal(np.array(t["embedding"], dtype=np.int8), vectors)
"""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_shard_written_in_parts(tmp_path):
    """A shard appended a part at a time (as the job appends each chunk) is one Parquet file, a row group a part, with
    the rows in order, recorded once committed; a discarded one leaves no file and no record."""
    import pyarrow.parquet as pq

    w = writer_module.ShardWriter(str(tmp_path / "out"), {})
    vectors = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    texts = [f"t{i}" for i in range(7)]
    shard = w.open(0)
    for lo, hi in ((0, 3), (3, 6), (6, 7)):
        shard.append(list(range(lo, hi)), vectors[lo:hi], texts[lo:hi])
        assert not (tmp_path / "out" / "part-00000.parquet").exists() and 0 not in w.shards
    shard.commit()
    path = tmp_path / "out" / "part-00000.parquet"
    assert pq.ParquetFile(path).num_row_groups == 3 and w.shards[0] == {"file": "part-00000.parquet", "rows": 7}
    t = pq.read_table(path).to_pydict()
    assert t["id"] == list(range(7)) and t["text"] == texts
    assert np.array_equal(np.array(t["embedding"], dtype=np.float32), vectors)
    dropped = w.open(1)
    dropped.append([7], vectors[:1])
    dropped.discard()
    assert sorted(os.listdir(tmp_path / "out")) == ["_manifest.json", "part-00000.parquet"] and 1 not in w.shards
