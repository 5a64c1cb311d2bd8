"""`bertfast kernels`' report of Hopper features and its minimum architectures: the TMA column (PTX
`cp.async.bulk.tensor`) beside wgmma, in the table and the JSON; kernels of a module with `AOT_MIN_ARCH`, or a variant
with its own, are not built below it but listed as skipped; the optional fp8 module joins the build when it exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

pytest.importorskip("triton")

from bertfast.tools import aot  # noqa: E402

ROW = {"kernel": "linear_tma_gelu", "arch": "sm_90", "dtype": "fp16", "config": "M128 N128 K64 G8 w8 s4", "error": None,
       "registers": 164, "spill_stores": 0, "spill_loads": 0, "stack": 0, "shared_bytes": 163872, "compile_s": 5.3,
       "uses_dot": True, "wgmma": True, "tma": True, "warps": 8}


def test_the_table_has_a_tma_column(capsys):
    columns = aot._HEADER.split()
    assert columns[columns.index("wgmma") + 1] == "TMA"
    aot._print_row(ROW)
    aot._print_row({**ROW, "tma": False, "wgmma": False})
    aot._print_row({**ROW, "arch": "sm_80", "tma": False, "wgmma": False})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-3:] == ["yes", "yes", "5.3"]
    assert lines[1].split()[-3:] == ["no", "no", "5.3"]
    assert lines[2].split()[-3:] == ["-", "-", "5.3"]  # neither exists below sm_90: nothing to report


def _fake_module(min_arch=None):
    module = types.ModuleType("fake_kernels")
    if min_arch is not None:
        module.AOT_MIN_ARCH = min_arch

    def aot_variants(dtype):
        yield ("fake_a", None, {}, ["c0", "c1"])
        yield ("fake_hopper", None, {}, ["c0"], 90)  # a variant's own minimum

    module.aot_variants = aot_variants
    return module


def test_min_arch_variants_are_skipped_below_it(monkeypatch):
    archs = ["sm_80", "sm_89", "sm_90"]
    monkeypatch.setattr(aot, "kernel_modules", lambda: [_fake_module(89)])
    work, skipped = aot.plan(archs, "fp16", None, first_config=False)
    built = [(index, config, arch) for _, index, config, arch in work]
    assert built == [(0, 0, "sm_89"), (0, 0, "sm_90"), (0, 1, "sm_89"), (0, 1, "sm_90"), (1, 0, "sm_90")]
    assert skipped == [{"kernel": "fake_a", "arch": "sm_80", "reason": "needs sm_89 or later"},
                       {"kernel": "fake_hopper", "arch": "sm_80", "reason": "needs sm_90 or later"},
                       {"kernel": "fake_hopper", "arch": "sm_89", "reason": "needs sm_90 or later"}]
    # Without AOT_MIN_ARCH a module builds everywhere but where a variant says otherwise.
    monkeypatch.setattr(aot, "kernel_modules", lambda: [_fake_module()])
    work, skipped = aot.plan(["sm_80"], "fp16", {"fake_a", "fake_hopper"}, first_config=True)
    assert [(i, c, a) for _, i, c, a in work] == [(0, 0, "sm_80")] and [s["kernel"] for s in skipped] == ["fake_hopper"]


def test_the_real_modules_declare_their_min_arch():
    mins = {name: min_arch for name, _, _, _, min_arch in aot.variants("fp16")}
    assert mins["linear_tma_gelu"] == mins["qkv_tma_ws"] == 90
    assert mins["linear_gelu"] == mins["attention_varlen"] == 0


def test_every_kernel_module_is_built_above_its_min_arch():
    """Every kernel module declares its variants (the LoRA epilogues' and SGMV kernels' too); fp8's build from sm_89,
    the TMA GEMM's and the persistent layer's narrow-tile variants from sm_90, the rest everywhere."""
    from bertfast.kernels.triton import fp8, layer, linear_tma, lora

    names = [m.__name__ for m in aot.kernel_modules()]
    assert {fp8.__name__, layer.__name__, linear_tma.__name__, lora.__name__} <= set(names)
    mins = {v[0]: v[4] for v in aot.variants("fp16")}
    assert {mins[n] for n in mins if n.startswith("fp8_")} == {89}
    assert {mins[n] for n in mins if "tma" in n} == {90}
    assert mins["bert_layer"] == 0 and mins["bert_layer_s16"] == mins["bert_layer_s128"] == 90
    assert mins["lora_shrink"] == mins["lora_expand"] == mins["linear_gelu_lora"] == mins["qkv_lora"] == 0


def test_a_tma_kernel_builds_for_hopper_only(tmp_path):
    # One build (the default tile's QKV); started with TRITON_INTERPRET=1 the command re-runs itself compiled.
    out = tmp_path / "kernels.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "bertfast", "kernels", "--arch", "sm_80,sm_90", "--kernel", "qkv_tma",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TMA" in proc.stdout and "qkv_tma                sm_80  skipped: needs sm_90 or later" in proc.stdout
    report = json.loads(out.read_text())
    assert report["skipped"] == [{"kernel": "qkv_tma", "arch": "sm_80", "reason": "needs sm_90 or later"}]
    (build,) = report["builds"]
    assert build["arch"] == "sm_90" and build["error"] is None
    assert build["tma"] and build["wgmma"] and build["spill_stores"] == build["spill_loads"] == 0
