"""`bertfast embed` stopped for real: `python -m bertfast embed` in a subprocess, killed (SIGKILL) or
stopped (SIGINT to its process group, as Ctrl-C sends it; SIGTERM) while it waits in the job's test hook right
after shard STOP_AFTER - 1 is committed (it tells the test over a socket, then blocks until the signal), so every
run stops at the same point; then finished with `--resume`. The output must be byte-identical to an uninterrupted
run's (every shard file and the manifest), with no id twice or missing, and the shards committed before the stop
left untouched (same inode, same mtime: not recomputed). A signal must stop the command cleanly: exit status
128 + signal, a message instead of a traceback, only committed shards on disk and a manifest that records each.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from conftest import corpus

import pyarrow as pa
from pyarrow import parquet as pq

from bertfast.tools.cli import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = corpus(1200, seed=7)
SHARD_ROWS = 10  # 120 shards
STOP_AFTER = 3  # committed shards before the stop
DEADLINE = 120  # seconds for any one wait: generous for a loaded 2-core machine, still bounded
# The child: `bertfast embed` (its arguments) whose job, once shard STOP_AFTER - 1 is committed, sends b"c" on the
# socket {fd} and waits reading it, so the test's signal finds it there (the socket's end lets it go on). It waits in
# 50 ms reads: a signal the kernel hands another of its threads interrupts no read of the main thread, whose handler
# then runs only when the main thread next runs Python.
CHILD = """
import socket, sys
from bertfast.tools.cli import main
from bertfast.tools.embed import job

sock = socket.socket(fileno={fd})

def stop_here(index):
    if index == {stop_after} - 1:
        sock.sendall(b"c")
        sock.settimeout(0.05)
        while True:
            try:
                sock.recv(1)
                break
            except TimeoutError:
                pass

job._test_hook = stop_here
sys.exit(main(sys.argv[1:]))
"""


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
    """The uninterrupted run's output directory."""
    out = tmp_path_factory.mktemp("clean") / "out"
    assert main(["embed", *argv(source, out, tiny_text_model)]) == 0
    return out


def manifest(out) -> dict:
    return json.loads((out / "_manifest.json").read_text())


def contents(out) -> dict:
    """File name -> bytes, every file of an output directory."""
    return {name: (out / name).read_bytes() for name in sorted(os.listdir(out))}


class Stopped:
    """`python -m bertfast embed` in its own session (its own process group, as a shell job has), held in the job's
    test hook once STOP_AFTER shards are committed (`CHILD`)."""

    def __init__(self, source, out, model):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        self.sock, theirs = socket.socketpair()
        self.sock.settimeout(DEADLINE)
        code = CHILD.format(fd=theirs.fileno(), stop_after=STOP_AFTER)
        self.proc = subprocess.Popen([sys.executable, "-c", code, "embed", *argv(source, out, model)], cwd=ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, pass_fds=(theirs.fileno(),))
        theirs.close()

    def wait_held(self) -> None:
        """Until the job waits in its hook with STOP_AFTER shards committed (DEADLINE s at most)."""
        try:
            got = self.sock.recv(1)
        except TimeoutError:
            self.proc.kill()
            pytest.fail(f"no {STOP_AFTER} committed shards within {DEADLINE} s")
        if got != b"c":
            _, err = self.proc.communicate(timeout=DEADLINE)
            pytest.fail(f"bertfast embed exited ({self.proc.returncode}) before {STOP_AFTER} shards: {err}")

    def finish(self) -> str:
        """Its stderr once it has exited (DEADLINE s at most)."""
        try:
            return self.proc.communicate(timeout=DEADLINE)[1]
        finally:
            self.sock.close()


def committed(out) -> dict:
    """Shard file -> (inode, mtime) for every shard the manifest records."""
    files = [s["file"] for s in manifest(out)["shards"].values()]
    return {f: (os.stat(out / f).st_ino, os.stat(out / f).st_mtime_ns) for f in files}


def resume_and_compare(source, out, model, clean, before: dict, capsys) -> None:
    """--resume finishes the run: the output is the clean one byte for byte, the shards in `before` untouched."""
    done_rows = sum(s["rows"] for s in manifest(out)["shards"].values())
    assert main(["embed", *argv(source, out, model), "--resume", "--progress"]) == 0
    captured = capsys.readouterr()
    assert f"resumed: {done_rows} texts were already embedded" in captured.out
    # the bar counts this run's work only: the resumed rows left its total
    assert f"{len(TEXTS) - done_rows}/{len(TEXTS) - done_rows} [" in captured.err
    assert {f: stat for f, stat in committed(out).items() if f in before} == before
    got = pq.read_table(out)
    assert got.column("id").to_pylist() == list(range(len(TEXTS)))  # no duplicate, no gap, in order
    want = contents(clean)
    assert contents(out).keys() == want.keys()  # no temporary file either
    assert [name for name, data in contents(out).items() if data != want[name]] == []


def test_sigkill_then_resume(source, tiny_text_model, clean, tmp_path, capsys):
    out = tmp_path / "out"
    job = Stopped(source, out, tiny_text_model)
    job.wait_held()
    job.proc.kill()
    job.finish()
    state = manifest(out)
    assert not state["complete"] and sorted(map(int, state["shards"])) == list(range(STOP_AFTER))
    before = committed(out)
    resume_and_compare(source, out, tiny_text_model, clean, before, capsys)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_cleanly_then_resume(source, tiny_text_model, clean, tmp_path, capsys, signum):
    out = tmp_path / "out"
    job = Stopped(source, out, tiny_text_model)
    job.wait_held()
    os.killpg(job.proc.pid, signum)  # the whole group, as Ctrl-C in a shell (or a job scheduler's stop) does
    err = job.finish()
    name = signal.Signals(signum).name
    assert job.proc.returncode == 128 + signum, err
    state = manifest(out)
    rows = STOP_AFTER * SHARD_ROWS
    assert not state["complete"] and sorted(map(int, state["shards"])) == list(range(STOP_AFTER))
    assert sum(s["rows"] for s in state["shards"].values()) == rows
    assert re.search(rf"bertfast embed: error: interrupted by {name}: {STOP_AFTER} shard\(s\) \({rows} texts\) "
                     rf"are committed in .*; run the same command with --resume to finish", err), err
    assert "Traceback" not in err
    # only committed shards: every file is one the manifest records (no stray shard, no temporary file)
    assert sorted(os.listdir(out)) == sorted([s["file"] for s in state["shards"].values()] + ["_manifest.json"])
    before = committed(out)
    resume_and_compare(source, out, tiny_text_model, clean, before, capsys)
