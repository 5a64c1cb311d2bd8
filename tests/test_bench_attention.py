"""benchmarks/bench_attention.py: every cap asked for gets a row per shape, dtype and thread count, with a time, a
rate and its output's difference from the first cap's (the kernels compute the same attention)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bertfast.backends.cpu import isa

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_attention.py")


@pytest.mark.skipif(not isa.supported_caps(), reason="bertfast._C is not built")
def test_rows_for_every_cap(tmp_path):
    caps = [c for c in ("portable", "avx2", "avx512_vnni") if c in isa.supported_caps()]
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--caps", ",".join(caps), "--shapes", "short", "--dtypes",
                           "fp32,bf16", "--threads", "1", "--rounds", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["cap"]) for r in rows] == [(d, c) for d in ("fp32", "bf16") for c in caps]
    for r in rows:
        assert r["us"] > 0 and r["gflops"] > 0 and r["calls_per_burst"] >= 3
        assert r["max_abs_diff_vs_first"] <= (1e-5 if r["dtype"] == "fp32" else 2e-2), r


def test_unknown_names_are_refused():
    proc = subprocess.run([sys.executable, SCRIPT, "--shapes", "huge"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown shape ['huge']" in proc.stderr
