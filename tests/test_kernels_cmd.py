"""`bertfast kernels`: ahead-of-time GPU builds on a machine without a GPU, and their report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from bertfast.tools import aot as kernels  # noqa: E402

PTXAS_LOG = """ptxas info    : Compiling entry function '_linear_kernel' for 'sm_90a'
ptxas info    : Function properties for _linear_kernel
    24 bytes stack frame, 20 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size
"""


def test_parse_ptxas_reads_registers_and_spills():
    assert kernels._parse_ptxas(PTXAS_LOG) == {"registers": 255, "spill_stores": 20, "spill_loads": 16, "stack": 24}
    with pytest.raises(RuntimeError, match="cannot parse"):
        kernels._parse_ptxas("garbage")


def test_aot_build_reports_registers_and_wgmma(tmp_path):
    # One kernel with tl.dot and one without, Hopper only. Started with TRITON_INTERPRET=1 (as in
    # this test session), the command re-runs itself with the interpreter off and builds for GPU.
    out = tmp_path / "kernels.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "bertfast", "kernels", "--arch", "sm_90", "--kernel",
                           "attention_varlen,layernorm", "--first-config", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "regs" in proc.stdout and "attention_varlen" in proc.stdout
    builds = {b["kernel"]: b for b in json.loads(out.read_text())["builds"]}
    assert set(builds) == {"attention_varlen", "layernorm"}
    for b in builds.values():
        assert b["error"] is None and b["arch"] == "sm_90"
        assert 0 < b["registers"] <= 255
        assert b["spill_stores"] == b["spill_loads"] == 0
    assert builds["attention_varlen"]["wgmma"] and builds["attention_varlen"]["shared_bytes"] > 0
    assert not builds["layernorm"]["wgmma"]


def test_unknown_kernel_or_arch_is_an_error():
    env = dict(os.environ, TRITON_INTERPRET="0")
    for extra in (["--kernel", "nope"], ["--arch", "sm_70"]):
        proc = subprocess.run([sys.executable, "-m", "bertfast", "kernels", *extra], capture_output=True,
                              text=True, env=env, timeout=120)
        assert proc.returncode == 2 and "unknown" in proc.stderr
