"""benchmarks/bench_amx_probe.py: every probe of amx_probe.cpp runs on emulated tiles with its tiles inside its
buffers (AddressSanitizer where the compiler links it; the emulation aborts on a tile shape the hardware would
fault on), as many instructions as each round issues; the real build times every probe where the CPU has AMX and
reports the tiles missing where it has not. Nothing here depends on how fast the host ran."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

from bertfast.backends.cpu import isa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Instructions one round of each probe issues (multiply-adds, or tile loads for the load rows).
PER_ROUND = {"tdpbf16ps, 1 chain (latency)": 1, "tdpbf16ps, 2 chains": 2, "tdpbf16ps, 3 chains": 3,
             "tdpbf16ps, 4 chains": 4, "tdpbf16ps, 6 chains (rate)": 6, "tdpbssd, 1 chain (latency)": 1,
             "tdpbssd, 4 chains": 4, "tileloadd from L1 (per load)": 4, "tileloadd from L2, 1536 B rows (per load)": 2,
             "4 chains, B reloaded into one register": 4, "4 chains, B reloaded into two in turn": 4,
             "blocked 2x2 step: 4 loads, then 4 tdp (L1)": 4, "blocked 2x2 step: loads before first reader": 4,
             "blocked 2x2 step, A from L2": 4, "blocked 2x2 step, tdpbssd (L1)": 4, "blocked 2x1 step (L1)": 2}
# Rounds enough for every probe's addresses to go round: the L2 loads' 41 row blocks x 24 steps.
ROUNDS = 1000

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


def _probe():
    path = os.path.join(ROOT, "benchmarks", "bench_amx_probe.py")
    spec = importlib.util.spec_from_file_location("bench_amx_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_probe_runs_on_emulated_tiles():
    rows = _probe().run(emulated=True, rounds=ROUNDS)
    assert [r["probe"] for r in rows] == list(PER_ROUND)
    for r in rows:
        assert r["ran"] == ROUNDS * PER_ROUND[r["probe"]], r


def test_real_tiles_time_every_probe_or_are_missing():
    rows = _probe().run(seconds=0.02)
    if {"amx_tile", "amx_bf16", "amx_int8"} <= set(isa.cpu_info()["flags"]):
        assert [r["probe"] for r in rows] == list(PER_ROUND)
        assert all(r["ns"] > 0 and r["count"] > 0 for r in rows), rows
    else:
        assert rows == [{"probe": "AMX tiles", "missing": True}]
