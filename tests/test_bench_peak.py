"""benchmarks/bench_peak.py: the ceiling loops build with the system compiler, run on every instruction the
CPU has, and report the ones it lacks as missing (the CPU flags decide which); each row's two rates agree with the
instruction's multiply-adds. No assertion depends on how fast the host ran: rates are checked against each other
and their units, never against bounds."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import pytest

from bertfast.backends.cpu import isa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The cpu_peak row of each instruction: the /proc/cpuinfo flags it needs, and the multiply-adds one instruction
# (one step: vpmaddwd+vpaddd together) does: 32-bit lanes x products per lane; a full tile 16 x 16 x K.
NEEDS = {"fp32 FMA zmm (vfmadd231ps)": {"avx512f"}, "fp32 FMA ymm (vfmadd231ps)": {"avx2", "fma"},
         "int8 VNNI zmm (vpdpbusd)": {"avx512_vnni"}, "bf16 dot zmm (vdpbf16ps)": {"avx512_bf16"},
         "int16 madd ymm (vpmaddwd+vpaddd)": {"avx2"}, "int8 VNNI ymm (AVX-VNNI vpdpbusd)": {"avx_vnni"},
         "bf16 AMX tile (tdpbf16ps)": {"amx_tile", "amx_bf16"}, "int8 AMX tile (tdpbssd)": {"amx_tile", "amx_int8"}}
MACS = {"fp32 FMA zmm (vfmadd231ps)": 16, "fp32 FMA ymm (vfmadd231ps)": 8, "int8 VNNI zmm (vpdpbusd)": 16 * 4,
        "bf16 dot zmm (vdpbf16ps)": 16 * 2, "int16 madd ymm (vpmaddwd+vpaddd)": 8 * 2,
        "int8 VNNI ymm (AVX-VNNI vpdpbusd)": 8 * 4, "bf16 AMX tile (tdpbf16ps)": 16 * 16 * 32,
        "int8 AMX tile (tdpbssd)": 16 * 16 * 64}


def _bench_peak():
    spec = importlib.util.spec_from_file_location("bench_peak", os.path.join(ROOT, "benchmarks", "bench_peak.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ops_agree(row: dict) -> bool:
    """ops/s = 2 ops per multiply-add x multiply-adds per instruction x instructions/ns x 1e9 x threads, within what
    cpu_peak's printing rounds off (ops/s to 4 significant digits, instructions/ns to 3 decimals)."""
    per_instruction = 2 * MACS[row["instruction"]] * 1e9 * row["threads"]
    slack = per_instruction * 0.0005 + row["ops_per_s"] * 0.0005
    return abs(row["ops_per_s"] - per_instruction * row["per_ns_per_thread"]) <= slack


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the ceiling loops are x86-64 instructions")
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler on PATH")
def test_bench_peak_rows():
    """A real (short) run: which rows, how many threads, rates positive and in agreement with the instruction's
    multiply-adds; how high they are is the host's business."""
    rows = _bench_peak().measure(0.02)
    flags = isa.proc_cpuinfo()[1]
    by = {}
    for r in rows:
        by.setdefault(r["instruction"], []).append(r)
    assert set(by) == set(NEEDS)
    every_core = set()
    for name, needs in NEEDS.items():
        if not needs <= flags:
            assert by[name] == [{"instruction": name, "missing": True}], name
            continue
        assert [r["threads"] for r in by[name]][:1] == [1] and len(by[name]) <= 2, by[name]  # one core, then all
        every_core |= {r["threads"] for r in by[name][1:]}
        for r in by[name]:
            assert r["ops_per_s"] > 0 and ops_agree(r), r
    assert len(every_core) <= 1 and all(t > 1 for t in every_core), every_core  # OpenMP's one count of threads


def test_measure_parses_cpu_peak_lines(monkeypatch):
    """measure() reads cpu_peak's tab-separated lines as they are printed: missing rows, then (threads, ops/s,
    instructions/ns/thread) as numbers, in order; the lines here are a 2-core host's, unchanged."""
    module = _bench_peak()
    printed = ("fp32 FMA zmm (vfmadd231ps)\t1\t6.4e+10\t2.000\n"
               "fp32 FMA zmm (vfmadd231ps)\t2\t1.216e+11\t1.900\n"
               "bf16 AMX tile (tdpbf16ps)\tmissing\n")
    monkeypatch.setattr(module, "build", lambda tmp: "cpu_peak")
    monkeypatch.setattr(module.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, stdout=printed))
    rows = module.measure(0.5)
    assert rows == [{"instruction": "fp32 FMA zmm (vfmadd231ps)", "threads": 1, "ops_per_s": 6.4e10,
                     "per_ns_per_thread": 2.0},
                    {"instruction": "fp32 FMA zmm (vfmadd231ps)", "threads": 2, "ops_per_s": 1.216e11,
                     "per_ns_per_thread": 1.9},
                    {"instruction": "bf16 AMX tile (tdpbf16ps)", "missing": True}]
    assert all(ops_agree(r) for r in rows[:2])  # 2 x 16 x 2.0 x 1e9 x 1; 2 x 16 x 1.9 x 1e9 x 2
    assert not ops_agree({**rows[0], "ops_per_s": 3.2e10})  # a per-instruction count off by 2 is caught


