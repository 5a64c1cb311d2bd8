"""What bounds the AMX GEMMs: the tile unit's latency and rate, tile loads from L1 and L2, a load into a register
still being read, and the blocked kernel's own steps (csrc/cpu/gemm/amx_blocked.h), each timed alone on one core.

    python benchmarks/bench_amx_probe.py [--seconds 0.2] [--json PATH]
    python benchmarks/bench_amx_probe.py --emulated [--rounds 1000]   # any AVX-512 CPU: runs each probe, no timing

Compiles benchmarks/amx_probe.cpp with the system C++ compiler (`CXX`, default c++) and runs it. ns per instruction:
a multiply-add (tdpbf16ps, tdpbssd) for the chain and step rows, a tile load for the load rows; against the tile
unit's own rate (bench_peak.py: one every ~4.1 ns on the 2026-12-06 AMX host) a step row shows what the blocked
kernel's pattern costs, and the other rows which part. On a CPU without AMX (or where Linux does not grant the tile
state) it prints that they are missing. --emulated builds the same probes on emulated tiles
(csrc/cpu/common/amx_emulation.cpp, with AddressSanitizer where the compiler has it) and runs each --rounds times:
the check, on any CPU, that every probe's tiles stay inside its buffers (tests/test_amx_probe.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def build(tmp: str, emulated: bool = False) -> str:
    """The probe's executable in `tmp`: real tiles, or emulated (sanitized where the compiler links ASan)."""
    exe = os.path.join(tmp, "amx_probe" + ("_emulated" if emulated else ""))
    cxx = os.environ.get("CXX", "c++")
    cmd = [cxx, "-O2", "-std=c++17", f"-I{os.path.join(ROOT, 'csrc')}", os.path.join(HERE, "amx_probe.cpp")]
    if emulated:
        cmd += ["-DBF_AMX_EMULATED=1", os.path.join(ROOT, "csrc", "cpu", "common", "amx_emulation.cpp")]
        sanitized = cmd + ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-o", exe]
        if subprocess.run(sanitized, capture_output=True, text=True).returncode == 0:
            return exe
    cmd += ["-o", exe]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"building amx_probe.cpp failed ({' '.join(cmd)}):\n{proc.stderr}")
    return exe


def parse(out: str) -> list[dict]:
    rows = []
    for line in out.splitlines():
        name, value, *rest = line.split("\t")
        if value == "missing":
            rows.append({"probe": name, "missing": True})
        elif value == "ran":
            rows.append({"probe": name, "ran": int(rest[0])})
        else:
            rows.append({"probe": name, "ns": float(value), "count": int(rest[0])})
    return rows


def run(seconds: float = 0.2, emulated: bool = False, rounds: int = 0) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bertfast-amx-probe-") as tmp:
        args = [build(tmp, emulated), str(seconds)] + ([str(rounds)] if rounds else [])
        return parse(subprocess.run(args, capture_output=True, text=True, check=True).stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=0.2, help="per probe")
    ap.add_argument("--emulated", action="store_true", help="emulated tiles: run each probe, no timing")
    ap.add_argument("--rounds", type=int, default=1000, help="with --emulated: rounds of each probe")
    ap.add_argument("--json", metavar="PATH", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = run(args.seconds, args.emulated, args.rounds if args.emulated else 0)
    for r in rows:
        if r.get("missing"):
            print(f"{r['probe']:<48} missing on this CPU")
        elif "ran" in r:
            print(f"{r['probe']:<48} ran {r['ran']} instructions (emulated)")
        else:
            print(f"{r['probe']:<48} {r['ns']:8.2f} ns")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
