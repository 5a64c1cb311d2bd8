"""ISA tiers: detection and the BERTFAST_ISA cap, and no library reference kernel under any cap.

Each forward of the reference-kernel test runs in a child process, because oneDNN, MKL and ATen read
their caps (set by `bertfast.cap_libraries()` from BERTFAST_ISA) once per process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import bertfast
from bertfast.backends.cpu import isa

from conftest import CAPS, TIERS, supported_tiers

pytestmark = pytest.mark.skipif(not supported_tiers(), reason="bertfast._C is not built")


def _child(code: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("BERTFAST_ISA", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                             "MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_VERBOSE", "DNNL_VERBOSE")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def test_tiers_detected_in_order():
    tiers = supported_tiers()
    assert tiers[-1] == "portable"
    # A tier is supported only with every tier below it; amx_emulated is never the detected one, and active only
    # where BERTFAST_ISA asks for it (the whole suite may run so: docs/tiers.md#amx_emulated).
    assert tiers == list(TIERS[TIERS.index(tiers[0]):])
    assert tiers == isa.supported_tiers()
    info = bertfast.cpu_info()
    assert info["detected"] == next(t for t in tiers if t != isa.EMULATED)
    assert info["active"] in tiers
    asked = isa.requested_cap() == isa.EMULATED and isa.EMULATED in tiers
    assert (info["active"] == isa.EMULATED) == asked, info
    assert info["amx_emulated"] == (isa.EMULATED in tiers)


def test_amx_emulated_needs_avx512_vnni():
    """amx_emulated runs wherever the CPU has the amx tier's code around the tiles (AVX-512 VNNI; its bf16
    conversions are emulated too, so AVX-512 BF16 is not needed)."""
    assert (isa.EMULATED in supported_tiers()) == ("avx512_vnni" in supported_tiers())
    reason = isa.unsupported(isa.EMULATED, ["avx2", "portable"])
    assert "needs a CPU with AVX-512 VNNI" in reason
    assert "its best: avx512_vnni" in isa.unsupported("amx", ["amx_emulated", "avx512_vnni", "avx2", "portable"])


@pytest.mark.parametrize("tier", CAPS)
def test_cap_from_environment(tier):
    """BERTFAST_ISA caps the extension, and `cap_libraries` passes the cap on to oneDNN, MKL and ATen."""
    out = _child("""
        import ctypes, json, os, torch, bertfast
        bertfast.cap_libraries()
        torch.mm(torch.randn(64, 64), torch.randn(64, 64))
        env = {k: os.environ.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
                                              "ATEN_CPU_CAPABILITY")}
        try:  # MKL's own reading of MKL_CBWR (MKL_CBWR_BRANCH = 1), where torch links MKL with its symbols
            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
            branch = lib.mkl_serv_cbwr_get(1)
        except (OSError, AttributeError):
            branch = None
        print(json.dumps({"info": bertfast.cpu_info(), "env": env, "mkl_branch": branch,
                          "bf16": bertfast._C.has_avx512_bf16()}))
    """, {"BERTFAST_ISA": tier}, timeout=120)
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout.strip().splitlines()[-1])
    info, env = child["info"], child["env"]
    detected = next(t for t in supported_tiers() if t != isa.EMULATED)
    want = isa.cap_tier(tier)
    if isa.unsupported(tier) is None:  # amx_emulated runs where supported, above a detected avx512_vnni too
        expected = want
    else:
        expected = want if TIERS.index(want) >= TIERS.index(detected) else detected
    assert info["cap"] == tier and info["detected"] == detected and info["active"] == expected
    if tier == isa.NO_BF16:  # hidden from the kernels, from oneDNN and from dtype="auto"
        assert not child["bf16"] and not info["native_bf16"] and "BF16" not in env["ONEDNN_MAX_CPU_ISA"]
    caps = isa.library_caps(tier)
    assert {k: v for k, v in env.items() if v is not None} == caps  # every variable of the cap, no other
    if tier != "amx":
        assert info["onednn_max_isa"] == caps["ONEDNN_MAX_CPU_ISA"]
        assert info["mkl_instructions"] == caps["MKL_ENABLE_INSTRUCTIONS"]
        assert not info["onednn_amx"] and not info["mkl_amx"]
    # MKL ignores MKL_ENABLE_INSTRUCTIONS on non-Intel CPUs; COMPATIBLE (its SSE2 path) holds everywhere.
    assert info["mkl_cbwr"] == caps.get("MKL_CBWR", "default")
    if tier == "portable" and child["mkl_branch"] is not None:
        assert child["mkl_branch"] == 3  # MKL_CBWR_COMPATIBLE


def test_unknown_tier_is_refused():
    out = _child("import bertfast", {"BERTFAST_ISA": "sse9"}, timeout=120)
    assert out.returncode != 0
    assert "BERTFAST_ISA='sse9' is not an ISA tier" in out.stderr


def test_emulated_tier_runs_or_says_why_not():
    """BERTFAST_ISA=amx_emulated runs the AMX code where the CPU can (AVX-512 VNNI), and elsewhere warns
    that it runs the CPU's own tier instead."""
    code = """
        import warnings
        warnings.simplefilter("always")
        import bertfast
        print("isa", bertfast._C.isa())
    """
    out = _child(code, {"BERTFAST_ISA": "amx_emulated"}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    reason = isa.unsupported("amx_emulated")
    if reason is None:
        assert "isa amx_emulated" in out.stdout.splitlines() and "BERTFAST_ISA=amx_emulated" not in out.stderr
    else:
        best = isa.supported_tiers()[0]
        assert f"isa {best}" in out.stdout.splitlines()
        assert f"BERTFAST_ISA=amx_emulated: {reason}; the kernels run {best}" in out.stderr, out.stderr


# Forwards of 3 x 200 tokens (int8, fp32, bf16) on the cpu backend, every oneDNN primitive logged.
_FORWARDS = """
    import torch, transformers, bertfast
    bertfast.cap_libraries()
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=512, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(1, 120, (3, 200))
    mask = torch.ones_like(ids)
    mask[1, 150:] = 0
    for dtype in ("int8", torch.float32, torch.bfloat16):
        enc = bertfast.Encoder.from_hf(model, backend="cpu", dtype=dtype)
        print("forward", dtype, enc(ids, attention_mask=mask).last_hidden_state.float().abs().sum().item(), flush=True)
    print("isa", bertfast._C.isa())
"""


@pytest.mark.parametrize("tier", CAPS)
def test_no_reference_kernel(tier):
    """int8, fp32 and bf16 forwards of several hundred tokens never run a oneDNN reference primitive."""
    reason = isa.unsupported(tier)
    if reason is not None:
        pytest.skip(reason)
    out = _child(_FORWARDS, {"BERTFAST_ISA": tier, "ONEDNN_VERBOSE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert f"isa {isa.cap_tier(tier)}" in lines
    assert sum(line.startswith("forward") for line in lines) == 3
    executed = [line for line in lines if line.startswith("onednn_verbose") and ",exec," in line]
    # The implementation is the field after the primitive kind: "ref:any", "ref_int8:any", "gemm:jit", ...
    reference = [line for line in executed if line.split(",exec,")[1].split(",")[2].startswith("ref")]
    assert not reference, "oneDNN ran reference kernels:\n" + "\n".join(reference[:5])
    if tier != "amx":  # below AMX the int8 GEMMs are the extension's own: no oneDNN int8 primitive at all
        assert not [line for line in executed if "s8:" in line or "u8:" in line], "oneDNN int8 below amx"


def test_extension_uses_the_process_cxx_runtime():
    """The extension links libstdc++ dynamically and carries no copy of it: torch loads the system's, and a second,
    static copy (what one device host's compiler, CXX=/opt/gcc/bin/g++, produced) shares the first one's global data
    through the dynamic linker, so formatting a number into an error message segfaulted there
    (benchmarks/results/amx-2026-11-27)."""
    from bertfast import _C

    if shutil.which("readelf") is None or shutil.which("nm") is None:
        pytest.skip("needs binutils (readelf, nm)")
    dynamic = subprocess.run(["readelf", "-d", _C.__file__], capture_output=True, text=True, check=True).stdout
    assert "[libstdc++.so" in dynamic, f"{_C.__file__} does not link libstdc++ dynamically:\n{dynamic}"
    symbols = subprocess.run(["nm", "-D", "--defined-only", _C.__file__], capture_output=True, text=True,
                             check=True).stdout.split("\n")
    runtime = [s for s in symbols if s.split(" ")[-1].startswith(("_ZNSt6locale", "_ZNSo", "_ZNSt8ios_base"))]
    assert not runtime, f"{_C.__file__} defines the C++ runtime's own symbols: {runtime[:5]}"