def test_measure_best_keeps_each_rows_best_run(monkeypatch):
    """bench_embed's ceiling: each row at its best of the runs (a run slowed by a neighbour lowers only itself)."""
    module = _bench_peak()
    runs = iter([[{"instruction": "a", "threads": 1, "ops_per_s": 5.0, "per_ns_per_thread": 0.5},
                  {"instruction": "a", "threads": 2, "ops_per_s": 9.0, "per_ns_per_thread": 0.45},
                  {"instruction": "b", "missing": True}],
                 [{"instruction": "a", "threads": 1, "ops_per_s": 6.0, "per_ns_per_thread": 0.6},
                  {"instruction": "a", "threads": 2, "ops_per_s": 2.0, "per_ns_per_thread": 0.1},
                  {"instruction": "b", "missing": True}]])
    monkeypatch.setattr(module, "measure", lambda seconds: next(runs))
    best = module.measure_best(0.1, 2)
    assert [r.get("ops_per_s") for r in best] == [6.0, 9.0, None]
    assert best[0]["per_ns_per_thread"] == 0.6 and best[1]["per_ns_per_thread"] == 0.45 and best[2]["missing"]


def test_embed_ceiling_is_the_instruction_the_tier_runs():
    """bench_embed compares each dtype's GEMMs with the row of the instruction they are built from on the active tier:
    on amx, bf16 and int8 against the tiles' rate (on an AMX host it printed bf16 at "551% of" vdpbf16ps's)."""
    spec = importlib.util.spec_from_file_location(
        "bench_embed", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_embed.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [{"instruction": name, "threads": 2, "ops_per_s": rate * 1e9, "per_ns_per_thread": 1.0}
            for name, rate in (("fp32 FMA zmm (vfmadd231ps)", 330.0), ("int8 VNNI zmm (vpdpbusd)", 1340.0),
                               ("bf16 dot zmm (vdpbf16ps)", 190.0), ("bf16 AMX tile (tdpbf16ps)", 5500.0),
                               ("int8 AMX tile (tdpbssd)", 12200.0), ("fp32 FMA ymm (vfmadd231ps)", 186.0))]
    amx = {"active": "amx", "native_bf16": True, "flags": ()}
    vnni = {"active": "avx512_vnni", "native_bf16": True, "flags": ()}
    nobf16 = {"active": "avx512_vnni", "native_bf16": False, "flags": ()}
    assert [module.gemm_ceiling(rows, d, amx) for d in ("fp32", "bf16", "int8")] == [330.0, 5500.0, 12200.0]
    assert [module.gemm_ceiling(rows, d, vnni) for d in ("fp32", "bf16", "int8")] == [330.0, 190.0, 1340.0]
    assert module.gemm_ceiling(rows, "bf16", nobf16) == 330.0
    assert module.gemm_ceiling(rows, "fp32", {"active": "avx2", "flags": ()}) == 186.0


def test_embed_rounds_table(capsys):
    """bench_embed --rounds: each row's median texts/s and its ratio to SentenceTransformer's of the same round (the
    median and the range over the rounds), a skipped row said once."""
    spec = importlib.util.spec_from_file_location(
        "bench_embed", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_embed.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    st, embed = module.ST_ROW, "bertfast embed"
    results = []
    for rnd, (base, rate) in enumerate(((100.0, 400.0), (150.0, 450.0), (120.0, 480.0))):
        results += [{"name": st, "dtype": "fp32", "texts_per_s": base, "peak_rss_mib": None, "round": rnd,
                     "ratio_vs_st_torch": 1.0},
                    {"name": embed, "dtype": "int8", "texts_per_s": rate, "peak_rss_mib": 400.0 + rnd, "round": rnd,
                     "ratio_vs_st_torch": rate / base},
                    {"name": "SentenceTransformer.encode (onnx)", "dtype": "fp32", "skipped": "no onnx", "round": rnd}]
    module.print_table(results, 3)
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith(embed)).split()
    assert row[-5:] == ["450.0", "x4.00", "x3.00-x4.00", "402", "MiB"]
    assert sum("skipped" in line for line in lines) == 1
    assert lines[-1].startswith("(median of 3 rounds")
