"""`bertfast embed` stopped for real: `python -m bertfast embed` in a subprocess, killed (SIGKILL) or
stopped (SIGINT to its process group, as Ctrl-C sends it; SIGTERM) once a few shards are committed, then
finished with `--resume`. The result must equal an uninterrupted run's output exactly (ids, texts,
vectors), with no id twice or missing, and the shards committed before the stop left untouched (same
inode, same mtime: not recomputed). A signal must stop the command cleanly: exit status 128 + signal, a
message instead of a traceback, only committed shards on disk and a manifest that records each.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import corpus

import pyarrow as pa
from pyarrow import parquet as pq

from bertfast.tools.cli import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = corpus(1200, seed=7)
SHARD_ROWS = 10  # 120 shards: several are committed within a second, the whole run takes many more
STOP_AFTER = 3  # committed shards before the stop
DEADLINE = 120  # seconds for any one wait: generous for a loaded 2-core machine, still bounded


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed_interrupt") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    return path


def argv(source, out, model):
    return [str(source), str(out), "--model", model, "--backend", "cpu", "--shard-rows", str(SHARD_ROWS),
            "--keep-text"]


@pytest.fixture(scope="module")
def clean(source, tiny_text_model, tmp_path_factory):
    """The uninterrupted run's output, read back."""
    out = tmp_path_factory.mktemp("clean") / "out"
    assert main(["embed", *argv(source, out, tiny_text_model)]) == 0
    return pq.read_table(out)


def manifest(out) -> dict:
    return json.loads((out / "_manifest.json").read_text())


def start(source, out, model) -> subprocess.Popen:
    """`python -m bertfast embed` in its own session (its own process group, as a shell job has)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "bertfast", "embed", *argv(source, out, model)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for_shards(proc, out, count: int) -> None:
    """Until the manifest records `count` shards (the job is under way, not finished)."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        try:
            if len(manifest(out)["shards"]) >= count:
                return
        except (OSError, ValueError):  # not written yet
            pass
        if proc.poll() is not None:
            pytest.fail(f"bertfast embed exited ({proc.returncode}) before {count} shards: {proc.stderr.read()}")
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"no {count} committed shards within {DEADLINE} s")


def committed(out) -> dict:
    """Shard file -> (inode, mtime) for every shard the manifest records."""
    files = [s["file"] for s in manifest(out)["shards"].values()]
    return {f: (os.stat(out / f).st_ino, os.stat(out / f).st_mtime_ns) for f in files}


def resume_and_compare(source, out, model, clean, before: dict, capsys) -> None:
    """--resume finishes the run: the output equals the clean one, the shards in `before` untouched."""
    done_rows = sum(s["rows"] for s in manifest(out)["shards"].values())
    assert main(["embed", *argv(source, out, model), "--resume", "--progress"]) == 0
    captured = capsys.readouterr()
    assert f"resumed: {done_rows} texts were already embedded" in captured.out
    # the bar counts this run's work only: the resumed rows left its total
    assert f"{len(TEXTS) - done_rows}/{len(TEXTS) - done_rows} [" in captured.err
    assert {f: stat for f, stat in committed(out).items() if f in before} == before
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]
    got = pq.read_table(out)
    ids = got.column("id").to_pylist()
    assert ids == list(range(len(TEXTS)))  # no duplicate, no gap, in order
    assert got.equals(clean)  # ids, texts and every vector bit


def test_sigkill_then_resume(source, tiny_text_model, clean, tmp_path, capsys):
    out = tmp_path / "out"
    proc = start(source, out, tiny_text_model)
    wait_for_shards(proc, out, STOP_AFTER)
    proc.kill()
    proc.communicate(timeout=DEADLINE)
    state = manifest(out)
    assert not state["complete"] and len(state["shards"]) < len(TEXTS) // SHARD_ROWS
    before = committed(out)
    resume_and_compare(source, out, tiny_text_model, clean, before, capsys)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_cleanly_then_resume(source, tiny_text_model, clean, tmp_path, capsys, signum):
    out = tmp_path / "out"
    proc = start(source, out, tiny_text_model)
    wait_for_shards(proc, out, STOP_AFTER)
    os.killpg(proc.pid, signum)  # the whole group, as Ctrl-C in a shell (or a job scheduler's stop) does
    _, err = proc.communicate(timeout=DEADLINE)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err
    state = manifest(out)
    shards, rows = len(state["shards"]), sum(s["rows"] for s in state["shards"].values())
    assert not state["complete"] and STOP_AFTER <= shards < len(TEXTS) // SHARD_ROWS
    assert re.search(rf"bertfast embed: error: interrupted by {name}: {shards} shard\(s\) \({rows} texts\) are "
                     rf"committed in .*; run the same command with --resume to finish", err), err
    assert "Traceback" not in err
    # only committed shards: every file is one the manifest records (no stray shard, no temporary file)
    assert sorted(os.listdir(out)) == sorted([s["file"] for s in state["shards"].values()] + ["_manifest.json"])
    assert sorted(map(int, state["shards"])) == list(range(shards))
    before = committed(out)
    resume_and_compare(source, out, tiny_text_model, clean, before, capsys)
