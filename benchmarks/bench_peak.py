"""Arithmetic ceilings of this CPU: the multiply-add rate of each instruction the native kernels' inner loops
are built from (fp32 FMA, int8 VNNI, bf16 dot products, AVX2's int16 madd and AVX-VNNI's vpdpbusd on ymm, AMX's
tdpbf16ps and tdpbssd on full tiles), on one core and on all of them.

    python benchmarks/bench_peak.py [--seconds 0.5] [--json PATH]

Compiles benchmarks/cpu_peak.cpp with the system C++ compiler (`CXX`, default c++; OpenMP) into a temporary
directory and runs it: 12 independent accumulators per loop, so each row is the core's issue rate for that
instruction, the most any GEMM built on it can reach. Instructions this CPU lacks are listed as missing.
What a kernel or a whole pipeline reaches is compared against these rows in benchmarks/README.md
("CPU ceilings measured here") and in the closing notes (the AMX rows: the ceilings of the GEMMs that
benchmarks/bench_amx_gemm.py times).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # runnable from a source checkout


def build(tmp: str) -> str:
    exe = os.path.join(tmp, "cpu_peak")
    cxx = os.environ.get("CXX", "c++")
    cmd = [cxx, "-O2", "-std=c++17", "-fopenmp", os.path.join(HERE, "cpu_peak.cpp"), "-o", exe]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"building cpu_peak.cpp failed ({' '.join(cmd)}):\n{proc.stderr}")
    return exe


def measure(seconds: float) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bertfast-peak-") as tmp:
        out = subprocess.run([build(tmp), str(seconds)], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split("\t")
        if fields[1] == "missing":
            rows.append({"instruction": fields[0], "missing": True})
        else:
            rows.append({"instruction": fields[0], "threads": int(fields[1]), "ops_per_s": float(fields[2]),
                         "per_ns_per_thread": float(fields[3])})
    return rows


def measure_best(seconds: float, runs: int) -> list[dict]:
    """`measure` `runs` times, each row at its best run: the ceiling, which a shared VM's moments of contention
    (seen on a 2-core Cascade Lake VM: one 0.3 s run at a quarter of its fp32 rate) only ever lower."""
    best = measure(seconds)
    for _ in range(runs - 1):
        for b, r in zip(best, measure(seconds)):
            if not r.get("missing") and r["ops_per_s"] > b["ops_per_s"]:
                b.update(r)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=0.5, help="per instruction and thread count")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the CPU here")
    args = ap.parse_args(argv)
    from bertfast.backends.cpu import isa

    info = isa.cpu_info()
    print(f"cpu {info['cpu']}, flags {' '.join(info['flags'])}, {os.cpu_count()} logical CPUs")
    rows = measure(args.seconds)
    print(f"{'instruction':<36} {'threads':>7} {'G ops/s':>9} {'instr/ns/thread':>16}")
    for r in rows:
        if r.get("missing"):
            print(f"{r['instruction']:<36} {'missing on this CPU':>34}")
        else:
            print(f"{r['instruction']:<36} {r['threads']:>7} {r['ops_per_s'] / 1e9:>9.1f} "
                  f"{r['per_ns_per_thread']:>16.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu_info": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
